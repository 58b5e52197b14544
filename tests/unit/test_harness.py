"""The test harness fails when it cannot see: a lab test skipped where the lab must run, and an
ansible-playbook run whose recap cannot be read."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.cluster.conftest import PlaybookRun
from tests.conftest import REPO

# The harness's hooks, in a pytester run of its own.
HOOKS = (f"import sys\nsys.path.insert(0, {str(REPO)!r})\n"
         "from tests.conftest import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401\n")
SKIPS = "import pytest\n\n\ndef test_it():\n    pytest.skip('no network namespaces here')\n"


@pytest.fixture
def lab_and_unit_tests(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(HOOKS)
    for folder in ("tests/cluster", "tests/contract", "tests/unit"):
        (pytester.path / folder).mkdir(parents=True)
        (pytester.path / folder / f"test_{folder.split('/')[1]}.py").write_text(SKIPS)
    return pytester


def test_a_skipped_lab_test_fails_the_run_where_the_lab_must_run(lab_and_unit_tests, monkeypatch):
    monkeypatch.setenv("MLX_LAB_REQUIRED", "1")
    result = lab_and_unit_tests.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=2, skipped=1)  # the unit test may skip
    result.stdout.fnmatch_lines(
        ["*a lab test was skipped where the lab must run (*no network namespaces here)*"])
    assert result.ret != 0


def test_a_skipped_lab_test_is_a_skip_where_it_cannot_run(lab_and_unit_tests, monkeypatch):
    monkeypatch.setenv("MLX_LAB_REQUIRED", "0")
    result = lab_and_unit_tests.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(skipped=3)
    assert result.ret == 0


MISSING = "no_such_dependency_of_the_tests"
# pytest.importorskip at a module's top or in a test would drop its tests without a word.
IMPORT_SKIPS = {"module": f"import pytest\n\npytest.importorskip({MISSING!r})\n\n\ndef test_a():\n    pass\n",
                "test": f"import pytest\n\n\ndef test_b():\n    pytest.importorskip({MISSING!r})\n"}


@pytest.mark.parametrize("where, required", [("module", "1"), ("test", "1"), ("module", "0")])
def test_a_missing_dependency_fails_where_the_lab_must_run(pytester, monkeypatch, where, required):
    pytester.makeconftest(HOOKS)
    (pytester.path / "tests/unit").mkdir(parents=True)
    (pytester.path / "tests/unit/test_it.py").write_text(IMPORT_SKIPS[where])
    monkeypatch.setenv("MLX_LAB_REQUIRED", required)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    if required == "1":
        result.stdout.fnmatch_lines(["*missing dependency*run bin/setup*"])
        assert result.ret != 0
    else:
        result.assert_outcomes(skipped=1)  # a developer without the lab: a skip, as before
        assert result.ret in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)


def recap(returncode: int, stdout: str) -> PlaybookRun:
    return PlaybookRun.of(subprocess.CompletedProcess(["ansible-playbook"], returncode, stdout, ""))


@pytest.mark.parametrize("stdout", ["", "ERROR! the playbook could not be read", '{"plays": []}', "[1, 2]"])
def test_a_recap_that_cannot_be_read_fails_every_check_on_it(stdout):
    run = recap(0, stdout)
    for what in ("changed", "stats", "failures"):
        with pytest.raises(AssertionError, match="recap could not be read"):
            getattr(run, what)


def test_a_recap_gives_what_each_host_did():
    document = {"plays": [{"tasks": [
        {"task": {"name": "write"}, "hosts": {"node1": {"changed": True}, "node2": {"changed": False}}},
        {"task": {"name": "reach"}, "hosts": {"node2": {"unreachable": True, "msg": "no route"}}}]}],
        "stats": {"node1": {"changed": 1}, "node2": {"changed": 0, "unreachable": 1}}}
    run = recap(2, "PLAY RECAP noise before it\n" + json.dumps(document))
    assert run.changed == {"node1": ["write"]}
    assert run.failures == {"node2": ["no route"]}
    assert run.stats["node2"]["unreachable"] == 1


def test_each_lab_s_tests_are_one_group_on_one_worker_and_each_unit_module_one():
    """invoke test keeps each lab's tests whole on one pytest-xdist worker (tests/labs.py): a lab
    module in no group, or in two, would have two workers bring up the same lab under each other; a
    unit module split over two would make its module fixtures twice."""
    from tests import labs

    assert labs.group_of("tests/cluster/test_site.py::test_each_node_has_the_hostfiles[1]") == "cluster"
    assert labs.group_of("tests/cluster/test_train.py::test_train_runs") == "training"
    assert labs.group_of("tests/cluster/test_molecule.py::test_molecule_scenario_passes[macos-default]") \
        == "molecule"
    assert labs.group_of("tests/contract/test_darwin_contract.py::test_every_run") == "contract"
    unit = "tests/unit/training/test_finetune.py"
    assert labs.group_of(f"{unit}::test_x[a]") == labs.group_of(f"{unit}::test_y") == unit
    assert labs.group_of("tests/unit/test_harness.py::test_x") == "tests/unit/test_harness.py"
    modules = sorted(p.name for p in (REPO / "tests" / "cluster").glob("test_*.py"))
    placed = [m for lab in labs.LABS.values() for m in lab] + [labs.MOLECULE_MODULE]
    assert sorted(placed) == modules


def test_each_worker_s_local_rings_listen_on_ports_of_its_own(monkeypatch):
    """Two unit modules that start ring ranks here run side by side on two workers: their ports differ,
    and stay below Linux's ephemeral range (tests/unit/rings.py)."""
    from tests.unit import rings

    firsts = []
    for worker in ("gw0", "gw1", "gw2"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        words = rings.launch(3)
        firsts.append(int(words[words.index("--starting-port") + 1]))
        hosts = json.loads(Path(words[words.index("--hostfile") + 1]).read_text())["hosts"]
        assert words[-1] == "--" and [h["ssh"] for h in hosts] == ["127.0.0.1"] * 3
    assert len(set(firsts)) == 3 and max(firsts) + rings.PORTS_PER_WORKER <= 32768


# Rank 1 fails only once rank 0 has printed (its mark file exists): on a loaded machine rank 1 could
# otherwise fail, and have rank 0 stopped, before rank 0's Python had started.
RANK_PROGRAM = """import json, os, sys, time
from pathlib import Path
rank, mark = int(os.environ["MLX_RANK"]), Path(sys.argv[1])
print(rank, json.dumps(open(os.environ["MLX_HOSTFILE"]).read().strip()), flush=True)
if rank == 0:
    mark.touch()
    time.sleep(60)
for _ in range(300):
    if mark.exists():
        break
    time.sleep(0.1)
sys.exit(3)
"""


def test_local_ring_ranks_start_as_mlx_launch_starts_them_and_the_first_failure_stops_them_all(tmp_path):
    """The cluster's launcher on local hosts (tests/unit/rings.py): each rank its MLX_RANK and the
    ring's hostfile of local ports; rank 1 failing stops rank 0 (asleep for a minute) at once, the
    launcher says so, and exits with rank 1's status (mlx.launch exits 0)."""
    import sys

    from tests.unit import rings

    # Within 50 s (or subprocess.run fails the test): rank 0 did not sleep its minute out.
    program = [sys.executable, "-c", RANK_PROGRAM, str(tmp_path / "printed")]
    done = subprocess.run([*rings.launch(2), *program], cwd=REPO, capture_output=True, text=True,
                          timeout=50, stdin=subprocess.DEVNULL)
    assert done.returncode == 3, done.stderr
    assert "Node with rank 1 exited with code 3" in done.stderr
    assert "Node with rank 0 was stopped (status -15)" in done.stderr
    port = rings.starting_port()
    hosts = json.dumps(json.dumps([[f"127.0.0.1:{port}"], [f"127.0.0.1:{port + 1}"]]))
    assert sorted(done.stdout.splitlines()) == [f"0 {hosts}", f"1 {hosts}"]
