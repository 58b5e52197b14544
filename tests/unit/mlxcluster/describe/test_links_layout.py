"""What links mode gives each node (mlxcluster/describe/topology.py, addresses.py, record.py,
cluster.py and the thunderbolt role's filters): its ports, its address on the link, rank order,
the ring hostfile, and the record the launch code and doctor read."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings

from filter_plugins.thunderbolt import (
    thunderbolt_persist_files,
    thunderbolt_ping_targets,
    thunderbolt_stale_addresses,
)
from mlxcluster.describe import addresses, topology
from mlxcluster.describe.cluster import Cluster
from mlxcluster.describe.record import cables_of
from tests.unit.mlxcluster.describe.test_topology import random_cabling

# A ring of four: node1 and node3 share no cable, nor do node2 and node4.
RING4 = [["node1:en2", "node2:en2"], ["node2:en3", "node3:en2"], ["node3:en3", "node4:en2"],
         ["node4:en3", "node1:en3"]]
HOSTS = ["node1", "node2", "node3", "node4"]


def view(links=RING4, **extra) -> dict:
    return {h: {"thunderbolt_links": links, "thunderbolt_link_pool": "10.78.5.0/24",
                "ansible_host": f"10.77.5.{10 + i}", "mpi_slots": 1, **extra}
            for i, h in enumerate(HOSTS, 1)}


def test_each_node_gets_one_port_per_cable_end_with_its_far_end_to_ping():
    ports = addresses.ports_of("node1", HOSTS, view())
    assert ports == [
        {"interface": "en2", "address": "10.78.5.1", "prefix": 30, "cable": "node1:en2 <-> node2:en2",
         "pool": "10.78.5.0/24", "peers": {"node2": "10.78.5.2"},
         "routes": [{"to": "10.78.5.5", "via": "10.78.5.2"}]},
        {"interface": "en3", "address": "10.78.5.14", "prefix": 30, "cable": "node4:en3 <-> node1:en3",
         "pool": "10.78.5.0/24", "peers": {"node4": "10.78.5.13"},
         "routes": [{"to": "10.78.5.10", "via": "10.78.5.13"}]}]
    targets = thunderbolt_ping_targets(ports, "node1", ["node1", "node2"])  # node4 is down
    assert targets == [{"address": "10.78.5.2", "label": "node1:en2 <-> node2:en2"}]


def test_a_node_is_known_by_its_end_of_a_cable_to_the_launcher_and_copied_to_across_it():
    v = view()
    assert [addresses.contact_address(h, HOSTS, "node1", v) for h in HOSTS] == [
        "10.78.5.1", "10.78.5.2", "10.78.5.6", "10.78.5.13"]
    # node3 shares no cable with the launcher: the model reaches it over the management network.
    assert [addresses.reach_from_launcher(h, HOSTS, "node1", v) for h in HOSTS[1:]] == [
        "10.78.5.2", "10.77.5.13", "10.78.5.13"]
    assert addresses.link_of("node4", HOSTS, "node1", v) == {
        "thunderbolt_ip": "10.78.5.13", "thunderbolt_interface": "en3", "thunderbolt_prefix": 30,
        "thunderbolt_link_pool": "10.78.5.0/24"}


def test_ranks_follow_the_ring_so_each_ranks_neighbours_are_its_cables():
    # Listed node1..node4 but cabled 1-3-2-4-1: ranks go round the cables, 0-slot nodes last.
    crossed = [["node1:en2", "node3:en2"], ["node3:en3", "node2:en2"], ["node2:en3", "node4:en2"],
               ["node4:en3", "node1:en3"]]
    v = view(crossed)
    assert addresses.rank_order(HOSTS, "node1", v) == ["node1", "node3", "node2", "node4"]
    v["node3"]["mpi_slots"] = 0
    assert addresses.rank_order(HOSTS, "node1", v)[-1] == "node3"
    hostfile = addresses.links_hostfile(HOSTS, "node1", view(crossed))
    assert [h["ssh"] for h in hostfile["hosts"]] == ["10.78.5.1", "10.78.5.2", "10.77.5.12", "10.78.5.13"]
    assert [h["ips"] for h in hostfile["hosts"]] == [["10.78.5.14"], ["10.78.5.2"], ["10.78.5.6"],
                                                     ["10.78.5.10"]]


def test_the_record_keeps_the_cables_and_the_launch_code_reads_them_back():
    cables = cables_of({"cluster": HOSTS, "launcher": ["node1"]}, view())
    assert cables[1] == {"ends": [{"host": "node2", "interface": "en3", "address": "10.78.5.5"},
                                  {"host": "node3", "interface": "en2", "address": "10.78.5.6"}],
                         "network": "10.78.5.4/30"}
    nodes = [{"name": h, "thunderbolt_ip": addresses.contact_address(h, HOSTS, "node1", view()),
              "slots": 1} for h in HOSTS]
    cluster = Cluster.from_json({"launcher": "node1", "nodes": nodes, "cables": cables})
    node2, node3 = cluster.node("node2"), cluster.node("node3")
    assert cluster.address_towards(node3, node2) == "10.78.5.5"  # across their own cable
    assert [p.label for p in cluster.ports_of(node3)] == [
        "interface en2 (cable node2:en3 <-> node3:en2)", "interface en3 (cable node3:en3 <-> node4:en2)"]
    assert cluster.first_nodes(2).cables == cluster.cables
    assert cables_of({"cluster": ["a"], "launcher": ["a"]}, {"a": {"thunderbolt_ip": "10.0.0.1"}}) == []


def ring_of_four() -> Cluster:
    """The ring of four as provisioning records it: addresses, connections, cables."""
    v = view()
    nodes = [{"name": h, "thunderbolt_ip": addresses.contact_address(h, HOSTS, "node1", v), "slots": 1,
              "connection": {"host": v[h]["ansible_host"]}} for h in HOSTS]
    return Cluster.from_json({"launcher": "node1", "nodes": nodes,
                              "cables": cables_of({"cluster": HOSTS, "launcher": ["node1"]}, v)})


def test_every_pair_of_a_ring_of_four_is_reached_by_its_cable_or_the_management_network():
    cluster = ring_of_four()
    routes = {(a.name, b.name): cluster.path_towards(a, b) for a in cluster.nodes for b in cluster.nodes
              if a.name != b.name}
    # Neighbours across their own cable, at the far end's address on it.
    assert routes["node1", "node2"].address == "10.78.5.2"
    assert routes["node1", "node2"].over == "cable node1:en2 <-> node2:en2"
    assert routes["node3", "node2"].address == "10.78.5.5"
    # node1 and node3, node2 and node4 share no cable: their management addresses, which the
    # others reach (the record's thunderbolt_ip of node3 is on a cable node1 has no end of).
    for a, b in (("node1", "node3"), ("node3", "node1"), ("node2", "node4"), ("node4", "node2")):
        assert routes[a, b].address == f"10.77.5.{10 + int(b[-1])}"
        assert routes[a, b].over == "the management network, no cable between them"
        assert not routes[a, b].cabled
    assert cluster.node("node3").thunderbolt_ip == "10.78.5.6"
    # The model's fan-out from the launcher takes the same ways.
    from mlxcluster.launch import sync
    from mlxcluster.launch.shipment import Shipment

    steps = sync.fan_out(cluster, Shipment(Path("/m/tiny"), ("*.safetensors",)), "/opt/m")
    targets = [step[1][-1].split()[-1] for step in steps]
    assert targets == ["10.78.5.2:/opt/m/", "10.77.5.13:/opt/m/", "10.78.5.13:/opt/m/"]
    assert [step[0] for step in steps] == [
        "copy the model from node1 to node2 over the cluster link",
        "copy the model from node1 to node3 over the management network (no cable)",
        "copy the model from node1 to node4 over the cluster link"]
    # And mlx-cluster-launch reaches each rank the way the role's hostfile does.
    from mlxcluster.launch import builder

    assert [h["ssh"] for h in builder.ring_hosts(cluster)["hosts"]] == [
        h["ssh"] for h in addresses.links_hostfile(HOSTS, "node1", view())["hosts"]]
    # One node of the ring alone (bench.tensor's one process) runs directly, no launcher; two
    # of them are a ring of their own, with their own hosts file.
    assert builder.backend_for(cluster.first_nodes(1), None) == "direct"
    two = cluster.first_nodes(2)
    assert builder.backend_for(two, None) == "ring" and not two.provisioned
    assert [h["ssh"] for h in builder.ring_hosts(two)["hosts"]] == ["10.78.5.1", "10.78.5.2"]


def test_doctor_says_which_way_each_pair_goes():
    from mlxcluster.check import doctor

    cluster = ring_of_four()
    facts = {n.name: {"ssh": {cluster.address_towards(n, p): {"ok": True, "error": None}
                              for p in cluster.nodes if p.name != n.name}} for n in cluster.nodes}
    checks = {(c.scope, c.name): c for c in doctor._pairs(cluster, cluster.nodes, facts)}
    assert checks["node1 -> node2", "ssh over the cluster link"].detail == (
        "10.78.5.2 (cable node1:en2 <-> node2:en2)")
    assert checks["node1 -> node3", "ssh over the management network"].detail == (
        "10.77.5.13 (the management network, no cable between them)")
    assert all(c.ok for c in checks.values()) and len(checks) == 12


@pytest.mark.parametrize("backend, kept, written", [
    ("networkd", [], ["/etc/systemd/network/50-mlx-thunderbolt-en2.network"]),
    ("networkmanager", [], ["/etc/NetworkManager/system-connections/mlx-thunderbolt-en2.nmconnection"]),
])
def test_each_port_gets_its_own_boot_file_and_the_roles_other_files_go(backend, kept, written):
    [port] = addresses.ports_of("node2", HOSTS, view())[:1]
    existing = ["/etc/systemd/network/50-mlx-thunderbolt.network",  # the bridge's, before links
                "/etc/systemd/network/50-mlx-thunderbolt-en2.network",
                "/etc/NetworkManager/system-connections/mlx-thunderbolt-en9.nmconnection"]
    files = thunderbolt_persist_files([port], {"en2": "text"}, backend, existing)
    assert [f["path"] for f in files if f.get("state") != "absent"] == written
    assert sorted(f["path"] for f in files if f.get("state") == "absent") == sorted(
        set(existing) - set(written))


def test_a_ports_address_under_another_prefix_is_stale():
    ports = [{"interface": "en2", "address": "10.78.5.1", "prefix": 30}]
    now = {"en2": {"addr_info": [{"family": "inet", "local": "10.78.5.1", "prefixlen": 24},
                                 {"family": "inet", "local": "10.9.9.9", "prefixlen": 24}]}}
    assert thunderbolt_stale_addresses(ports, now) == [
        {"interface": "en2", "local": "10.78.5.1", "prefixlen": 24}]


def test_links_mode_trains_with_ring_by_default_and_refuses_mpi_off_a_full_mesh():
    from mlxcluster.errors import UserError
    from mlxcluster.launch import builder

    nodes = [{"name": h, "thunderbolt_ip": addresses.contact_address(h, HOSTS, "node1", view()),
              "slots": 1} for h in HOSTS]
    cluster = Cluster.from_json({"launcher": "node1", "nodes": nodes,
                                 "cables": cables_of({"cluster": HOSTS, "launcher": ["node1"]}, view())})
    assert builder.backend_for(cluster, None) == "ring"
    with pytest.raises(UserError, match="the mpi backend cannot run on this cabling"):
        builder.backend_for(cluster, "mpi")  # a ring of four: node1 and node3 share no cable
    bridge = Cluster.from_json({"launcher": "node1", "nodes": nodes})
    assert builder.backend_for(bridge, None) == "mpi"


def test_a_launch_writes_the_same_ring_hosts_file_provisioning_renders():
    from mlxcluster.launch import builder

    hosts = addresses.rank_order(HOSTS, "node1", view())
    nodes = [{"name": h, "thunderbolt_ip": addresses.contact_address(h, HOSTS, "node1", view()), "slots": 1,
              "connection": {"host": view()[h]["ansible_host"]}} for h in hosts]
    cluster = Cluster.from_json({"launcher": "node1", "nodes": nodes,
                                 "cables": cables_of({"cluster": HOSTS, "launcher": ["node1"]}, view())})
    assert builder.ring_hosts(cluster, ["A=1"]) == addresses.links_hostfile(HOSTS, "node1", view(), ["A=1"])


def test_routes_to_a_neighbours_other_addresses_are_added_once_and_stale_ones_removed():
    from filter_plugins.thunderbolt import thunderbolt_missing_routes, thunderbolt_stale_routes

    ports = addresses.ports_of("node1", HOSTS, view())
    # As `ip -j -4 route show` lists them: the /30s, one wanted route there already, one stale
    # (a cable gone), and routes that are not the role's (a default route, another interface's).
    now = [{"dst": "10.78.5.0/30", "dev": "en2", "protocol": "kernel", "scope": "link"},
           {"dst": "10.78.5.5", "gateway": "10.78.5.2", "dev": "en2"},
           {"dst": "10.78.5.21", "gateway": "10.78.5.13", "dev": "en3"},
           {"dst": "default", "gateway": "10.77.5.1", "dev": "eth0"},
           {"dst": "10.9.9.9", "gateway": "10.77.5.1", "dev": "eth0"}]
    assert thunderbolt_missing_routes(ports, now) == [
        {"to": "10.78.5.10", "via": "10.78.5.13", "interface": "en3"}]
    assert thunderbolt_stale_routes(ports, now) == [
        {"to": "10.78.5.21", "via": "10.78.5.13", "interface": "en3"}]
    # On a bridge there are none to add, and nothing is ever removed.
    bridge = [{"interface": "bridge0", "address": "10.0.0.1", "prefix": 24, "cable": None, "peers": {}}]
    assert thunderbolt_missing_routes(bridge, now) == thunderbolt_stale_routes(bridge, now) == []


def test_the_pools_addresses_off_the_cable_ports_are_strays_to_remove():
    from filter_plugins.thunderbolt import thunderbolt_stray_addresses

    ports = addresses.ports_of("node1", HOSTS, view())
    assert {p["pool"] for p in ports} == {"10.78.5.0/24"}
    # As `ip -j addr show` lists them, after a move from bridge to links: the bridge keeps its
    # address in the pool until a reboot. The ports' own, loopback, other networks and the
    # address Ansible reaches the node at stay.
    now = [{"ifname": "lo", "link_type": "loopback",
            "addr_info": [{"family": "inet", "local": "127.0.0.1", "prefixlen": 8}]},
           {"ifname": "eth0", "link_type": "ether",
            "addr_info": [{"family": "inet", "local": "10.77.5.11", "prefixlen": 24},
                          {"family": "inet6", "local": "fe80::1", "prefixlen": 64}]},
           {"ifname": "bridge0", "link_type": "ether",
            "addr_info": [{"family": "inet", "local": "10.78.5.11", "prefixlen": 24},
                          {"family": "inet", "local": "10.9.9.9", "prefixlen": 24}]},
           {"ifname": "en2", "link_type": "ether",
            "addr_info": [{"family": "inet", "local": "10.78.5.1", "prefixlen": 30}]},
           {"ifname": "usb0", "link_type": "ether",
            "addr_info": [{"family": "inet", "local": "10.78.5.200", "prefixlen": 24}]}]
    assert thunderbolt_stray_addresses(ports, now, "10.78.5.200") == [
        {"interface": "bridge0", "local": "10.78.5.11", "prefixlen": 24}]
    assert thunderbolt_stray_addresses(ports, now) == [
        {"interface": "bridge0", "local": "10.78.5.11", "prefixlen": 24},
        {"interface": "usb0", "local": "10.78.5.200", "prefixlen": 24}]
    # On a bridge there is no pool: nothing is a stray.
    bridge = [{"interface": "bridge0", "address": "10.0.0.1", "prefix": 24, "cable": None, "peers": {}}]
    assert thunderbolt_stray_addresses(bridge, now) == []


def test_ip_commands_bring_a_node_s_cable_ports_to_their_settings_in_order_and_none_when_converged():
    from filter_plugins.thunderbolt import thunderbolt_ip_commands

    ports = addresses.ports_of("node1", HOSTS, view())
    en2, en3 = ports
    wanted = [{"dst": f"{r['to']}", "gateway": r["via"], "dev": port["interface"]}
              for port in ports for r in port["routes"]]

    def link(name, *inet, flags=("BROADCAST", "UP"), mtu=9000, link_type="ether"):
        return {"ifname": name, "flags": list(flags), "mtu": mtu, "link_type": link_type,
                "addr_info": [{"family": "inet", "local": a, "prefixlen": p} for a, p in inet]}

    converged = [link("lo", ("127.0.0.1", 8), flags=("LOOPBACK", "UP"), mtu=65536, link_type="loopback"),
                 link("en2", (en2["address"], en2["prefix"])), link("en3", (en3["address"], en3["prefix"]))]
    assert thunderbolt_ip_commands(ports, converged, wanted, 9000) == []
    # A node just cabled: en2 down at the default MTU with its address under an old prefix, en3
    # without its address, a bridge's pool address left over, one route missing and one stale.
    fresh = [converged[0], link("en2", (en2["address"], 24), flags=("BROADCAST",), mtu=1500),
             link("en3"), link("bridge0", ("10.78.5.11", 24))]
    routes = [*wanted[1:], {"dst": "10.78.5.21", "gateway": "10.78.5.13", "dev": "en3"}]
    commands = [" ".join(c["argv"]) for c in thunderbolt_ip_commands(ports, fresh, routes, "9000")]
    first = wanted[0]
    assert commands == [
        "ip link set dev en2 up", "ip link set dev en2 mtu 9000",
        f"ip addr del {en2['address']}/24 dev en2", "ip addr del 10.78.5.11/24 dev bridge0",
        f"ip addr add {en2['address']}/{en2['prefix']} dev en2",
        f"ip addr add {en3['address']}/{en3['prefix']} dev en3",
        f"ip route replace {first['dst']}/32 via {first['gateway']} dev {first['dev']}",
        "ip route del 10.78.5.21/32 via 10.78.5.13 dev en3"]
    # Loopback (the embedded single-machine inventory) keeps its own MTU.
    local = [{"interface": "lo", "address": "127.0.0.1", "prefix": 8, "cable": None, "peers": {}}]
    assert thunderbolt_ip_commands(local, converged, [], 9000) == []


@settings(max_examples=150, derandomize=True, deadline=None)
@given(random_cabling())
def test_every_pair_of_any_cabling_is_reached_at_an_address_ssh_mesh_pins_and_its_cable_carries(case):
    # The launch side (Cluster.path_towards, from the record) against the Ansible side (the
    # addresses ssh_mesh pins each node's host key under: its ansible_host and cluster_addresses).
    from filter_plugins.cluster_inventory import cluster_addresses

    hosts, links = case
    if not links:
        return
    v = {h: {"thunderbolt_links": links, "thunderbolt_link_pool": "10.78.4.0/22",
             "ansible_host": f"10.77.5.{10 + i}", "mpi_slots": 1} for i, h in enumerate(hosts, 1)}
    nodes = [{"name": h, "thunderbolt_ip": addresses.contact_address(h, hosts, hosts[0], v), "slots": 1,
              "connection": {"host": v[h]["ansible_host"]}} for h in hosts]
    cluster = Cluster.from_json({"launcher": hosts[0], "nodes": nodes,
                                 "cables": cables_of({"cluster": hosts, "launcher": [hosts[0]]}, v)})
    joined = topology.neighbours(hosts, cluster.links())
    for node in cluster.nodes:
        own = {port.address for port in cluster.ports_of(node)}
        for peer in cluster.nodes:
            if peer is node:
                continue
            route = cluster.path_towards(node, peer)
            assert route.address in {v[peer.name]["ansible_host"], *cluster_addresses(peer.name, hosts, v)}
            assert route.cabled == (peer.name in joined[node.name])
            if route.cabled:  # the far end of a cable whose near end is node's own
                cable = next(c for c in cluster.links() if c.joins(node.name, peer.name))
                assert route.address == cable.address_of(peer.name) and cable.address_of(node.name) in own
            else:
                assert route.address == v[peer.name]["ansible_host"]
