"""The controller-side inventory checks that playbooks/validate.yml runs first."""

from __future__ import annotations

import pytest

from mlxcluster.inventory import inventory_errors, training_hosts


def cluster(**hosts: dict) -> tuple[dict, dict]:
    """A two-Mac cluster, with per-host overrides; node1 is the launcher."""
    base = {
        "node1": {"thunderbolt_ip": "192.168.200.1", "thunderbolt_interface": "bridge0"},
        "node2": {"thunderbolt_ip": "192.168.200.2", "thunderbolt_interface": "bridge0"},
    }
    for name, override in hosts.items():
        base[name] = {**base.get(name, {"thunderbolt_interface": "bridge0"}), **override}
    hostvars = {h: {k: v for k, v in hv.items() if v is not None} for h, hv in base.items()}
    groups = {"cluster": list(hostvars), "macs": list(hostvars), "linux": [],
              "launcher": ["node1"]}
    return groups, hostvars


def test_a_good_inventory_has_no_errors():
    assert inventory_errors(*cluster()) == []


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ({"node2": {"thunderbolt_ip": "192.168.200.1"}},
         "thunderbolt_ip 192.168.200.1 is used by both node1 and node2"),
        ({"node2": {"thunderbolt_ip": "192.168.200.300"}},
         "node2: thunderbolt_ip '192.168.200.300' is not an IPv4 address"),
        ({"node2": {"thunderbolt_ip": "fe80::1"}}, "is not an IPv4 address"),
        ({"node2": {"thunderbolt_ip": None}}, "node2: no thunderbolt_ip: set thunderbolt_ip:"),
        ({"node2": {"thunderbolt_ip": "192.168.201.2"}},
         "not in one subnet (192.168.200.0/24: node1; 192.168.201.0/24: node2)"),
        ({"node2": {"thunderbolt_ip": "192.168.200.255"}}, "network or broadcast address"),
        ({"node2": {"thunderbolt_prefix": "big"}}, "node2: thunderbolt_prefix 'big'"),
        ({"node2": {"mpi_slots": -1}}, "node2: mpi_slots must be a whole number >= 0"),
        ({"node2": {"mpi_slots": "two"}}, "node2: mpi_slots must be a whole number >= 0"),
        ({"node1": {"mpi_slots": 0}}, "launcher node1 has mpi_slots: 0"),
        ({"node2": {"thunderbolt_interface": None}}, "node2: no thunderbolt_interface"),
    ],
)
def test_each_mistake_is_named_with_its_fix(override, expected):
    errors = inventory_errors(*cluster(**override))
    assert any(expected in e for e in errors), errors


def test_per_link_prefix_puts_hosts_in_one_subnet():
    groups, hostvars = cluster(node1={"thunderbolt_ip": "10.0.0.1", "thunderbolt_prefix": 30},
                               node2={"thunderbolt_ip": "10.0.0.2", "thunderbolt_prefix": 30})
    assert inventory_errors(groups, hostvars) == []


def test_launcher_count_must_be_exactly_one():
    groups, hostvars = cluster()
    assert any("no host in group `launcher`" in e
               for e in inventory_errors({**groups, "launcher": []}, hostvars))
    errors = inventory_errors({**groups, "launcher": ["node1", "node2"]}, hostvars)
    assert any("has 2 hosts (node1, node2): keep exactly one" in e for e in errors)
    errors = inventory_errors({**groups, "launcher": ["elsewhere"]}, hostvars)
    assert any("launcher elsewhere is not in group `cluster`" in e for e in errors)


def test_zero_slots_in_total_is_rejected():
    groups, hostvars = cluster(node1={"mpi_slots": 0}, node2={"mpi_slots": 0})
    errors = inventory_errors({**groups, "launcher": ["node2"]}, hostvars)
    assert any("launcher node2 has mpi_slots: 0" in e for e in errors)
    assert any("0 MPI slots in total" in e for e in errors)


def test_a_host_must_be_in_exactly_one_platform_group():
    groups, hostvars = cluster()
    errors = inventory_errors({**groups, "macs": ["node1"]}, hostvars)
    assert errors == ["node2: unknown OS family: it is in neither `macs` nor `linux`; put it "
                      "under macs: (macOS with Homebrew) or linux: (Debian/Ubuntu)"]
    errors = inventory_errors({**groups, "linux": ["node1"]}, hostvars)
    assert any("node1: it is in both `macs` and `linux`" in e for e in errors)


def test_an_empty_cluster_says_how_to_start():
    assert "no hosts in group `cluster`" in inventory_errors({}, {})[0]


def test_training_hosts_put_the_launcher_first_and_skip_zero_slot_hosts():
    groups, hostvars = cluster(node3={"thunderbolt_ip": "192.168.200.3", "mpi_slots": 0},
                               node4={"thunderbolt_ip": "192.168.200.4", "mpi_slots": 2})
    groups = {**groups, "launcher": ["node2"]}
    assert training_hosts(groups, hostvars) == [
        ("node2", "192.168.200.2", 1), ("node1", "192.168.200.1", 1),
        ("node4", "192.168.200.4", 2)]
