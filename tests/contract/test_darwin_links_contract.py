"""Darwin CONTRACT test of links mode: what the thunderbolt role asks a Mac's networksetup to do
when each cable is its own network.

The session's three stand-in Macs (stand_in_macs.py), cabled as a ring point to point (veth
pairs named en2 and en3, as a Mac's Thunderbolt ports; the stand-in knows them as the hardware
ports "Thunderbolt 1" and "Thunderbolt 2"), run the contract play with the thunderbolt role alone,
in links mode: ``--check``, a first run and a second run. Before the runs two Macs get what a
used Mac has: node1 a service the role made for a cable that is gone (en5), node2 a disabled
service of its own on en2. An address set with networksetup is applied to the node's real port,
so the role's own ping across every cable, and the test's, run for real.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

import pytest

from mlxcluster.check import doctor
from mlxcluster.describe import addresses, topology
from mlxcluster.describe.cluster import Cluster
from tests.contract.stand_in_macs import (
    HERE,
    LAB_ID,
    NODES,
    Call,
    StandInMacs,
    ansible_playbook,
    node_shell,
    recap,
)

pytestmark = pytest.mark.cluster

HOSTS = [f"node{i}" for i in range(1, NODES + 1)]
RUNS = ("links-check", "links-first", "links-second")
MTU = 9000
POOL = f"10.78.{LAB_ID}.0/24"  # the lab's own, as lab.up writes it
PREFIX = "MLX Thunderbolt "
# What used Macs have before the runs (set up as root, outside any labelled run): node1 a service
# the role made for a cable now gone, node2 a disabled one of its own; RDMA enabled (in Recovery)
# on node1 and node2, and on node3 only between the first and the second run.
NETWORKSETUP = "/opt/mlx-contract/bin/networksetup"
ENABLE_RDMA = "MLX_CONTRACT_RECOVERY=1 /opt/mlx-contract/bin/rdma_ctl enable"
BEFORE = {1: [shlex.join([NETWORKSETUP, "-createnetworkservice", f"{PREFIX}en5", "Thunderbolt 4"]),
              ENABLE_RDMA],
          2: [shlex.join([NETWORKSETUP, "-createnetworkservice", "TB one", "Thunderbolt 1"]),
              shlex.join([NETWORKSETUP, "-setnetworkserviceenabled", "TB one", "off"]), ENABLE_RDMA]}


@dataclass(frozen=True)
class Runs:
    calls: list[Call]
    recaps: dict[str, dict[str, dict[str, int]]]
    cables: list[topology.Cable]  # as the inventory lists them
    records: dict[str, dict]  # the record (cluster.json) each run's facts make


@pytest.fixture(scope="module")
def links(stand_in_macs: StandInMacs) -> Runs:
    """The three runs on the stand-in Macs in links mode."""
    lab = stand_in_macs.lab
    cabling = [["node1:en2", "node2:en2"], ["node2:en3", "node3:en2"], ["node3:en3", "node1:en3"]]
    inventory = stand_in_macs.write_inventory("links-inventory", {
        host: {"ansible_host": lab.mgmt_ip(i), "mpi_slots": 1} for i, host in enumerate(HOSTS, 1)}, {
        "thunderbolt_topology": "links", "thunderbolt_links": cabling, "thunderbolt_link_pool": POOL,
        "thunderbolt_mtu": MTU})
    for node, commands in BEFORE.items():
        for command in commands:
            node_shell(lab, node, command)
    recaps, records = {}, {}
    for run in RUNS:
        if run == "links-second":
            node_shell(lab, 3, ENABLE_RDMA)
        extra = {"contract_run": run, "contract_roles": ["thunderbolt"]}
        check = ["--check"] if run == "links-check" else []
        if not check:
            extra["contract_record_path"] = str(stand_in_macs.work / f"{run}.json")
        output = ansible_playbook(inventory, HERE / "darwin.yml", *check, "-e", json.dumps(extra),
                                  facts_dir=stand_in_macs.facts_dir)
        recaps[run] = recap(output, range(1, NODES + 1))
        if not check:
            records[run] = json.loads((stand_in_macs.work / f"{run}.json").read_text())
    calls = [call for call in stand_in_macs.calls(range(1, NODES + 1)) if call.run in RUNS]
    return Runs(calls, recaps, topology.cables(cabling, POOL, HOSTS)[0], records)


def changes(calls: list[Call], run: str, host: str | None = None) -> list[str]:
    return [c.command for c in calls if c.run == run and c.changes_something and host in (None, c.host)]


def test_every_run_succeeds_and_the_second_and_check_runs_change_nothing(links):
    calls, recaps = links.calls, links.recaps
    for run in RUNS:
        assert all((c["failed"], c["unreachable"]) == (0, 0) for c in recaps[run].values()), run
    assert {host: c["changed"] for host, c in recaps["links-second"].items()} == dict.fromkeys(HOSTS, 0)
    assert changes(calls, "links-second") == [] and changes(calls, "links-check") == []
    assert [(c.host, c.command, c.rc) for c in calls if c.rc != 0] == []


def test_each_mac_turns_the_bridge_off_and_gives_every_cabled_port_its_cables_address(links):
    calls, cables = links.calls, links.cables
    for host in HOSTS:
        expected = []
        for cable in cables:
            if host not in (end.host for end in cable.ends):
                continue
            port = cable.port_of(host).interface
            service = "TB one" if (host, port) == ("node2", "en2") else PREFIX + port
            if service != "TB one":
                expected.append(shlex.join(["networksetup", "-createnetworkservice", service,
                                            {"en2": "Thunderbolt 1", "en3": "Thunderbolt 2"}[port]]))
            expected.append(shlex.join(["networksetup", "-setmanual", service, cable.address_of(host),
                                        "255.255.255.252"]))
        made = changes(calls, "links-first", host)
        assert made[0] == "networksetup -setnetworkserviceenabled 'Thunderbolt Bridge' off", made
        ported = [c for c in made if "-createnetworkservice" in c or "-setmanual" in c]
        assert sorted(ported) == sorted(expected), made
        # A port's service exists before its address is set.
        assert ported == sorted(ported, key=lambda c: "-setmanual" in c), made
        assert sorted(c for c in made if "-setMTU" in c) == [f"networksetup -setMTU {p} {MTU}"
                                                            for p in ("en2", "en3")]
        # Each neighbour's address on its other cable, through its end of this one.
        view = {h: {"thunderbolt_links": [[str(e) for e in c.ends] for c in cables],
                    "thunderbolt_link_pool": POOL} for h in HOSTS}
        routed = []
        for p in addresses.ports_of(host, HOSTS, view):
            service = "TB one" if (host, p["interface"]) == ("node2", "en2") else PREFIX + p["interface"]
            words = [word for r in p["routes"] for word in (r["to"], "255.255.255.255", r["via"])]
            routed.append(shlex.join(["networksetup", "-setadditionalroutes", service, *words]))
        assert sorted(c for c in made if "-setadditionalroutes" in c) == sorted(routed)
        # Every change as root, after the role read the ports and services.
        first = [c for c in calls if c.run == "links-first" and c.host == host]
        assert all(c.uid == 0 for c in first if c.changes_something)
        reads = [c.command for c in first].index("networksetup -listallnetworkservices")
        assert not [c for c in first[:reads] if c.changes_something]


def test_a_used_macs_services_are_reused_enabled_or_removed(links):
    calls = links.calls
    removed = "networksetup -removenetworkservice 'MLX Thunderbolt en5'"
    assert removed in changes(calls, "links-first", "node1")
    node2 = changes(calls, "links-first", "node2")
    assert "networksetup -setnetworkserviceenabled 'TB one' on" in node2
    assert not [c for c in node2 if "-createnetworkservice" in c and "en2" in c]


def test_every_cable_carries_its_addresses_for_real(links, stand_in_macs: StandInMacs):
    cables = links.cables
    for cable in cables:
        for end in cable.ends:
            node = HOSTS.index(end.host) + 1
            shown = node_shell(stand_in_macs.lab, node, f"ip -4 -o addr show dev {end.interface}")
            assert f"{cable.address_of(end.host)}/30" in shown, (str(cable), shown)
        a, b = cable.ends
        node_shell(stand_in_macs.lab, HOSTS.index(a.host) + 1,
                   f"ping -c 1 -W 2 -I {a.interface} {cable.address_of(b.host)}")
    # node1 reaches node2 at its address on the node2-node3 cable, across their own cable.
    far = next(c for c in cables if c.joins("node2", "node3")).address_of("node2")
    assert "dev en2" in node_shell(stand_in_macs.lab, 1, f"ip route get {far}")
    node_shell(stand_in_macs.lab, 1, f"ping -c 1 -W 2 {far}")


def test_the_record_keeps_each_macs_rdma_devices_and_auto_picks_jaccl_once_every_port_has_rdma(
        links, stand_in_macs: StandInMacs):
    first, second = links.records["links-first"], links.records["links-second"]
    every_port = ["rdma_en2", "rdma_en3", "rdma_en4", "rdma_en5"]
    assert {n["name"]: n["rdma_devices"] for n in first["nodes"]} == {
        "node1": every_port, "node2": every_port, "node3": []}
    assert {n["name"]: n["management_ip"] for n in first["nodes"]} == {
        host: stand_in_macs.lab.mgmt_ip(i) for i, host in enumerate(HOSTS, 1)}
    # node3's ports lack RDMA: the ring backend, saying so and how to enable it.
    assert first["backend"]["name"] == "ring"
    assert "no RDMA on node3:en2, node3:en3" in first["backend"]["why"]
    assert "rdma_ctl enable" in first["backend"]["why"]
    # A ring of three is a full mesh: with RDMA everywhere, JACCL's mesh.
    assert second["backend"] == {"name": "jaccl", "why": "a cable joins every two nodes and every "
                                 "cabled port has RDMA"}
    for run in ("links-check", "links-first", "links-second"):
        probes = [c.host for c in links.calls if c.run == run and c.tool == "ibv_devices"]
        assert sorted(probes) == HOSTS, run


# Last in this module: it changes the stand-in Macs (a bridge turned back on, RDMA off, a macOS
# update on one Mac) to see doctor name each.
def test_doctor_checks_each_macs_version_bridge_service_and_rdma_with_the_fix(links, stand_in_macs):
    cluster = Cluster.from_json(links.records["links-second"])  # JACCL: RDMA on every port
    assert cluster.backend_choice().backend == "jaccl"
    # The record names each Mac's bridge service (thunderbolt_macos_service), which doctor asks about.
    assert {n.bridge_service for n in cluster.nodes} == {"Thunderbolt Bridge"}

    def mac_checks() -> dict[tuple[str, str], doctor.Check]:
        found = doctor.evaluate(cluster, "", doctor.gather(cluster))
        return {(c.scope, c.name): c for c in found
                if c.name in ("macOS", "Thunderbolt Bridge service", "RDMA")}

    healthy = mac_checks()
    assert len(healthy) == 3 * NODES and all(c.ok for c in healthy.values()), healthy
    assert healthy["node1", "RDMA"].detail == "enabled: rdma_en2, rdma_en3, rdma_en4, rdma_en5"
    lab = stand_in_macs.lab
    node_shell(lab, 2, shlex.join([NETWORKSETUP, "-setnetworkserviceenabled", "Thunderbolt Bridge", "on"]))
    node_shell(lab, 3, ENABLE_RDMA.replace("enable", "disable"))
    # One Mac updated: the stand-in's state says so.
    node_shell(lab, 1, "python3 -c \"import json; p = '/opt/mlx-contract/state.json'; "
                       "s = json.load(open(p)); s['macos_version'] = '26.3'; json.dump(s, open(p, 'w'))\"")
    broken = {key: check for key, check in mac_checks().items() if not check.ok}
    assert set(broken) == {("node1", "macOS"), ("node2", "Thunderbolt Bridge service"), ("node3", "RDMA")}
    assert broken["node1", "macOS"].detail == "26.3, but node2 26.2, node3 26.2"
    assert "the thunderbolt role turns it off" in broken["node2", "Thunderbolt Bridge service"].fix
    assert broken["node3", "RDMA"].detail == ("rdma_ctl status: disabled; no rdma_en2, rdma_en3 in "
                                             "ibv_devices")
    assert "in macOS Recovery, Terminal, `rdma_ctl enable`" in broken["node3", "RDMA"].fix
