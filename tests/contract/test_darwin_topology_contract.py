"""Darwin CONTRACT test of `invoke topology`: the cabling read from the Macs themselves.

The session's three stand-in Macs (stand_in_macs.py) are cabled as a ring; their system_profiler
stand-in answers `SPThunderboltDataType -json` from the cables the lab made (each port's domain
UUID and the one plugged into it), networksetup's lists the hardware ports. `invoke topology`
runs as a user would, on an inventory that does not list the cables yet (the Thunderbolt Bridge):
what it prints to paste must be the lab's cabling, and it must only read.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from mlxcluster.describe import topology
from mlxcluster.lab import veth
from tests.contract.stand_in_macs import ADMIN, NODES, REPO, StandInMacs

pytestmark = pytest.mark.cluster

HOSTS = [f"node{i}" for i in range(1, NODES + 1)]


def test_invoke_topology_prints_the_cables_the_macs_see_and_draws_them(stand_in_macs: StandInMacs,
                                                                       tmp_path):
    lab = stand_in_macs.lab
    inventory = stand_in_macs.write_inventory("topology-inventory", {
        host: {"ansible_host": lab.mgmt_ip(i), "thunderbolt_ip": lab.tb_ip(i), "mpi_slots": 1}
        for i, host in enumerate(HOSTS, 1)}, {})
    before = {i: len(stand_in_macs.calls([i])) for i in range(1, NODES + 1)}
    picture = tmp_path / "cabling.png"
    done = subprocess.run([f"{sys.prefix}/bin/invoke", "topology", "-i", str(inventory),
                           "--output", str(picture)],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 cables between 3 Macs; paste under `cluster: vars:`" in done.stdout
    pasted = yaml.safe_load(done.stdout.split("vars:` in")[1].split("\n", 1)[1].split("drawn in")[0])
    cabled = veth.inventory_links(veth.cabling(list(range(1, NODES + 1)), "ring"))
    assert {frozenset(cable) for cable in pasted["thunderbolt_links"]} == {frozenset(c) for c in cabled}
    assert pasted["thunderbolt_topology"] == "links"
    found, errors = topology.cables(pasted["thunderbolt_links"], pasted["thunderbolt_link_pool"], HOSTS)
    assert errors == [] and topology.ring_order(HOSTS, found) == HOSTS
    assert picture.read_bytes()[:4] == b"\x89PNG"
    # Read as the admin account, on every Mac, and nothing changed.
    calls = [call for i in range(1, NODES + 1) for call in stand_in_macs.calls([i])[before[i]:]]
    assert sorted((c.host, c.command, c.user) for c in calls) == sorted(
        (host, command, ADMIN) for host in HOSTS
        for command in ("system_profiler SPThunderboltDataType -json", "networksetup -listallhardwareports"))
