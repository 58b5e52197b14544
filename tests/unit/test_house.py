"""The house by job: the rooms the README's table names, and the rules between them.

The controller (`mlxcluster/`) has a room per stage of a run's way, in the order data flows through
it; a room may use the rooms below it, never one above (a lower floor that reached up would bring
the whole house with it: the inventory rules into a plugin, the lab into training). The code on
the nodes (`training/`) never imports the controller. No module imports itself back through
others, the lab's included. Each module says its one job in a docstring, and each test folder
mirrors a folder of the repository.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# mlxcluster's rooms, bottom up. The basics at its top (errors, paths, local) are under every
# room; devtools (invoke lint and test) is above them all.
FLOORS = ["describe", "provision", "launch", "check", "jobs", "lab", "bench"]
BASICS = {"mlxcluster.errors", "mlxcluster.paths", "mlxcluster.local"}
TOP_OF_HOUSE = {"mlxcluster.devtools"}
MAX_TOP = {"mlxcluster": 6, "training": 8}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(package: str) -> Iterator[Path]:
    yield from sorted((REPO / package).rglob("*.py"))


def imports_of(path: Path) -> set[str]:
    """The modules of this repository that `path` imports, wherever in the file (a function's
    late import is an import all the same)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    ours = set()
    for name in found:
        if name.split(".")[0] in ("mlxcluster", "training"):
            target = REPO / Path(*name.split("."))
            if target.with_suffix(".py").is_file():
                ours.add(name)
    return ours


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for package in ("mlxcluster", "training"):
        for path in modules(package):
            if path.name != "__init__.py":
                edges[module_name(path)] = imports_of(path) - {module_name(path)}
    return edges


def room_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "mlxcluster" and len(parts) > 2 else None


def floor(module: str) -> int:
    if module in BASICS:
        return -1
    if module in TOP_OF_HOUSE:
        return len(FLOORS)
    room = room_of(module)
    assert room in FLOORS, f"{module}: not in a room the README names ({', '.join(FLOORS)})"
    return FLOORS.index(room)


def test_no_module_imports_itself_back():
    edges = graph()
    cycles = []
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done

    def walk(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*path[path.index(target):], target]))
            elif target not in state:
                walk(target, [*path, target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            walk(module, [module])
    assert cycles == []


def test_the_nodes_code_never_imports_the_controller():
    reaching = {m: sorted(t for t in targets if t.startswith("mlxcluster"))
                for m, targets in graph().items() if m.startswith("training")}
    assert {m: t for m, t in reaching.items() if t} == {}


def test_no_room_of_the_controller_reaches_up():
    upward = [f"{m} -> {t}" for m, targets in graph().items() if m.startswith("mlxcluster")
              for t in targets if t.startswith("mlxcluster") and floor(t) > floor(m)]
    assert upward == []


@pytest.mark.parametrize("package", sorted(MAX_TOP))
def test_few_modules_are_left_at_the_top(package):
    top = sorted(p.name for p in (REPO / package).glob("*.py")
                 if p.name not in ("__init__.py", "__main__.py"))
    assert len(top) <= MAX_TOP[package], top


def test_every_module_says_its_one_job():
    ours = [*modules("mlxcluster"), *modules("training"), *modules("filter_plugins"), *modules("library"),
            *REPO.glob("roles/*/library/*.py"), REPO / "tasks.py"]
    silent = [str(p.relative_to(REPO)) for p in ours if not ast.get_docstring(ast.parse(p.read_text()))]
    assert silent == []


def test_every_test_folder_mirrors_a_folder_of_the_repository():
    unit = REPO / "tests" / "unit"
    # tests/unit/ansible/ holds the tests of the Ansible side: roles, playbooks, plugins, modules.
    strays = [str(d.relative_to(unit)) for d in unit.rglob("*") if d.is_dir()
              and d.name not in ("__pycache__", "ansible") and not (REPO / d.relative_to(unit)).is_dir()]
    assert strays == []


def test_the_readme_names_every_room():
    readme = (REPO / "README.md").read_text()
    rooms = [f"`{d.relative_to(REPO)}/`" for package in ("mlxcluster", "training")
             for d in sorted((REPO / package).iterdir()) if (d / "__init__.py").is_file()]
    assert [room for room in rooms if room not in readme] == []
