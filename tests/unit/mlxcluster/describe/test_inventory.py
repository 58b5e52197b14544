"""The controller-side inventory checks that playbooks/validate.yml runs first."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from filter_plugins import cluster_inventory as inventory_plugin
from mlxcluster.describe.inventory import inventory_errors, link_errors, training_hosts

REPO = Path(__file__).resolve().parents[4]


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
        ({"node2": {"mpi_slots": -1}}, "node2: mpi_slots must be a whole number from 0 to 1024"),
        ({"node2": {"mpi_slots": "two"}}, "node2: mpi_slots must be a whole number from 0 to 1024"),
        ({"node2": {"mpi_slots": 10**12}}, "node2: mpi_slots must be a whole number from 0 to 1024"),
        ({"node2": {"mpi_slots": "\u00b2"}}, "node2: mpi_slots must be a whole number from 0 to 1024"),
        ({"node1": {"mpi_slots": 0}}, "launcher node1 has mpi_slots: 0"),
        ({"node2": {"thunderbolt_interface": None}}, "node2: no thunderbolt_interface"),
        ({"node2": {"thunderbolt_mtu": 70000}},
         "node2: thunderbolt_mtu 70000 is not an MTU between 576 and 65536"),
        ({"node2": {"thunderbolt_mtu": "jumbo"}}, "node2: thunderbolt_mtu 'jumbo' is not an MTU"),
        ({"node2": {"thunderbolt_ip": " 192.168.200.2 "}},
         "node2: thunderbolt_ip ' 192.168.200.2 ' is not an IPv4 address"),
        ({"node2": {"thunderbolt_ip": "224.0.0.2", "thunderbolt_prefix": 8}},
         "node2: thunderbolt_ip 224.0.0.2 is a multicast"),
        ({"node2": {"thunderbolt_ip": "0.0.0.0"}},
         "node2: thunderbolt_ip 0.0.0.0 is a multicast, unspecified"),
        ({"node1": {"thunderbolt_ip": "127.0.0.1", "thunderbolt_prefix": 8},
          "node2": {"thunderbolt_ip": "127.0.0.2", "thunderbolt_prefix": 8}},
         "thunderbolt_ip of node1, node2 is a loopback address"),
        ({"node2": {"thunderbolt_interface": "en0;reboot"}},
         "node2: thunderbolt_interface 'en0;reboot' is not an"),
        ({"node2": {"thunderbolt_interface": "br\n0"}}, "is not an interface name"),
        ({"node2": {"thunderbolt_mtu": 9000}},
         "thunderbolt_mtu differs between the nodes (1500: node1; 9000: node2)"),
    ],
)
def test_each_mistake_is_named_with_its_fix(override, expected):
    errors = inventory_errors(*cluster(**override))
    assert any(expected in e for e in errors), errors


def test_per_link_prefix_puts_hosts_in_one_subnet():
    groups, hostvars = cluster(node1={"thunderbolt_ip": "10.0.0.1", "thunderbolt_prefix": 30},
                               node2={"thunderbolt_ip": "10.0.0.2", "thunderbolt_prefix": 30})
    assert inventory_errors(groups, hostvars) == []


def test_one_mtu_set_for_every_node_is_fine_and_unset_means_the_default():
    assert inventory_errors(*cluster(node1={"thunderbolt_mtu": 9000},
                                     node2={"thunderbolt_mtu": "9000"})) == []
    assert inventory_errors(*cluster(node1={"thunderbolt_mtu": 1500})) == []


def test_link_rules_apply_to_the_settings_the_nodes_resolved():
    settings = {
        "node1": {"thunderbolt_ip": "10.78.7.11", "thunderbolt_prefix": 24,
                  "thunderbolt_interface": "bridge0", "thunderbolt_mtu": 1500},
        "node2": {"thunderbolt_ip": "10.78.7.11", "thunderbolt_prefix": 24,
                  "thunderbolt_interface": "bridge0", "thunderbolt_mtu": 9000},
    }
    assert link_errors(settings) == [
        "thunderbolt_ip 10.78.7.11 is used by both node1 and node2: give each host its own "
        "address",
        "thunderbolt_mtu differs between the nodes (1500: node1; 9000: node2): every node on "
        "the link needs the same MTU; set it once for the whole cluster",
    ]
    assert link_errors({"node1": settings["node1"]}) == []


def test_the_filter_passes_only_the_link_settings_that_are_set():
    link = inventory_plugin.FilterModule().filters()["cluster_link_errors"]
    assert link({"node1": {"thunderbolt_ip": None, "thunderbolt_interface": "bridge0",
                           "thunderbolt_mtu": 1500, "other": "ignored"}}) == [
        "node1: no thunderbolt_ip: set thunderbolt_ip: <its address on the Thunderbolt "
        "bridge> under node1 in the inventory"]


def test_the_thunderbolt_role_checks_its_nodes_with_these_rules(tmp_path, tool_env):
    # The role's preflight alone, on two local "nodes" that disagree on the MTU. A playbook
    # outside playbooks/ has no shipped defaults (playbooks/group_vars): every setting given.
    hosts = {f"node{i}": {"ansible_connection": "local",
                          "ansible_python_interpreter": "{{ ansible_playbook_python }}",
                          "thunderbolt_ip": f"10.78.9.1{i}", "thunderbolt_interface": "lo",
                          "thunderbolt_prefix": 24, "thunderbolt_mtu": mtu}
             for i, mtu in ((1, 1500), (2, 9000))}
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"cluster": {"hosts": hosts}}))
    playbook = tmp_path / "preflight.yml"
    playbook.write_text(yaml.safe_dump([{
        "name": "Check the link settings", "hosts": "cluster",
        "gather_facts": True, "gather_subset": ["min"],
        "tasks": [{"name": "Run the preflight", "ansible.builtin.include_role": {
            "name": "thunderbolt", "tasks_from": "preflight"}}]}]))
    proc = subprocess.run(["ansible-playbook", "-i", str(inventory), str(playbook)],
                          cwd=REPO, env={**tool_env, "ANSIBLE_CACHE_PLUGIN": "memory"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, proc.stdout
    assert "thunderbolt_mtu differs between the nodes (1500: node1; 9000: node2)" in proc.stdout
    assert "TASK [thunderbolt : Check that the nodes' settings make one link]" in proc.stdout


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


@pytest.mark.parametrize("root", ["/opt/mlx-cluster", "/Users/ada/mlx-cluster", "/home/ada/mlx_cluster-2",
                                  "/srv/mlx/cluster@v1"])
def test_a_cluster_root_of_its_own_is_accepted(root):
    from mlxcluster.describe.inventory import cluster_root_error
    assert cluster_root_error("node1", root) is None


@pytest.mark.parametrize(("root", "says"), [
    ("/opt/my cluster", "plain characters"), ("/opt/$(reboot)", "plain characters"),
    ("/opt/a;b", "plain characters"), ("/opt/a\nb", "plain characters"), ("opt/mlx", "plain characters"),
    ("", "plain characters"), (None, "plain characters"), (42, "plain characters"),
    ("/", "holds other things"), ("/root", "holds other things"), ("/home/ada", "holds other things"),
    ("/Users/ada/", "holds other things"), ("/Users/./ada", "holds other things"),
    ("/opt", "holds other things"), ("/opt/../home", "climbs"),
])
def test_a_cluster_root_that_is_unsafe_or_shared_is_refused_with_the_host_named(root, says):
    from mlxcluster.describe.inventory import cluster_root_error
    message = cluster_root_error("node2", root)
    assert message and message.startswith("node2: cluster_root") and says in message
    assert "/opt/mlx-cluster" in message


@pytest.mark.parametrize(("name", "settings", "says"), [
    ("node2", {"ansible_host": "-oProxyCommand=touch /tmp/pwned"}, "node2: ansible_host '-oProxyCommand"),
    ("node2", {"ansible_user": "-oProxyCommand=x"}, "node2: ansible_user '-oProxyCommand=x'"),
    ("node2", {"ansible_host": "10.0.0.2 -p 2222"}, "cannot be an ssh destination"),
    ("node2", {"ansible_user": ""}, "cannot be an ssh destination"),
    ("bad\nname", {}, "not a valid host name"),
    ("bad name", {}, "not a valid host name"),
    ("-node", {}, "not a valid host name"),
])
def test_a_host_name_or_ssh_destination_ssh_would_misread_is_refused(name, settings, says):
    from mlxcluster.describe.inventory import connection_errors
    errors = connection_errors(name, settings)
    assert any(says in e for e in errors), errors


@pytest.mark.parametrize("name", ["node1", "mac-studio-2", "mac1.local", "M4"])
def test_dns_host_names_and_plain_destinations_are_accepted(name):
    from mlxcluster.describe.inventory import connection_errors
    assert connection_errors(name, {"ansible_host": "192.168.1.20", "ansible_user": "ada"}) == []


def test_loopback_is_the_link_of_a_cluster_that_is_this_one_machine():
    local = {"ansible_connection": "local", "thunderbolt_prefix": 8}
    groups, hostvars = cluster(node1={**local, "thunderbolt_ip": "127.0.0.1"},
                               node2={**local, "thunderbolt_ip": "127.0.0.2"})
    assert inventory_errors(groups, hostvars) == []


@pytest.mark.parametrize("value", [True, False, "true", "False", None])
def test_model_dequantize_is_true_or_false(value):
    assert inventory_errors(*cluster(node2={"model_dequantize": value})) == []


@pytest.mark.parametrize("value", ["yes", 1, 0, "fast", [True]])
def test_a_model_dequantize_that_is_not_true_or_false_is_named_with_its_fix(value):
    assert inventory_errors(*cluster(node2={"model_dequantize": value})) == [
        f"node2: model_dequantize {value!r} must be true or false (true: this node's ranks dequantize a "
        "quantized model as they load it, trading memory for speed; false, the default: they train on its "
        "quantized weights)"]
