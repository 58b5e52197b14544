"""The project's own checks, behind `invoke lint` and `invoke test`.

`invoke test` runs the suite as three pytest sessions side by side (`SESSIONS`): the unit tests,
the molecule scenarios and the other lab tests. A lab test is mostly waiting (ansible on its hosts,
ssh, a run's watchdog); the unit tests are mostly computing. One after the other, the 2-core CI
machine sat half idle for most of an hour; side by side, each fills the other's waits. The lab
tests, the longest, show their output as they run; the others' logs follow when they are done.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mlxcluster import local, paths
from mlxcluster.lab import cache

RUFF_TARGETS = ("tasks.py", "bench_tasks.py", "mlxcluster", "training", "tests", "filter_plugins")
# The slowest tests in the output of every session, CI's included: where its time goes is in its
# log (docs/tests.md keeps the table).
DURATIONS = ("--durations=25", "--durations-min=5")
MOLECULE = "tests/cluster/test_molecule.py"
LOGS = paths.REPO / "build" / "test-logs"
# pytest's exit code when -k selected nothing in a session: the others may hold the tests.
NO_TESTS = 5


@dataclass(frozen=True)
class Session:
    """One pytest session of the suite: its name, its arguments and how nicely it shares the CPU
    (the lab tests, whose runs have watchdogs, go first)."""

    name: str
    args: tuple[str, ...]
    nice: int = 0
    env: tuple[tuple[str, str], ...] = ()  # set for this session alone


# The unit tests check the maths of our training against mlx-lm's, each side in this one process
# environment, so they train uncompiled: MLX's CPU backend compiles every fused kernel with g++ on
# first use, and on CI's fresh machine that was well over half the CPU of a training test (three
# of them: 102 s compiling, 42.5 s not). The lab's nodes train compiled, as a real node does.
UNCOMPILED = (("MLX_DISABLE_COMPILE", "1"),)


SESSIONS = (
    Session("lab", ("tests/cluster", "tests/contract", f"--ignore={MOLECULE}")),
    Session("unit", ("tests/unit",), nice=10, env=UNCOMPILED),
    Session("molecule", (MOLECULE,), nice=5),
)


def lint() -> None:
    """ruff, yamllint and ansible-lint's production profile (offline: no Galaxy)."""
    local.run(["ruff", "check", *RUFF_TARGETS])
    local.run(["yamllint", "--strict", "."])
    local.run(["ansible-lint", "--profile", "production", "--offline"])


def pytest_command(session: Session, k: str | None) -> list[str]:
    return ["pytest", *DURATIONS, *session.args, *(["-k", k] if k else [])]


def test(*, unit: bool = False, k: str | None = None) -> None:
    """pytest: the unit tests alone, or every session side by side (the lab tests need root, and a
    filled cache that lab hosts install from)."""
    if unit:
        local.run(pytest_command(SESSIONS[1], k), env=dict(SESSIONS[1].env))
        return
    if os.geteuid() == 0:
        cache.prepare_offline_cache()
    failed = run_side_by_side(SESSIONS, k)
    if failed:
        raise local.CommandFailed(f"invoke test: the {', '.join(failed)} tests failed (output above)")


def run_side_by_side(sessions: Sequence[Session], k: str | None) -> list[str]:
    """Every session at once: the first on this terminal, each other into its log under
    build/test-logs/, shown whole once the first is done. The names of those that failed."""
    LOGS.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    env = local.tool_env()
    background = {}
    for session in sessions[1:]:
        log = LOGS / f"{session.name}.log"
        with log.open("w") as out:  # the child holds its own copy of the file
            background[session] = subprocess.Popen(
                ["nice", "-n", str(session.nice), *pytest_command(session, k)], cwd=paths.REPO,
                env={**env, **dict(session.env)},
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        first = subprocess.run(pytest_command(sessions[0], k), cwd=paths.REPO, env=env).returncode
        codes = {sessions[0]: first}
        codes |= {session: proc.wait() for session, proc in background.items()}
    finally:
        for proc in background.values():
            if proc.poll() is None:  # Ctrl-C, or the first session's own failure to start
                proc.terminate()
                proc.wait()
    for session in background:
        print(f"\n===== the {session.name} tests' output ({LOGS / f'{session.name}.log'}) =====", flush=True)
        sys.stdout.write(Path(LOGS / f"{session.name}.log").read_text(errors="replace"))
    print(f"\ninvoke test: {time.monotonic() - started:.0f} s for every session side by side: "
          + ", ".join(f"{s.name} exit {c}" for s, c in codes.items()), flush=True)
    if k and all(code == NO_TESTS for code in codes.values()):
        return [f"-k {k!r}: no test was selected, so no"]
    allowed = (0, NO_TESTS) if k else (0,)
    return [session.name for session, code in codes.items() if code not in allowed]
