"""The project's own checks, behind `invoke lint` and `invoke test`.

`invoke test` runs the suite as three pytest sessions one after another (`SESSIONS`): the lab
tests, the unit tests and the molecule scenarios, each with its slowest tests at its end. They were
run side by side to fill the lab's waits, and that was slower on CI's two cores: 70 and 80 minutes
against 50 one after another, the lab's first site.yml run 449 s against 69 (a lab host's work is
many short processes, ansible's and its own, that wait behind every other session's).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

from mlxcluster import local, paths
from mlxcluster.lab import cache

RUFF_TARGETS = ("tasks.py", "bench_tasks.py", "mlxcluster", "training", "tests", "filter_plugins")
# The slowest tests in the output of every session, CI's included: where its time goes is in its
# log (docs/tests.md keeps the table).
DURATIONS = ("--durations=25", "--durations-min=5")
MOLECULE = "tests/cluster/test_molecule.py"
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


SESSIONS = (
    Session("lab", ("tests/cluster", "tests/contract", f"--ignore={MOLECULE}")),
    Session("unit", ("tests/unit",), env=UNCOMPILED),
    Session("molecule", (MOLECULE,)),
)


def lint() -> None:
    """ruff, yamllint and ansible-lint's production profile (offline: no Galaxy)."""
    local.run(["ruff", "check", *RUFF_TARGETS])
    local.run(["yamllint", "--strict", "."])
    local.run(["ansible-lint", "--profile", "production", "--offline"])


def pytest_command(session: Session, k: str | None) -> list[str]:
    return ["pytest", *DURATIONS, *session.args, *(["-k", k] if k else [])]


def test(*, unit: bool = False, k: str | None = None) -> None:
    """pytest: the unit tests alone, or every session (the lab tests need root, and a filled cache
    that lab hosts install from)."""
    if not unit and os.geteuid() == 0:
        cache.prepare_offline_cache()
    failed = run_sessions(SESSIONS[1:2] if unit else SESSIONS, k)
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
            env=local.tool_env(dict(session.env)), stdin=subprocess.DEVNULL).returncode
    print(f"\ninvoke test: {time.monotonic() - started:.0f} s for every session: "
          + ", ".join(f"{s.name} exit {c}" for s, c in codes.items()), flush=True)
    if k and all(code == NO_TESTS for code in codes.values()):
        return [f"-k {k!r}: no test was selected, so no"]
    allowed = (0, NO_TESTS) if k else (0,)
    return [session.name for session, code in codes.items() if code not in allowed]
