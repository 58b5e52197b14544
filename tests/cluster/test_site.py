"""site.yml on a real 3-node lab cluster, as a user would run it.

The tests run in file order and share one cluster: dry run on fresh nodes, first
converge, idempotent second run, checks on every node (testinfra), MPI across the
nodes over the Thunderbolt-like link, then the bad-input paths: an unreachable node,
a node added to the inventory, a node whose OS does not match its group.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import testinfra
import yaml

from mlxcluster import lab

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
CLUSTER_ROOT = "/opt/mlx-cluster"  # set by the lab inventory


def host(cluster, node: int):
    return testinfra.get_host(f"ansible://node{node}?ansible_inventory={cluster.inventory}")


STATE = ("dpkg-query -W -f '${Status}' openmpi-bin 2>&1; ls -A /opt/mlx-cluster 2>&1; "
         "ls -A /root/.ssh; ip -br addr show dev bridge0")


def test_check_mode_on_fresh_nodes_changes_nothing(lab_cluster):
    before = [lab_cluster.ssh(i, STATE).stdout for i in (1, 2, 3)]
    run = lab_cluster.playbook(check=True)
    assert run.returncode == 0, json.dumps(run.failures, indent=1) + run.stderr[-2000:]
    assert [lab_cluster.ssh(i, STATE).stdout for i in (1, 2, 3)] == before


def test_first_run_converges(lab_cluster):
    run = lab_cluster.playbook()
    assert run.returncode == 0, json.dumps(run.failures, indent=1) + run.stderr[-3000:]
    assert set(run.stats) == {"node1", "node2", "node3"}
    assert all(stats["changed"] > 0 for stats in run.stats.values())


def test_second_run_changes_nothing(lab_cluster):
    run = lab_cluster.playbook()
    assert run.returncode == 0, json.dumps(run.failures, indent=1)
    assert run.changed == {}, f"not idempotent: {run.changed}"


@pytest.mark.parametrize("node", [1, 2, 3])
def test_each_node_has_mpi_the_venv_and_its_thunderbolt_address(lab_cluster, node):
    h = host(lab_cluster, node)
    assert h.run("mpirun --version").stdout.startswith("mpirun (Open MPI) 4.")
    probe = h.run(f". {CLUSTER_ROOT}/env.sh && python -c 'import mlx.core as mx, mlx_lm; "
                  "print(mx.__version__, mx.distributed.is_available())'")
    assert probe.rc == 0, probe.stderr
    assert probe.stdout.split() == ["0.32.4", "True"]
    assert h.file(f"{CLUSTER_ROOT}/venv/bin/python").exists
    addresses = h.interface("bridge0").addresses
    assert lab_cluster.lab.tb_ip(node) in addresses


@pytest.mark.parametrize("node", [1, 2, 3])
def test_each_node_has_the_hostfiles_rendered_from_inventory(lab_cluster, node):
    lab_obj = lab_cluster.lab
    hostfile = host(lab_cluster, node).file(f"{CLUSTER_ROOT}/hostfile").content_string
    entries = [line for line in hostfile.splitlines() if line and not line.startswith("#")]
    assert entries == [f"{lab_obj.tb_ip(i)} slots=1" for i in (1, 2, 3)]
    hosts_json = json.loads(host(lab_cluster, node).file(f"{CLUSTER_ROOT}/hosts.json")
                            .content_string)
    assert [h["ips"] for h in hosts_json["hosts"]] == [[lab_obj.tb_ip(i)] for i in (1, 2, 3)]
    build = REPO / "build" / f"lab{lab_obj.lab_id}" / "hostfile"
    assert build.read_text() == hostfile


def test_ssh_between_nodes_by_every_name_needs_no_password_and_no_prompt(lab_cluster):
    lab_obj = lab_cluster.lab
    for target in (lab_obj.tb_ip(3), lab_obj.mgmt_ip(3), "node3"):
        probe = lab_cluster.ssh(1, f"ssh -o BatchMode=yes {target} hostname")
        assert probe.returncode == 0, f"node1 -> {target}: {probe.stderr}"
        assert probe.stdout.strip() == "node3"
    effective = lab_cluster.ssh(1, f"ssh -G {lab_obj.tb_ip(3)}").stdout.lower().splitlines()
    assert "stricthostkeychecking ask" in effective or "stricthostkeychecking true" in effective


def test_mpirun_on_the_launcher_reaches_every_node_over_the_thunderbolt_link(lab_cluster):
    probe = lab_cluster.ssh(1, (
        f". {CLUSTER_ROOT}/env.sh && mpirun --allow-run-as-root "
        f"--hostfile {CLUSTER_ROOT}/hostfile -np 3 "
        "--mca btl_tcp_if_include bridge0 --mca oob_tcp_if_include bridge0 hostname"))
    assert probe.returncode == 0, probe.stderr
    assert sorted(probe.stdout.split()) == ["node1", "node2", "node3"]


def test_unreachable_node_is_named_and_the_others_finish(lab_cluster):
    lab.stop_node(lab_cluster.lab, 3)
    run = lab_cluster.playbook()
    assert run.returncode != 0
    assert run.stats["node3"]["unreachable"] >= 1
    assert run.stats["node1"]["failures"] == 0 and run.stats["node2"]["failures"] == 0
    # The only change: the launch code's record of the cluster now says node3 is down.
    record = "hostfile : Record the resolved cluster layout on the controller for the launch code"
    assert set(run.changed.get("node1", [])) <= {record} and run.changed.get("node2", []) == []
    layout = REPO / "build" / f"lab{lab_cluster.lab.lab_id}" / "cluster.json"
    assert [n["reachable"] for n in json.loads(layout.read_text())["nodes"]] == [True, True, False]
    # Fixed (the node is back) and re-run: the cluster converges again.
    lab.up(3, lab_cluster.lab.lab_id)
    run = lab_cluster.playbook()
    assert run.returncode == 0, json.dumps(run.failures, indent=1)
    assert [n["reachable"] for n in json.loads(layout.read_text())["nodes"]] == [True, True, True]


def test_a_fourth_node_added_to_the_inventory_joins_and_nothing_else_changes(lab_cluster):
    lab.up(4, lab_cluster.lab.lab_id)
    run = lab_cluster.playbook()
    assert run.returncode == 0, json.dumps(run.failures, indent=1)
    assert run.stats["node4"]["changed"] > 0
    for node in ("node1", "node2", "node3"):
        changed = run.changed.get(node, [])
        unexpected = [t for t in changed if not t.startswith(("ssh_mesh : ", "hostfile : "))]
        assert unexpected == [], f"{node} changed more than the mesh and hostfiles: {unexpected}"
        assert any(t.startswith("hostfile : Install") for t in changed), changed
    tb4 = lab_cluster.lab.tb_ip(4)
    for node in (1, 2, 3):
        assert lab_cluster.ssh(node, f"ssh -o BatchMode=yes {tb4} hostname").stdout.strip() \
            == "node4"
        assert f"{tb4} slots=1" in lab_cluster.ssh(node, f"cat {CLUSTER_ROOT}/hostfile").stdout
    probe = lab_cluster.ssh(4, f"ssh -o BatchMode=yes {lab_cluster.lab.tb_ip(1)} hostname")
    assert probe.stdout.strip() == "node1", probe.stderr


def test_a_node_whose_os_does_not_match_its_group_gets_a_clear_message(lab_cluster, tmp_path):
    inventory = yaml.safe_load(lab_cluster.inventory.read_text())
    linux = inventory["cluster"]["children"]["linux"]["hosts"]
    inventory["cluster"]["children"]["macs"]["hosts"] = {"node2": linux.pop("node2")}
    path = tmp_path / "inventory" / "hosts.yml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(inventory))
    (path.parent / "group_vars").symlink_to(lab_cluster.inventory.parent / "group_vars")
    run = lab_cluster.playbook(inventory=path)
    assert run.returncode != 0
    message = " ".join(run.failures.get("node2", []))
    assert "node2 runs Debian" in message and "macs" in message, run.failures
    assert "node1" not in run.failures
