"""invoke test's sessions one after another (mlxcluster/devtools.py), run for real on small suites
of their own: a session that fails fails the whole, whichever it is, the next ones still run, and
each session's output is in the run's output; together the sessions hold every test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcluster import devtools

PASSES = "def test_passes():\n    pass\n"
FAILS = "def test_fails():\n    assert 1 == 2, 'the failure the second session had'\n"


def sessions(tmp_path: Path, first: str, second: str) -> tuple[devtools.Session, ...]:
    for name, text in (("first", first), ("second", second)):
        (tmp_path / f"test_{name}.py").write_text(text)
    # rootdir and conftest of their own: the repository's settings are not these files'.
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    common = ("-p", "no:cacheprovider", f"--rootdir={tmp_path}", "-c", str(tmp_path / "pytest.ini"))
    return (devtools.Session("first", (str(tmp_path / "test_first.py"), *common)),
            devtools.Session("second", (str(tmp_path / "test_second.py"), *common)))


@pytest.mark.parametrize("first, second, failed", [(PASSES, FAILS, ["second"]), (FAILS, PASSES, ["first"]),
                                                   (PASSES, PASSES, [])],
                         ids=["second-fails", "first-fails", "both-pass"])
def test_a_session_that_fails_fails_the_whole_wherever_it_ran(tmp_path, monkeypatch, capfd, first, second,
                                                              failed):
    assert devtools.run_sessions(sessions(tmp_path, first, second), None) == failed
    out = capfd.readouterr().out
    # The second session ran, after the first, whether the first failed or not.
    assert "===== the second tests' output" in out and "test_second.py" in out
    if failed == ["second"]:
        assert "the failure the second session had" in out


def test_a_k_that_selects_nothing_anywhere_is_a_failure(tmp_path):
    assert devtools.run_sessions(sessions(tmp_path, PASSES, PASSES), "passes") == []  # both ran
    assert devtools.run_sessions(sessions(tmp_path, PASSES, PASSES), "nothing_by_this_name") != []


def test_the_sessions_together_hold_every_test_once():
    """Every test folder is in exactly one session: a folder left out would never run in CI."""
    repo = Path(devtools.paths.REPO)
    folders = sorted(p.name for p in (repo / "tests").iterdir() if p.is_dir() and p.name != "__pycache__")
    args = [arg for session in devtools.SESSIONS for arg in session.args]
    held = [arg for arg in args if not arg.startswith("-")]
    ignored = [arg.removeprefix("--ignore=") for arg in args if arg.startswith("--ignore=")]
    assert sorted(Path(a).parts[1] for a in held if len(Path(a).parts) == 2) == folders
    # What one session ignores, another runs.
    assert all(path in held for path in ignored)


def test_the_tests_train_with_debian_s_openblas_one_thread_per_process_where_it_is_installed(tmp_path):
    """The mlx wheel's own BLAS is the reference one (a float training step of the tiny model: 0.44 s,
    against 0.045 s with OpenBLAS). bin/setup installs OpenBLAS; CI (MLX_LAB_REQUIRED=1) must have it."""
    if os.environ.get("MLX_LAB_REQUIRED") == "1":
        assert devtools.OPENBLAS.is_file(), f"bin/setup installs {devtools.OPENBLAS}: it is missing"
    if not devtools.OPENBLAS.is_file():
        assert devtools.fast_blas() == ()
        return
    for session in (*devtools.SESSIONS, devtools.UNIT):
        env = dict(session.env)
        assert env["LD_PRELOAD"].split(":")[0] == str(devtools.OPENBLAS)
        assert env["OPENBLAS_NUM_THREADS"] == "1"
    # With that environment, MLX's matmuls run in OpenBLAS (training.distributed reads /proc/self/maps).
    probe = ("import mlx.core as mx; mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64))); "
             "from training.distributed import openblas_loaded; print(openblas_loaded())")
    shown = subprocess.run([sys.executable, "-c", probe], cwd=devtools.paths.REPO, capture_output=True,
                           text=True, env={**os.environ, **dict(devtools.fast_blas())}, check=True).stdout
    assert shown.strip() == "True"


def collected(*args: str) -> set[str]:
    """The test ids pytest collects from the lab folders with these arguments (no test runs)."""
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                             "tests/cluster", "tests/contract", *args],
                            cwd=devtools.paths.REPO, capture_output=True, text=True, check=True).stdout
    return {line for line in listed.splitlines() if "::" in line}


def marker_args(session: devtools.Session) -> tuple[str, ...]:
    at = session.args.index("-m")
    return session.args[at:at + 2]


def test_the_benches_own_runs_are_left_out_of_ci_s_session_and_run_by_benches():
    """A bench's run end to end is a measurement (pytest mark `bench`): never in CI's session, all of
    them in `invoke test --benches` (no unit test is one)."""
    ci_sessions = (*devtools.SESSIONS, devtools.UNIT)
    assert all(marker_args(session) == devtools.NOT_BENCHES for session in ci_sessions)
    benches = collected(*marker_args(devtools.BENCHES))
    assert {test.split("::")[0] for test in benches} == {"tests/cluster/test_benches.py",
                                                          "tests/cluster/test_train_links.py"}
    assert any("bench_train" in test for test in benches) and len(benches) == 4, benches
    unit = devtools.paths.REPO / "tests" / "unit"
    assert not [p for p in unit.rglob("*.py") if "mark.bench" in p.read_text() and p != Path(__file__)]
