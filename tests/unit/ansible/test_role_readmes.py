"""The role READMEs, kept in step with the roles they describe.

Every roles/<role>/README.md has one shape: its level-2 sections start with What it does,
Requirements, Variables and Example, in that order, and its Variables section holds a table
`| variable | default | meaning |` with one row per option of meta/argument_specs.yml (all entry
points). Here also: every role default is a declared option, every option has a default somewhere
(defaults/main.yml, the spec's `required`, or playbooks/group_vars/all/) unless listed below, and
the default column agrees with the real default where that is a plain value.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
ROLES = sorted(path for path in (REPO / "roles").iterdir() if path.is_dir())
GROUP_VARS = REPO / "playbooks" / "group_vars" / "all"

SECTIONS = ["What it does", "Requirements", "Variables", "Example"]
TABLE_HEADER = ["variable", "default", "meaning"]
# What the default column says of an option whose default is a shipped group var.
FROM_GROUP_VARS = "from the inventory (playbooks/group_vars/all)"

# Options with no default anywhere Ansible looks, on purpose: the inventory sets them or leaves
# them unset, and the code that reads them says what unset means (mlxcluster/describe/topology.py:
# bridge mode unless cables are listed, and its own pool).
LEFT_UNSET = {
    "thunderbolt": {"thunderbolt_ip", "thunderbolt_topology", "thunderbolt_links", "thunderbolt_link_pool"},
}


def load_yaml(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


def spec_options(role: Path) -> dict[str, dict[str, Any]]:
    """The options of every entry point of the role, by name (an option in several entry points
    is required if any of them requires it)."""
    options: dict[str, dict[str, Any]] = {}
    for entry in load_yaml(role / "meta" / "argument_specs.yml")["argument_specs"].values():
        for name, spec in (entry.get("options") or {}).items():
            merged = options.setdefault(name, {})
            merged["required"] = merged.get("required", False) or spec.get("required", False)
    return options


def role_defaults(role: Path) -> dict[str, Any]:
    return load_yaml(role / "defaults" / "main.yml")


@functools.cache
def group_vars() -> dict[str, Any]:
    """The shipped defaults every host sees (playbooks/group_vars/all/*.yml)."""
    merged: dict[str, Any] = {}
    for path in sorted(GROUP_VARS.glob("*.yml")):
        merged.update(load_yaml(path))
    return merged


def markdown_lines(text: str) -> list[str]:
    """The lines of a Markdown text outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def headings(readme: Path) -> list[str]:
    return [line[3:].strip() for line in markdown_lines(readme.read_text()) if line.startswith("## ")]


def section(readme: Path, title: str) -> list[str]:
    """The lines of the level-2 section `title` (outside code blocks), up to the next one."""
    lines = markdown_lines(readme.read_text())
    start = lines.index(f"## {title}") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def cells(row: str) -> list[str]:
    """A table row's cells; `\\|` is a pipe inside a cell."""
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip())[1:-1]]


def variables_table(role: Path) -> dict[str, str]:
    """The README's Variables table: the default column by variable name."""
    lines = section(role / "README.md", "Variables")
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    header, separator, *rows = [cells(line) for line in lines[start:end]]
    assert header == TABLE_HEADER, f"{role.name}: the Variables table's header is {header}"
    assert all(re.fullmatch(r":?-+:?", cell) for cell in separator)
    table: dict[str, str] = {}
    for row in rows:
        name = re.fullmatch(r"`(\w+)`", row[0])
        assert name, f"{role.name}: {row[0]!r} is not a variable name in backticks"
        assert name[1] not in table, f"{role.name}: {name[1]} has two rows"
        table[name[1]] = row[1]
    return table


def is_plain(value: Any) -> bool:
    """A default the README can quote: a string, number or boolean, not a Jinja expression."""
    if isinstance(value, str):
        return "{{" not in value and "{%" not in value
    return isinstance(value, (bool, int, float))


def as_text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def quoted_default(cell: str) -> str:
    """The value a default cell quotes: its first code span (else the whole cell), unquoted."""
    code = re.search(r"`([^`]*)`", cell)
    text = code[1] if code else cell
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


@pytest.mark.parametrize("role", ROLES, ids=lambda role: role.name)
def test_readme_opens_with_the_four_sections(role):
    found = headings(role / "README.md")
    assert found[: len(SECTIONS)] == SECTIONS, f"{role.name}/README.md's sections are {found}"


@pytest.mark.parametrize("role", ROLES, ids=lambda role: role.name)
def test_variables_table_lists_every_option(role):
    documented, declared = set(variables_table(role)), set(spec_options(role))
    assert documented == declared, (
        f"{role.name}/README.md: no row for {sorted(declared - documented)}, "
        f"rows for undeclared {sorted(documented - declared)}")


@pytest.mark.parametrize("role", ROLES, ids=lambda role: role.name)
def test_every_role_default_is_a_declared_option(role):
    undeclared = set(role_defaults(role)) - set(spec_options(role))
    assert not undeclared, f"{role.name}: defaults/main.yml sets undeclared {sorted(undeclared)}"


@pytest.mark.parametrize("role", ROLES, ids=lambda role: role.name)
def test_every_option_is_defaulted_or_required(role):
    defaults, shipped = role_defaults(role), group_vars()
    undefaulted = {name for name, spec in spec_options(role).items()
                   if name not in defaults and not spec["required"] and name not in shipped}
    # Equal, not a subset: a name left in LEFT_UNSET once it gets a default fails too.
    assert undefaulted == LEFT_UNSET.get(role.name, set())


@pytest.mark.parametrize("role", ROLES, ids=lambda role: role.name)
def test_default_column_agrees_with_the_defaults(role):
    defaults, shipped, options = role_defaults(role), group_vars(), spec_options(role)
    wrong = []
    for name, cell in variables_table(role).items():
        if name in defaults:
            value = defaults[name]
        elif name in shipped:
            value = shipped[name]
            if FROM_GROUP_VARS not in cell:
                wrong.append(f"{name}: {cell!r} does not say {FROM_GROUP_VARS!r}")
        else:
            if options.get(name, {}).get("required") and cell != "required":
                wrong.append(f"{name}: {cell!r}, but it is required")
            continue
        if is_plain(value) and quoted_default(cell) != as_text(value):
            wrong.append(f"{name}: {cell!r}, but the default is {value!r}")
    assert not wrong, f"{role.name}/README.md: " + "; ".join(wrong)
