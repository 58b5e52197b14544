from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

from tests import labs

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
# Tools that shell out to ansible-inventory, molecule & co. (testinfra's ansible backend)
# must find the venv's, however pytest was started.
if str(VENV_BIN) not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"


@pytest.fixture
def tool_env() -> dict[str, str]:
    """Environment in which the venv's ansible-playbook & co. come first on PATH."""
    return {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"}


# --- a lab test that did not run is not a pass ----------------------------------------------------

# The lab and contract tests need root (network namespaces, overlay mounts) and skip without it,
# so that `invoke test` works for a developer. Where they can run (as root, which CI is), a skip
# means the lab could not start or a test lost its subject: that fails the run, so that a build
# is never green without them. MLX_LAB_REQUIRED=0 allows the skips anyway, =1 requires the lab
# whoever runs the tests.
LAB_TESTS = ("cluster", "contract")


def lab_required() -> bool:
    return os.environ.get("MLX_LAB_REQUIRED", "1" if os.geteuid() == 0 else "0") == "1"


def is_lab_test(path: Path) -> bool:
    parts = path.resolve().parts
    return any(a == "tests" and b in LAB_TESTS for a, b in itertools.pairwise(parts))


# pytest.importorskip's reason: a dependency that is missing would drop every test of a module
# without a word. Every dependency of the tests is pinned in pyproject.toml, so where the lab must
# run (CI) such a skip is a broken install, not a choice.
IMPORT_SKIP = "could not import"


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    return report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and not hasattr(report, "wasxfail") and lab_required()):
        return
    reason = _reason(report)
    if is_lab_test(item.path):
        report.outcome = "failed"
        report.longrepr = (f"a lab test was skipped where the lab must run ({reason}): a lab that cannot "
                           "start is a failure here (MLX_LAB_REQUIRED=0 allows it)")
    elif IMPORT_SKIP in reason:
        report.outcome = "failed"
        report.longrepr = f"a test was skipped for a missing dependency ({reason}): run bin/setup"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    """A module skipped whole at import (a module-level importorskip) fails where the lab must run."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and lab_required() and IMPORT_SKIP in _reason(report):
        report.outcome = "failed"
        report.longrepr = (f"{collector.nodeid}: skipped whole for a missing dependency ({_reason(report)}): "
                           "run bin/setup (MLX_LAB_REQUIRED=0 allows it)")


# --- the labs side by side -------------------------------------------------------------------------


class LabScheduling(LoadScopeScheduling):
    """pytest-xdist's scheduling by scope, each group of tests one scope (tests/labs.py: each lab's,
    and each unit module) and any other test a scope of its own: a group stays whole, in its order,
    on one worker. xdist's own `--dist loadgroup` does this from
    xdist_group marks by renaming each test, which pytest 9 no longer lets it do."""

    def _split_scope(self, nodeid: str) -> str:
        return labs.group_of(nodeid) or nodeid


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> LoadScopeScheduling | None:
    """`--dist=loadgroup` (invoke test) schedules by lab; any other --dist is xdist's own."""
    return LabScheduling(config, log) if config.getvalue("dist") == "loadgroup" else None
