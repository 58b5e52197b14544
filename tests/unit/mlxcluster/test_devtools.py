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
