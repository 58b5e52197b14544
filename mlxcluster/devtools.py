"""The project's own checks, behind `invoke lint` and `invoke test`.

`invoke test` runs the suite as one pytest session on every core (`SESSIONS`), the labs side by
side, and ends with its slowest tests. Three sessions one after another took 79 minutes of CI, the
lab tests 53 of them, a third of the two cores idle; the sessions side by side, each on its own,
were slower still (70 and 80 minutes against 50 at the time): the unit tests and a lab's ansible
fought for the cores without order. One session hands each worker a whole lab, or unit tests.
"""

from __future__ import annotations

import os
import subprocess
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mlxcluster import local, paths
from mlxcluster.lab import cache, ring_wait

RUFF_TARGETS = ("tasks.py", "bench_tasks.py", "mlxcluster", "training", "tests", "filter_plugins",
                "callback_plugins")
# The slowest tests in the output of every session, CI's included: where its time goes is in its
# log (docs/tests.md keeps the table).
DURATIONS = ("--durations=80", "--durations-min=5")
# pytest's exit code when -k selected nothing in a session: the others may hold the tests.
NO_TESTS = 5


@dataclass(frozen=True)
class Session:
    """One pytest session of the suite: its name, its arguments and its environment."""

    name: str
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()  # set for this session alone


# The unit tests check the maths of our training against mlx-lm's, each side in this one process
# environment, so they train uncompiled: MLX's CPU backend compiles every fused kernel with g++ on
# first use, and on CI's fresh machine that was well over half the CPU of a training test (three
# of them: 102 s compiling, 42.5 s not). The lab's nodes train compiled, as a real node does.
UNCOMPILED = (("MLX_DISABLE_COMPILE", "1"),)
# The mlx wheel for Linux bundles the reference BLAS (2.1 GFLOP/s: ../shared/DESIGN.md); the nodes
# preload Debian's OpenBLAS (roles/python_env's env.sh), and so do the tests, one thread per process
# (two workers, and the ranks of a local ring, share the cores). A tiny float model's training step
# went from 0.44 s to 0.045 s. Unit tests compare runs made in this same environment.
OPENBLAS = Path("/usr/lib", sysconfig.get_config_var("MULTIARCH") or "", "openblas-pthread/libopenblas.so.0")


def fast_blas() -> tuple[tuple[str, str], ...]:
    """The environment that preloads Debian's OpenBLAS, single-threaded; none where it is not installed
    (bin/setup installs it on Debian and Ubuntu; a Mac's MLX uses Accelerate)."""
    if not OPENBLAS.is_file():
        return ()
    preload = ":".join(filter(None, (str(OPENBLAS), os.environ.get("LD_PRELOAD"))))
    return (("LD_PRELOAD", preload), ("OPENBLAS_NUM_THREADS", "1"))


# Every core, the labs side by side: each lab's tests stay whole, in their order, on one worker (the
# cluster lab, the training lab, the stand-in Macs, the molecule scenarios: tests/labs.py, scheduled
# by tests/conftest.py's LabScheduling for --dist=loadgroup), the labs first, in collection order (no
# reordering by size); each unit module a group of its own, on whichever worker is free (the local
# rings some start take ports of their worker's own: tests/unit/rings.py).
# One after another, the lab tests left a third of two cores idle, waiting on ansible, sshd and
# ranks, and took 53 minutes of CI's 79.
EVERY_CORE = ("--numprocesses=auto", "--dist=loadgroup", "--no-loadscope-reorder")

# A bench's own run end to end (pytest mark `bench`) is a measurement: it is left out of CI's session
# and run by `invoke test --benches`, on the training lab, as before a bench's figures are reported.
NOT_BENCHES = ("-m", "not bench")
SESSIONS = (Session("whole", ("tests/cluster", "tests/contract", "tests/unit", *NOT_BENCHES, *EVERY_CORE),
                    env=UNCOMPILED + fast_blas()),)
UNIT = Session("unit", ("tests/unit", *NOT_BENCHES, *EVERY_CORE), env=UNCOMPILED + fast_blas())
BENCHES = Session("benches", ("tests/cluster", "-m", "bench", *EVERY_CORE), env=UNCOMPILED + fast_blas())


def with_quiet_rings(env: dict[str, str]) -> dict[str, str]:
    """`env` with the library that keeps a waiting ring rank off the cores (mlxcluster/lab/ring_wait.py)
    preloaded after what `env` preloads: the tests' local ranks share two cores, where each Mac has
    its own. Built once into build/; left out where there is no C compiler."""
    built = ring_wait.library(paths.REPO / "build" / "preload")
    if built is None:
        return env
    return {**env, "LD_PRELOAD": ":".join(filter(None, (env.get("LD_PRELOAD"), str(built))))}


def lint() -> None:
    """ruff, yamllint and ansible-lint's production profile (offline: no Galaxy)."""
    local.run(["ruff", "check", *RUFF_TARGETS])
    local.run(["yamllint", "--strict", "."])
    local.run(["ansible-lint", "--profile", "production", "--offline"])


def pytest_command(session: Session, k: str | None) -> list[str]:
    return ["pytest", *DURATIONS, *session.args, *(["-k", k] if k else [])]


def test(*, unit: bool = False, benches: bool = False, k: str | None = None) -> None:
    """pytest: the unit tests alone, the benches' own runs alone, or every session (the lab tests need
    root, and a filled cache that lab hosts install from)."""
    if unit and benches:
        raise local.CommandFailed("invoke test: --unit or --benches, not both (the benches run on a lab)")
    if not unit and os.geteuid() == 0:
        cache.prepare_offline_cache()
    failed = run_sessions((UNIT,) if unit else (BENCHES,) if benches else SESSIONS, k)
    if failed:
        raise local.CommandFailed(f"invoke test: the {', '.join(failed)} tests failed (output above)")


def run_sessions(sessions: Sequence[Session], k: str | None) -> list[str]:
    """Every session, one after another, on this terminal; each goes on whether the one before it
    failed or not. The names of those that failed."""
    started = time.monotonic()
    codes = {}
    for session in sessions:
        print(f"\n===== the {session.name} tests' output =====", flush=True)
        codes[session] = subprocess.run(
            pytest_command(session, k), cwd=paths.REPO,
            env=local.tool_env(with_quiet_rings(dict(session.env))), stdin=subprocess.DEVNULL).returncode
    print(f"\ninvoke test: {time.monotonic() - started:.0f} s for every session: "
          + ", ".join(f"{s.name} exit {c}" for s, c in codes.items()), flush=True)
    if k and all(code == NO_TESTS for code in codes.values()):
        return [f"-k {k!r}: no test was selected, so no"]
    allowed = (0, NO_TESTS) if k else (0,)
    return [session.name for session, code in codes.items() if code not in allowed]
