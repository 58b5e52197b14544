"""The docs (README.md and docs/*.md) say only what tasks.py takes, and hold together.

Every `invoke` command in a fenced block of a doc is parsed by invoke's own parser against the
tasks' collection, as `invoke` would parse it: the task exists, every flag is one of its options,
a flag that takes a value has one, and a value the task reads as a whole number or as one of a few
choices is one (read by the task's own readers, `mlxcluster/jobs/flags.py`). A failure names the
file, the line and the command. tests/cluster/test_docs.py runs the commands that touch nothing
against a lab cluster.

The rest keeps the docs one whole: every page has a title, a summary and a way back to the README,
the README links every page, every relative link leads to a file (and heading) that exists, and
the README's test command is the one CI runs.
"""

from __future__ import annotations

import ast
import inspect
import re
import shlex
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from invoke import Parser, ParserContext, Program
from invoke.exceptions import ParseError

import tasks
from mlxcluster.errors import UserError

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# A fenced block holds commands when it is marked as shell, or not marked at all (the README's
# "next:" block, which invoke train prints); a `text` block is a picture or output.
COMMAND_BLOCKS = {"", "sh", "bash", "shell", "console"}
# What may stand before `invoke` on a documented line: root for the lab, the first-run setup.
PREFIXES = ("sudo ", "bin/setup && ")
INVOKES = (".venv/bin/invoke", "invoke")


@dataclass(frozen=True)
class Documented:
    """One `invoke` command as a doc shows it."""

    file: Path
    line: int
    text: str  # the line as written
    argv: tuple[str, ...]  # the words after `invoke`, the doc's comment left out

    def __str__(self) -> str:
        where = self.file.relative_to(REPO) if self.file.is_relative_to(REPO) else self.file
        return f"{where}:{self.line}: {self.text}"


def invoke_words(line: str) -> list[str] | None:
    """The words after `invoke` when the line is an invoke command, else None (output, another
    program, a comment)."""
    rest = line.strip()
    if rest.startswith(("#", "==>")):
        return None
    for prefix in PREFIXES:
        rest = rest.removeprefix(prefix)
    program = next((p for p in INVOKES if rest == p or rest.startswith(p + " ")), None)
    if program is None:
        return None
    # comments=True: a `# ...` after the command is the doc's note, not an argument.
    return shlex.split(rest[len(program):], comments=True)


def documented_commands(files: Sequence[Path] = DOCS) -> list[Documented]:
    """Every invoke command in the fenced command blocks of `files`, in file and line order."""
    found = []
    for file in files:
        block: str | None = None  # the open block's info string; None outside a block
        for number, line in enumerate(file.read_text().splitlines(), 1):
            if line.strip().startswith("```"):
                block = line.strip()[3:].strip() if block is None else None
            elif block in COMMAND_BLOCKS and (words := invoke_words(line)) is not None:
                found.append(Documented(file, number, line.strip(), tuple(words)))
    return found


def parser() -> Parser:
    """invoke's parser over tasks.py's collection, with invoke's own flags first, as `invoke`
    builds it."""
    initial = Program(namespace=tasks.ns).initial_context
    return Parser(contexts=tasks.ns.to_contexts(), initial=initial)


def parse(command: Documented) -> list[ParserContext]:
    """The command's task contexts as invoke parses them (a ParseError when it would not)."""
    return [context for context in parser().parse_argv(list(command.argv)) if context.name]


# --- the values a task reads itself -----------------------------------------------------------

# The readers in mlxcluster/jobs/flags.py a task's body hands a flag's text to itself (most tasks
# have theirs read by their `Flags` before the body runs).
READERS = {"whole_number", "whole_numbers", "number", "one_of", "interface"}


def value_readers(body: Any) -> dict[str, list[ast.Call]]:
    """parameter -> the reader calls in the task's body that take it as it came."""
    tree = ast.parse(Path(inspect.getsourcefile(body) or "").read_text())
    function = next(node for node in tree.body
                    if isinstance(node, ast.FunctionDef) and node.name == body.__name__)
    params = {arg.arg for arg in function.args.args}
    readers: dict[str, list[ast.Call]] = {}
    for node in ast.walk(function):
        if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Name)):
            continue
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        if name in READERS and node.args[0].id in params:
            readers.setdefault(node.args[0].id, []).append(node)
    return readers


def misread_values(context: ParserContext) -> list[str]:
    """What the task's own readers refuse among the values the command gives: its flags' readers
    (`Flags.read`, as the task runs it) and any in its body."""
    task = tasks.ns[context.name]
    module = sys.modules[task.body.__module__]
    readers = value_readers(task.body)
    refused = []
    for argument in context.args.values():
        if not argument.got_value:
            continue
        param = argument.attr_name or argument.name  # attr_name: a dashed flag's parameter name
        values = argument.value if isinstance(argument.value, list) else [argument.value]
        for value in values:
            try:
                task.flags.read({param: value})
            except UserError as error:
                refused.append(str(error))
            for call in readers.get(param, []):
                code = compile(ast.Expression(call), module.__file__ or "", "eval")
                try:
                    eval(code, vars(module), {param: value})  # the task's own reading
                except UserError as error:
                    refused.append(str(error))
    return refused


# --- the commands -------------------------------------------------------------------------------

COMMANDS = documented_commands()


def test_the_docs_show_their_commands_where_the_extractor_finds_them():
    """A change of format that hid the commands from the extractor would pass every test below."""
    readme = [c.argv for c in COMMANDS if c.file.name == "README.md"]
    assert ("provision", "train") in readme and ("test",) in readme
    assert {c.file.name for c in COMMANDS} >= {"README.md", "training.md", "serving.md", "any-job.md"}
    assert len(COMMANDS) > 40


def refusal(command: Documented) -> str | None:
    """Why invoke or the task would refuse the command, naming where the doc shows it; None if
    neither would."""
    try:
        contexts = parse(command)
    except (ParseError, ValueError) as error:  # ValueError: invoke casting a typed flag's value
        return f"{command}\n  invoke would refuse it: {error}"
    if not contexts:
        return f"{command}\n  names no task"
    if refused := [said for context in contexts for said in misread_values(context)]:
        return f"{command}\n  the task would refuse it: {'; '.join(refused)}"
    return None


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_every_documented_invoke_command_is_one_tasks_py_takes(command: Documented):
    assert refusal(command) is None, refusal(command)


def test_a_task_flag_or_value_that_tasks_py_does_not_take_is_named_with_its_file_and_line(tmp_path: Path):
    """The test above, on a doc that names what tasks.py does not have."""
    doc = tmp_path / "broken.md"
    doc.write_text("Some prose.\n\n```sh\n.venv/bin/invoke train --itres 5   # a typo\n"
                   ".venv/bin/invoke trian -i inventory/studio/hosts.yml\n"
                   ".venv/bin/invoke train --iters many\n.venv/bin/invoke serve --port\n```\n")
    said = [refusal(command) for command in documented_commands([doc])]
    assert said[:3] == [
        f"{doc}:4: .venv/bin/invoke train --itres 5   # a typo\n  invoke would refuse it: "
        "No idea what '--itres' is!",
        f"{doc}:5: .venv/bin/invoke trian -i inventory/studio/hosts.yml\n  invoke would refuse it: "
        "No idea what 'trian' is!",
        f"{doc}:6: .venv/bin/invoke train --iters many\n  the task would refuse it: "
        "--iters 'many': give a whole number of at least 1",
    ]
    # invoke names the flag with the short flag it gave it, whose letter may change.
    assert re.fullmatch(re.escape(f"{doc}:7: .venv/bin/invoke serve --port\n  invoke would refuse it: ")
                        + r"Flag <Argument: port \(\w\)> needed value and was not given one!", str(said[3]))


def test_output_pictures_and_other_programs_are_not_taken_for_commands(tmp_path: Path):
    doc = tmp_path / "mixed.md"
    doc.write_text("```text\n invoke provision    ansible-playbook site.yml    ──►   the nodes\n```\n"
                   "```sh\n# ==> invoke train said this\ncurl -s localhost:8080/v1/models\n"
                   "sudo .venv/bin/invoke lab.up --nodes 3      # as root\n"
                   "bin/setup && .venv/bin/invoke provision train\n```\n"
                   "```\nnext:\n  invoke serve --run <timestamp>   # behind an API\n```\n"
                   "Prose: `invoke doctor` is not in a block.\n")
    assert [c.argv for c in documented_commands([doc])] == [
        ("lab.up", "--nodes", "3"), ("provision", "train"), ("serve", "--run", "<timestamp>")]


# --- the pages ----------------------------------------------------------------------------------

PAGES = sorted((REPO / "docs").glob("*.md"))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_page_has_a_title_a_summary_and_a_way_back(page: Path):
    paragraphs = [p.strip() for p in page.read_text().split("\n\n") if p.strip()]
    assert paragraphs[0].startswith("# ") and "\n" not in paragraphs[0], f"{page.name}: no # title first"
    assert not paragraphs[1].startswith(("#", "```", "|", "-", "[")), f"{page.name}: no summary paragraph"
    assert "](../README.md)" in page.read_text(), f"{page.name}: no link back to the README"


def test_the_readme_links_every_page():
    readme = (REPO / "README.md").read_text()
    assert [p.name for p in PAGES if f"](docs/{p.name})" not in readme] == []


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    headings = [line.lstrip("#").strip() for line in outside_blocks(page.read_text()) if line.startswith("#")]
    return {slug(h) for h in headings}


def outside_blocks(text: str) -> Iterator[str]:
    inside = False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            inside = not inside
        elif not inside:
            yield line


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", [REPO / "README.md", *PAGES], ids=lambda p: p.name)
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(page: Path):
    broken = []
    for line in outside_blocks(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{target}: no {file}")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{target}: no heading #{anchor} in {file.relative_to(REPO)}")
    assert broken == [], f"{page.name}: " + "; ".join(broken)


def test_the_readme_test_command_is_the_one_ci_runs():
    """.ci/run runs exactly the README's test command: what a newcomer types is what CI proves."""
    readme = next(c for c in COMMANDS if c.file.name == "README.md" and c.argv == ("test",))
    command = readme.text.split("#")[0].strip()
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if not line.startswith("#")]
    assert command in ci
    # ...with every lab test required: a runner that cannot start the lab is red, not green.
    assert "export MLX_LAB_REQUIRED=1" in ci[:ci.index(command)]


def test_the_cluster_picture_is_an_svg_with_readable_text():
    import xml.etree.ElementTree as ElementTree

    svg = ElementTree.parse(REPO / "docs" / "cluster.svg").getroot()
    texts: list[Any] = [e.text for e in svg.iter("{http://www.w3.org/2000/svg}text")]
    assert svg.tag == "{http://www.w3.org/2000/svg}svg"
    assert {"rank 0 = launcher", "Thunderbolt cables", "ssh / Ansible"} <= set(texts)
