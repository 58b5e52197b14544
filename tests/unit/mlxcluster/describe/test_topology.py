"""`links` mode's cables (mlxcluster/describe/topology.py): validation, and MLX hostfiles that equal what
MLX's own `mlx.distributed_config` code writes for the same cabling.

MLX's configurator (mlx/_distributed_utils/config.py, in the pinned mlx wheel) reads the cabling
from `system_profiler` over ssh; its pure parts take that cabling as data. The tests give them
the same cables as ours, with its two ssh steps replaced: `add_ips` (reads each Mac's en0
address: here the coordinator address we give) and `IPConfigurator.setup` (runs ifconfig).
"""

from __future__ import annotations

import argparse
import ipaddress
import itertools
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx._distributed_utils import config as mlx_config
from mlx._distributed_utils.common import Host

from mlxcluster.describe import topology
from mlxcluster.describe.topology import Cable, Port


def cabling(hosts: list[str], links: list[list[str]], pool: str = "192.168.0.0/16") -> list[Cable]:
    found, errors = topology.cables(links, pool, hosts)
    assert errors == []
    return found


def mlx_inputs(hosts: list[str], links: list[list[str]]):
    """MLX's view of the same cabling: its hosts, Thunderbolt ports and uuid index."""
    peer = {}
    for a, b in links:
        peer[a], peer[b] = b, a
    tb_hosts = [mlx_config.ThunderboltHost(h, sorted(
        (mlx_config.ThunderboltPort(port.split(":")[1], port, peer[port])
         for port in peer if port.split(":")[0] == h), key=lambda p: p.iface)) for h in hosts]
    index = {p.uuid: (i, j) for i, th in enumerate(tb_hosts) for j, p in enumerate(th.ports)}
    return [Host(i, f"{h}.local", [], []) for i, h in enumerate(hosts)], tb_hosts, index


def in_mlx_order(hosts: list[str], links: list[list[str]]) -> list[list[str]]:
    """The cables in the order MLX numbers them (host by host, ports by name): listed so, our
    /30s are the ones MLX gives (it counts 192.168.0.0/30, .4/30, ... up)."""
    _, tb_hosts, _ = mlx_inputs(hosts, links)
    seen, ordered = set(), []
    for th in tb_hosts:
        for port in th.ports:
            if port.uuid not in seen:
                seen |= {port.uuid, port.connected_to}
                ordered.append([port.uuid, port.connected_to])
    return ordered


def mlx_hostfile(backend: str, hosts: list[str], links: list[list[str]], tmp_path: Path,
                 monkeypatch: pytest.MonkeyPatch) -> dict | None:
    """What MLX's configurator writes for `backend` (None: it finds no such cabling)."""
    monkeypatch.setattr(mlx_config.IPConfigurator, "setup", lambda *a, **k: None)
    monkeypatch.setattr(mlx_config, "add_ips",
                        lambda hs, verbose=False: [h.ips.append(f"10.0.0.{h.rank + 1}") for h in hs])
    mlx_hosts, tb_hosts, index = mlx_inputs(hosts, links)
    ips = mlx_config.IPConfigurator(mlx_hosts, tb_hosts, index)
    connectivity = mlx_config.make_connectivity_matrix(tb_hosts, index)
    rings = mlx_config.extract_rings(connectivity)
    out = tmp_path / f"{backend}.json"
    args = argparse.Namespace(verbose=False, env=["MLX_X=1"], output_hostfile=str(out), auto_setup=False)
    sshinfo = [mlx_config.SSHInfo(True, True) for _ in hosts]
    if backend == "jaccl":
        if not mlx_config.check_valid_mesh(mlx_hosts, connectivity, strict=False):
            return None
        mlx_config.configure_jaccl(args, mlx_hosts, ips, sshinfo)
    else:
        if not mlx_config.check_valid_ring(mlx_hosts, rings, strict=False):
            return None
        configure = mlx_config.configure_ring if backend == "ring" else mlx_config.configure_jaccl_ring
        configure(args, mlx_hosts, ips, rings[0], sshinfo)
    return json.loads(out.read_text())


def ours(backend: str, hosts: list[str], links: list[list[str]]) -> dict | None:
    found = cabling(hosts, in_mlx_order(hosts, links))
    if topology.backend_problem(backend, hosts, found):
        return None
    return topology.mlx_hostfile(backend, hosts, found, ssh={h: f"{h}.local" for h in hosts},
                                 coordinator={h: f"10.0.0.{i + 1}" for i, h in enumerate(hosts)},
                                 envs=["MLX_X=1"])


RING3 = [["mac1:en2", "mac2:en2"], ["mac2:en3", "mac3:en2"], ["mac3:en3", "mac1:en3"]]
MESH4 = [["mac1:en2", "mac2:en2"], ["mac1:en3", "mac3:en2"], ["mac1:en4", "mac4:en2"],
         ["mac2:en3", "mac3:en3"], ["mac2:en4", "mac4:en3"], ["mac3:en4", "mac4:en4"]]
RING4 = [["mac1:en2", "mac2:en2"], ["mac2:en3", "mac3:en2"], ["mac3:en3", "mac4:en2"],
         ["mac4:en3", "mac1:en3"]]


@pytest.mark.parametrize("name, links", [
    ("two Macs, one cable", [["mac1:en2", "mac2:en2"]]),
    ("two Macs, two cables", [["mac1:en2", "mac2:en2"], ["mac1:en3", "mac2:en3"]]),
    ("three in a ring", RING3), ("four in a ring", RING4), ("four, full mesh", MESH4),
])
@pytest.mark.parametrize("backend", ["ring", "jaccl", "jaccl-ring"])
def test_hostfiles_equal_mlx_own_for_the_same_cabling(name, links, backend, tmp_path, monkeypatch):
    hosts = sorted({port.split(":")[0] for link in links for port in link})
    theirs = mlx_hostfile(backend, hosts, links, tmp_path, monkeypatch)
    assert ours(backend, hosts, links) == theirs
    if name == "four in a ring" and backend == "jaccl":
        assert theirs is None  # no mesh: both refuse


def test_a_ring_hostfile_gives_each_node_its_address_towards_its_left_neighbour():
    hosts = ["mac1", "mac2", "mac3"]
    found = cabling(hosts, RING3, "192.168.200.0/24")
    assert [c.network.with_prefixlen for c in found] == [
        "192.168.200.0/30", "192.168.200.4/30", "192.168.200.8/30"]
    hostfile = topology.mlx_hostfile("ring", hosts, found, ssh={h: h for h in hosts})
    # mac1 - mac2 - mac3 - mac1: mac1's left is mac3 (cable 2, where mac1 is the second end).
    assert [h["ips"] for h in hostfile["hosts"]] == [
        ["192.168.200.10"], ["192.168.200.2"], ["192.168.200.6"]]


@pytest.mark.parametrize("links, pool, says", [
    ([["mac1:en2", "mac2:en2"], ["mac1:en2", "mac3:en2"]], None,
     "thunderbolt_links[1] (mac1:en2 <-> mac3:en2): a port holds one cable, but mac1:en2 (also in "
     "thunderbolt_links[0]) is used twice"),
    ([["mac1:en2", "mac9:en2"]], None, "thunderbolt_links[0]: mac9 (in mac9:en2) is not a host"),
    ([["mac1:en2", "mac1:en3"]], None, "both ends are on mac1"),
    ([["mac1:en2"]], None, "thunderbolt_links[0]: ['mac1:en2'] is not a cable"),
    ([["mac1", "mac2:en2"]], None, "'mac1' is not a port: write it as host:interface"),
    ([["mac1:en2;reboot", "mac2:en2"]], None, "'en2;reboot' (in mac1:en2;reboot) is not an interface"),
    ([], None, "thunderbolt_links must list the cables"),
    ([["mac1:en2", "mac2:en2"], ["mac2:en3", "mac3:en2"]], "192.168.200.0/30",
     "thunderbolt_links[1] (mac2:en3 <-> mac3:en2): thunderbolt_link_pool 192.168.200.0/30 has "
     "room for 1 cables"),
    ([["mac1:en2", "mac2:en2"]], "192.168.200.1/24", "not an IPv4 network"),
    ([["mac1:en2", "mac2:en2"]], "224.0.0.0/24", "multicast, loopback or reserved"),
    ([["mac1:en2", "mac2:en2"]], "10.0.0.0/31", "holds no /30"),
    ([["mac1:en2", "mac2:en2"]], "8.8.8.0/24", "8.8.8.0/24 is not a private network"),
    ([["mac1:en2", "mac2:en2"]], "0.0.0.0/0", "0.0.0.0/0 is not a private network"),
])
def test_each_cabling_mistake_is_named_with_the_cable(links, pool, says):
    _, errors = topology.cables(links, pool, ["mac1", "mac2", "mac3"])
    assert any(says in e for e in errors), errors


def test_a_backend_the_cabling_cannot_carry_is_refused_naming_what_is_missing():
    hosts = ["mac1", "mac2", "mac3"]
    line = cabling(hosts, [["mac1:en2", "mac2:en2"], ["mac2:en3", "mac3:en2"]])
    problem = topology.backend_problem("ring", hosts, line)
    assert "make a ring through every node (mac1, mac2, mac3)" in problem
    ring = cabling(hosts, RING3)
    assert topology.backend_problem("ring", hosts, ring) is None
    ring4 = cabling(["mac1", "mac2", "mac3", "mac4"], RING4)
    problem = topology.backend_problem("mpi", ["mac1", "mac2", "mac3", "mac4"], ring4)
    assert "no cable joins mac1 <-> mac3, mac2 <-> mac4" in problem and "does not route" in problem
    assert "JACCL's mesh needs" in topology.backend_problem("jaccl", ["mac1", "mac2", "mac3", "mac4"], ring4)
    with pytest.raises(ValueError, match="jaccl backend cannot run"):
        topology.mlx_hostfile("jaccl", ["mac1", "mac2", "mac3", "mac4"], ring4, ssh={})


def test_a_cable_knows_its_ends():
    [cable] = cabling(["a", "b"], [["a:en2", "b:en5"]], "10.1.0.0/24")
    assert str(cable) == "a:en2 <-> b:en5"
    assert cable.address_of("a") == "10.1.0.1" and cable.address_of("b") == "10.1.0.2"
    assert cable.peer_of("a") == Port("b", "en5") and cable.port_of("b") == Port("b", "en5")


@st.composite
def random_cabling(draw):
    """2 to 8 Macs, each with up to 6 Thunderbolt ports (a Mac has 3 to 6), cabled as people cable
    them (a ring, a chain, a full mesh, a ring with a chord, a ring with one cable pulled) or at
    random."""
    n = draw(st.integers(2, 8))
    hosts = [f"mac{i + 1}" for i in range(n)]
    free = {h: [f"en{p}" for p in range(2, 8)] for h in hosts}
    ring = [(hosts[i], hosts[(i + 1) % n]) for i in range(n)] if n > 2 else [(hosts[0], hosts[1])]
    shape = draw(st.sampled_from(["ring", "chain", "mesh", "chord", "broken", "random"]))
    if shape == "ring":
        pairs = ring
    elif shape == "chain":
        pairs = ring[:n - 1]
    elif shape == "mesh":
        pairs = list(itertools.combinations(hosts, 2))
    elif shape == "chord":
        pairs = [*ring, (hosts[0], hosts[n // 2])] if n > 3 else ring
    elif shape == "broken":
        gone = draw(st.integers(0, len(ring) - 1))
        pairs = [p for i, p in enumerate(ring) if i != gone]
    else:
        pairs = [tuple(draw(st.lists(st.sampled_from(hosts), min_size=2, max_size=2, unique=True)))
                 for _ in range(draw(st.integers(1, 2 * n)))]
    links = []
    for a, b in pairs:
        if free[a] and free[b]:
            links.append([f"{a}:{free[a].pop(0)}", f"{b}:{free[b].pop(0)}"])
    return hosts, links


@settings(max_examples=200, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(random_cabling())
def test_any_cabling_gives_mlx_own_hostfiles_or_is_refused_as_mlx_refuses_it(tmp_path, monkeypatch, case):
    hosts, links = case
    if not links:
        return
    for backend in ("ring", "jaccl", "jaccl-ring"):
        assert ours(backend, hosts, links) == mlx_hostfile(backend, hosts, links, tmp_path, monkeypatch)


def links_inventory(links, **cluster_vars):
    hosts = ["mac1", "mac2", "mac3"]
    groups = {"cluster": hosts, "macs": [], "linux": hosts, "launcher": ["mac1"]}
    hostvars = {h: {"ansible_host": f"{h}.local", "thunderbolt_links": links, **cluster_vars}
                for h in hosts}
    return groups, hostvars


def test_a_links_inventory_is_checked_cable_by_cable_and_against_its_backend():
    from mlxcluster.describe.inventory import inventory_errors

    assert inventory_errors(*links_inventory(RING3)) == []  # auto: the ring will do
    assert inventory_errors(*links_inventory(RING3, cluster_backend="ring")) == []
    [problem] = inventory_errors(*links_inventory(RING3[:2], cluster_backend="ring"))
    assert "the ring backend needs the cables to make a ring through every node" in problem
    [problem] = inventory_errors(*links_inventory(RING3[:2]))
    assert "the cables make no ring through the nodes that train (mac1, mac2, mac3)" in problem
    groups, hostvars = links_inventory(RING3, cluster_backend="jaccl-ring")
    hostvars["mac2"]["mpi_slots"] = 2
    assert inventory_errors(groups, hostvars) == [
        "mac2: mpi_slots 2 over per-cable networks: one rank per machine (mpi_slots: 1; the ring's "
        "neighbours are machines)"]
    groups, hostvars = links_inventory(RING3[:2])
    hostvars["mac2"]["thunderbolt_ip"] = "192.168.200.2"
    hostvars["mac3"]["mpi_slots"] = 0  # out of training: mac1 - mac2 is the whole ring
    assert inventory_errors(groups, hostvars) == [
        "mac2: thunderbolt_ip is for thunderbolt_topology: bridge; with links each cable's addresses "
        "come from thunderbolt_link_pool: remove it"]
    # MPI over a full mesh of cables (a ring of three is one), not over a line of three.
    assert inventory_errors(*links_inventory(RING3, cluster_backend="mpi")) == []
    [problem] = inventory_errors(*links_inventory(RING3[:2], cluster_backend="mpi"))
    assert problem.startswith("the mpi backend cannot run on this cabling: MPI needs every two nodes")
    assert problem.endswith("no cable joins mac1 <-> mac3 (use --backend ring, or add those cables)")
    groups, hostvars = links_inventory(RING3)
    hostvars["mac3"]["thunderbolt_link_pool"] = "10.9.0.0/24"
    [problem] = inventory_errors(groups, hostvars)
    assert problem.startswith("thunderbolt_link_pool differs between the hosts (mac1: '192.168.200.0/24';")
    assert "mac3: '10.9.0.0/24'" in problem
    groups, hostvars = links_inventory(RING3, cluster_backend="nccl", thunderbolt_mtu=9000)
    hostvars["mac1"]["thunderbolt_mtu"] = 1500
    assert inventory_errors(groups, hostvars) == [
        "cluster_backend 'nccl' is not one of auto, ring, jaccl, jaccl-ring, mpi",
        "thunderbolt_mtu differs between the nodes (1500: mac1; 9000: mac2, mac3): every node on the "
        "link needs the same MTU; set it once for the whole cluster"]


def test_a_pool_over_the_management_network_or_a_misspelt_topology_is_refused():
    from mlxcluster.describe.inventory import inventory_errors

    groups, hostvars = links_inventory(RING3, thunderbolt_link_pool="10.9.0.0/16")
    hostvars["mac2"]["ansible_host"] = "10.9.4.2"  # an address: compared; names are not
    assert inventory_errors(groups, hostvars) == [
        "thunderbolt_link_pool 10.9.0.0/16 holds the management address of mac2 (10.9.4.2): the "
        "cables' /30s would take it over; choose a pool outside the network Ansible reaches the nodes "
        "on (the default is 192.168.200.0/24)"]
    for cabled in (RING3, []):
        groups, hostvars = links_inventory(cabled, thunderbolt_topology="link")
        if not cabled:
            for hv in hostvars.values():
                del hv["thunderbolt_links"]
        problems = inventory_errors(groups, hostvars)
        assert problems[0] == ("thunderbolt_topology 'link' is not one of bridge, links: bridge (one "
                               "network through a Thunderbolt bridge) or links (a network per cable)")


def test_a_large_pool_is_counted_not_listed():
    # Four million /30s in a /8: each cable's is computed, and the last one is still found.
    links = [["mac1:en2", "mac2:en2"], ["mac2:en3", "mac3:en2"], ["mac3:en3", "mac1:en3"]]
    found, errors = topology.cables(links, "10.0.0.0/8", ["mac1", "mac2", "mac3"])
    assert errors == [] and [str(c.network) for c in found] == ["10.0.0.0/30", "10.0.0.4/30", "10.0.0.8/30"]
    assert topology.pool_size(ipaddress.IPv4Network("10.0.0.0/8")) == 2**22
    assert str(topology.cable_subnet(ipaddress.IPv4Network("10.0.0.0/8"), 2**22 - 1)) == "10.255.255.252/30"
