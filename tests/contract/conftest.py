"""The stand-in Macs, shared by the Darwin contracts of the session (stand_in_macs.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator

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

