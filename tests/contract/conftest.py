"""The stand-in Macs, shared by the Darwin contracts of the session (stand_in_macs.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlxcluster.lab.hosts import down
from tests.contract.stand_in_macs import LAB_ID, StandInMacs, bring_up


@pytest.fixture(scope="session")
def stand_in_macs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandInMacs]:
    if os.geteuid() != 0:
        pytest.skip("the Darwin contracts bring up lab nodes (network namespaces, overlay "
                    "mounts): they need root")
    # Lab 3 belongs to these tests: start from fresh nodes whatever an aborted run left.
    down(LAB_ID)
    try:
        yield bring_up(tmp_path_factory.mktemp("darwin-contract"))
    finally:
        down(LAB_ID)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The stand-in Macs' tests stay together on one worker (pytest-xdist's --dist loadgroup),
    beside the lab tests of tests/cluster: they run on a lab of their own."""
    here = Path(__file__).parent
    for item in items:
        if item.path.parent == here:
            item.add_marker(pytest.mark.xdist_group("contract"))
