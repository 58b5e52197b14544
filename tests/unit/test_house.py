"""The house by job: the rooms the README's table names, and the rules between them.

The controller (`mlxcluster/`) has a room per stage of a run's way, in the order data flows through
it; a room may use the rooms below it, never one above (a lower floor that reached up would bring
the whole house with it: the inventory rules into a plugin, the lab into training). The code on
the nodes (`training/`) never imports the controller. No module imports itself back through
others, the lab's included. Each module says its one job in a docstring, and each test folder
mirrors a folder of the repository: a module's tests are at its path, or, for the modules in
TESTED_THROUGH, where it says (docs/house.md says so).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# mlxcluster's rooms, bottom up. The basics at its top (errors, paths, local) are under every
# room; devtools (invoke lint and test) is above them all.
FLOORS = ["describe", "provision", "launch", "plan", "check", "jobs", "lab", "bench"]
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
            *REPO.glob("roles/*/library/*.py"), REPO / "tasks.py", REPO / "bench_tasks.py"]
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


# The modules whose tests are not at their own path (tests/unit/<folder>/test_<name>.py), and where
# they are: the tests of a module that uses them or that they run (its path: it has tests of its
# own and names this one), or a test file that names them or a module that runs them (tests/...).
TESTED_THROUGH = {
    "training/config_file.py": "tests/unit/training/test_config.py",
    "training/parallel_rules.py": "tests/unit/training/sharding/test_pipeline.py",
    "training/sharding/stage_layout.py": "tests/unit/training/sharding/test_pipeline.py",
    "mlxcluster/local.py": "mlxcluster/provision/ansible.py",
    "mlxcluster/paths.py": "tests/unit/mlxcluster/jobs/test_everywhere.py",
    "mlxcluster/describe/addresses.py": "mlxcluster/describe/record.py",
    "mlxcluster/describe/cluster.py": "tests/unit/mlxcluster/jobs/test_train.py",
    "mlxcluster/describe/drained.py": "mlxcluster/jobs/restarts.py",
    "mlxcluster/check/checks.py": "mlxcluster/check/doctor.py",
    "mlxcluster/launch/parallel.py": "mlxcluster/check/doctor.py",
    "mlxcluster/launch/relay.py": "tests/unit/mlxcluster/launch/test_runs.py",
    "mlxcluster/launch/remote.py": "tests/unit/mlxcluster/launch/test_builder.py",
    "mlxcluster/jobs/request.py": "mlxcluster/jobs/train.py",
    "mlxcluster/plan/job.py": "tests/unit/mlxcluster/plan/test_memory.py",
    "mlxcluster/lab/__main__.py": "mlxcluster/lab/hosts.py",
    "mlxcluster/lab/system.py": "mlxcluster/lab/hosts.py",
    "mlxcluster/bench/shares.py": "tests/unit/mlxcluster/launch/test_batch_shares.py",
    "mlxcluster/bench/results.py": "mlxcluster/bench/overhead.py",
    "mlxcluster/bench/stock.py": "mlxcluster/bench/scaling.py",
    "mlxcluster/bench/train.py": "tests/cluster/test_benches.py",
    "training/command_line.py": "training/config.py",
    "training/older_keys.py": "training/config.py",
    "training/loading.py": "training/finetune.py",
    "training/data/batches.py": "tests/unit/training/data/test_shares.py",
    "training/data/chat.py": "tests/unit/training/data/test_tool_calls.py",
    "training/data/examples.py": "training/data/prepare.py",
    "training/data/formats.py": "training/data/prepare.py",
    "training/data/make_pirate.py": "tests/unit/training/data/test_prepare.py",
    "training/examples/mpi4py_allreduce.py": "tests/cluster/test_train.py",
    "training/examples/xgboost_tracker.py": "tests/cluster/test_train.py",
    "training/loop/checkpoint.py": "tests/unit/training/loop/test_resume_parts.py",
    "training/loop/checkpoint_files.py": "mlxcluster/launch/shipment.py",
    "training/loop/optimizers.py": "training/config.py",
    "training/loop/progress.py": "training/loop/metrics.py",
    "training/loop/resume.py": "training/finetune.py",
    "training/loop/watchdog.py": "tests/unit/training/loop/test_resume_parts.py",
    "training/model/__main__.py": "training/model/folder.py",
    "training/model/manifest.py": "training/model/folder.py",
    "training/model/stand_in.py": "tests/unit/mlxcluster/check/test_room.py",
    "training/serve/__main__.py": "tests/unit/training/serve/test_server.py",
    "training/serve/adapters.py": "tests/unit/training/serve/test_server.py",
    "training/serve/model.py": "training/serve/server.py",
    "training/sharding/head_groups.py": "training/sharding/tensor_parallel.py",
    "training/sharding/parts.py": "training/sharding/tensor_parallel.py",
    "training/sharding/vocab_parallel.py": "training/sharding/tensor_parallel.py",
    "training/tools/generate.py": "mlxcluster/launch/runs.py",
    "training/tools/link_bench.py": "tests/unit/mlxcluster/bench/test_links.py",
    "training/tools/matmul_probe.py": "tests/cluster/test_benches.py",
    "training/tools/pirate.py": "tests/unit/training/data/test_prepare.py",
}
# The modules no test runs, and why.
UNTESTED = {
    "training/examples/horovod_torch.py": "needs torch and a Horovod built for it on every node: run by "
                                          "hand on the lab (docs/any-job.md#horovod)",
}


def own_tests(module: str) -> Path:
    path = Path(module)
    return REPO / "tests" / "unit" / path.parent / f"test_{path.stem}.py"


def dotted(module: str) -> str:
    """The module's name as Python has it; a package's __main__ is the package's (`python -m`)."""
    return ".".join(Path(module).with_suffix("").parts).removesuffix(".__main__")


def names(path: Path, module: str) -> bool:
    """Whether `path` imports `module` or names it (`python -m training.tools.link_bench`)."""
    name = dotted(module)
    return name in imports_of(path) or re.search(rf"{re.escape(name)}(?![\w.])", path.read_text()) is not None


def where_tested(module: str, through: str) -> str | None:
    """Why TESTED_THROUGH's entry for `module` is wrong; None when it is right."""
    target = REPO / through
    if not target.is_file():
        return f"{module}: no {through}"
    if through.startswith("tests/"):
        runners = [m for m in imports_of(target)
                   if names(REPO / Path(*m.split(".")).with_suffix(".py"), module)]
        if not names(target, module) and not runners:
            return f"{module}: {through} names neither it nor a module that runs it"
    elif not own_tests(through).is_file():
        return f"{module}: {through} has no tests of its own ({own_tests(through).relative_to(REPO)})"
    elif not (names(target, module) or names(REPO / module, through)):
        return f"{module}: {through} does not use it, nor it {through}"
    return None


def untested_at_their_path() -> list[str]:
    """The modules whose tests are neither at their path nor where TESTED_THROUGH or UNTESTED says."""
    paths = [str(p.relative_to(REPO)) for package in ("mlxcluster", "training") for p in modules(package)
             if p.name != "__init__.py"]
    return [m for m in paths if not own_tests(m).is_file() and m not in TESTED_THROUGH and m not in UNTESTED]


def test_a_modules_tests_are_at_its_path_or_where_tested_through_says():
    assert untested_at_their_path() == []


def test_tested_through_says_where_each_modules_tests_are():
    wrong = [said for module, through in TESTED_THROUGH.items() if (said := where_tested(module, through))]
    assert wrong == []


def test_tested_through_and_untested_name_only_modules_without_tests_of_their_own():
    listed = [*TESTED_THROUGH, *UNTESTED]
    assert [m for m in listed if not (REPO / m).is_file() or own_tests(m).is_file()] == []
    assert not set(TESTED_THROUGH) & set(UNTESTED)


def test_a_module_whose_tests_are_nowhere_said_or_said_wrongly_is_found(monkeypatch: pytest.MonkeyPatch):
    before = set(untested_at_their_path())
    monkeypatch.delitem(TESTED_THROUGH, "training/loop/resume.py")
    assert set(untested_at_their_path()) - before == {"training/loop/resume.py"}
    assert where_tested("training/loop/resume.py", "training/serve/model.py") == (
        "training/loop/resume.py: training/serve/model.py has no tests of its own "
        "(tests/unit/training/serve/test_model.py)")
    assert where_tested("training/loop/resume.py", "training/data/prepare.py") == (
        "training/loop/resume.py: training/data/prepare.py does not use it, nor it training/data/prepare.py")
    assert where_tested("training/loop/resume.py", "tests/unit/training/data/test_shares.py") == (
        "training/loop/resume.py: tests/unit/training/data/test_shares.py names neither it nor a module "
        "that runs it")
