"""The recorded layout (mlxcluster/describe/record.py): what a full, a partial and a failed run write, and
what the launch code (mlxcluster/describe/cluster.py) makes of it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from filter_plugins import cluster_record as record_plugin
from mlxcluster.describe.cluster import Cluster, NotReady, check_ready
from mlxcluster.describe.record import LEARNED, previous_nodes

REPO = Path(__file__).resolve().parents[4]
ROOT = "/opt/mlx-cluster"
NODES = ("node1", "node2", "node3")
HOSTFILE = "".join(f"10.78.0.1{i} slots=1\n" for i in (1, 2, 3))
MODEL = {"path": f"{ROOT}/models/smollm2", "sha256": "ab" * 32}


def hostvars(**overrides: dict) -> dict[str, dict]:
    """Resolved inventory variables of a 3-node lab, plus the facts a full run's roles set."""
    hv = {}
    for i, name in enumerate(NODES, 1):
        hv[name] = {
            "group_names": ["cluster", "linux"], "thunderbolt_ip": f"10.78.0.1{i}",
            "thunderbolt_interface": "bridge0", "mpi_slots": 1, "cluster_root": ROOT,
            "ansible_host": f"10.77.0.1{i}", "ansible_user": "root",
            "python_env_venv": f"{ROOT}/venv", "python_env_env_path": f"{ROOT}/env.sh",
            "openmpi_prefix": "/usr", "model_installed": MODEL,
            **overrides.get(name, {})}
    return hv


cluster_record = record_plugin.FilterModule().filters()["cluster_record"]
GROUPS = {"cluster": list(NODES), "linux": list(NODES), "launcher": ["node1"]}
FACTS = set(LEARNED.values())


def without_facts(hv: dict[str, dict]) -> dict[str, dict]:
    """The same hosts in a run whose roles set no facts (e.g. --tags hostfile)."""
    return {name: {k: v for k, v in vars_.items() if k not in FACTS} for name, vars_ in hv.items()}


def run(hv: dict, previous: dict | None = None, *, targeted=NODES, answered=None) -> dict:
    """What the record task writes after a run, given the record before it."""
    answered = targeted if answered is None else answered
    return cluster_record(GROUPS, hv, targeted, answered,
                          json.dumps(previous) if previous is not None else None)


@pytest.fixture
def full() -> dict:
    return run(hostvars())


def test_a_full_run_records_every_node_provisioned_with_the_paths_its_roles_set(full):
    assert full["launcher"] == "node1" and [n["name"] for n in full["nodes"]] == list(NODES)
    node = full["nodes"][1]
    assert node["venv"] == f"{ROOT}/venv" and node["env_file"] == f"{ROOT}/env.sh"
    assert node["openmpi_prefix"] == "/usr" and node["model"] == MODEL
    assert node["provisioned"] and node["reachable"] and node["slots"] == 1
    assert node["connection"] == {"type": "ssh", "host": "10.77.0.12", "user": "root",
                                  "port": None, "private_key_file": None, "ssh_common_args": ""}
    check_ready(Cluster.from_json(full), HOSTFILE)
    assert Cluster.from_json(full).nodes[1].model == MODEL


def test_tags_hostfile_alone_keeps_the_paths_it_did_not_learn(full):
    assert run(without_facts(hostvars()), full) == full


def test_a_limited_run_keeps_the_other_nodes_as_they_were(full):
    assert run(hostvars(), full, targeted=["node2"]) == full
    assert run(without_facts(hostvars()), full, targeted=["node2"]) == full


def test_a_limited_run_takes_inventory_changes_of_every_node(full):
    changed = run(without_facts(hostvars(node3={"mpi_slots": 2})), full, targeted=["node1"])
    assert changed["nodes"][2]["slots"] == 2 and changed["nodes"][2]["venv"] == f"{ROOT}/venv"


def test_a_node_down_in_a_full_run_is_marked_unreachable_and_keeps_its_paths(full):
    after = run(hostvars(), full, answered=["node1", "node2"])
    node3 = after["nodes"][2]
    assert not node3["reachable"] and node3["venv"] == f"{ROOT}/venv" and node3["provisioned"]
    with pytest.raises(NotReady, match="node3 could not be reached"):
        check_ready(Cluster.from_json(after), HOSTFILE)
    assert run(hostvars(), after) == full  # back, and re-run


def test_a_first_run_with_only_tags_hostfile_records_nodes_not_provisioned():
    first = run(without_facts(hostvars()))
    assert [n["provisioned"] for n in first["nodes"]] == [False] * 3
    assert all(n[field] is None for n in first["nodes"] for field in LEARNED)
    with pytest.raises(NotReady, match=r"node1, node2, node3 not provisioned yet .*invoke provision"):
        check_ready(Cluster.from_json(first), HOSTFILE)


def test_a_node_never_reached_is_not_provisioned_rather_than_down():
    first = run(hostvars(), targeted=["node1", "node2"])
    assert not first["nodes"][2]["reachable"] and not first["nodes"][2]["provisioned"]
    with pytest.raises(NotReady, match="node3 not provisioned yet"):
        check_ready(Cluster.from_json(first), HOSTFILE)


def test_a_moved_cluster_root_drops_the_paths_recorded_under_the_old_one(full):
    moved = without_facts(hostvars(**{n: {"cluster_root": "/srv/mlx"} for n in NODES}))
    after = run(moved, full)
    assert all(n["cluster_root"] == "/srv/mlx" and n["venv"] is None and not n["provisioned"]
               for n in after["nodes"])
    # The roles run again under the new root: provisioned there.
    again = run(hostvars(**{n: {"cluster_root": "/srv/mlx", "python_env_venv": "/srv/mlx/venv",
                                "python_env_env_path": "/srv/mlx/env.sh"} for n in NODES}), after)
    assert all(n["provisioned"] and n["venv"] == "/srv/mlx/venv" for n in again["nodes"])


def test_facts_a_run_did_learn_replace_the_recorded_ones(full):
    other = {"path": f"{ROOT}/models/other", "sha256": "cd" * 32}
    after = run(hostvars(node2={"model_installed": other}), full)
    assert [n["model"] for n in after["nodes"]] == [MODEL, other, MODEL]


def test_the_record_follows_the_inventory_nodes_and_launcher(full):
    groups = {"cluster": ["node1", "node2"], "launcher": ["node2"]}
    hv = hostvars()
    after = cluster_record(groups, hv, ["node1", "node2"], ["node1", "node2"], json.dumps(full))
    assert after["launcher"] == "node2" and [n["name"] for n in after["nodes"]] == ["node2", "node1"]


@pytest.mark.parametrize("text", [None, "", "{not json", "[]", '{"nodes": 3}', '{"nodes": [1, {}]}'])
def test_a_missing_or_unreadable_previous_record_counts_as_none(text):
    assert previous_nodes(text) == {}
    first = cluster_record(GROUPS, without_facts(hostvars()), NODES, NODES, text)
    assert not any(n["provisioned"] for n in first["nodes"])


def test_records_without_the_newer_fields_still_load(full):
    for node in full["nodes"]:
        del node["model"], node["provisioned"]
    cluster = Cluster.from_json(full)
    assert cluster.head.model is None and cluster.head.provisioned


def test_a_node_s_model_dequantize_is_recorded_and_read_back(full):
    after = run(hostvars(node3={"model_dequantize": True}, node2={"model_dequantize": "false"}), full)
    assert [n["model_dequantize"] for n in after["nodes"]] == [False, False, True]
    cluster = Cluster.from_json(json.loads(json.dumps(after)))
    assert [n.model_dequantize for n in cluster.nodes] == [False, False, True]
    for node in after["nodes"]:  # a record from before model_dequantize: none dequantizes
        del node["model_dequantize"]
    assert not any(n.model_dequantize for n in Cluster.from_json(after).nodes)


# --- through ansible-playbook: the record task on two local "nodes" -----------------------------


def record_play(tmp_path: Path, tool_env: dict, *args: str, learn: bool = True):
    """The hostfile role's record task after a play that sets the roles' facts (or not)."""
    hosts = {f"node{i}": {"ansible_connection": "local", "thunderbolt_ip": f"10.78.9.1{i}",
                          "ansible_python_interpreter": "{{ ansible_playbook_python }}"}
             for i in (1, 2)}
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({
        "cluster": {"hosts": hosts, "vars": {"cluster_root": str(tmp_path / "root")}},
        "launcher": {"hosts": {"node1": None}}}))
    facts = {"python_env_venv": "{{ cluster_root }}/venv", "openmpi_prefix": "/usr",
             "python_env_env_path": "{{ cluster_root }}/env.sh",
             "model_installed": {"path": "{{ cluster_root }}/models/m", "sha256": "ab" * 32}}
    playbook = tmp_path / "record.yml"
    playbook.write_text(yaml.safe_dump([{
        "name": "Record", "hosts": "cluster", "gather_facts": False,
        "tasks": [
            {"name": "Set what the roles would", "ansible.builtin.set_fact": facts,
             "when": learn},
            {"name": "Record the layout", "ansible.builtin.include_role": {
                "name": "hostfile", "tasks_from": "record"}}]}]))
    proc = subprocess.run(["ansible-playbook", "-i", str(inventory), str(playbook),
                           "-e", f"hostfile_build_dir={tmp_path}", *args],
                          cwd=REPO, env={**tool_env, "ANSIBLE_CACHE_PLUGIN": "memory"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return proc.stdout


def test_the_record_task_merges_partial_runs_and_check_mode_writes_nothing(tmp_path, tool_env):
    layout = tmp_path / "cluster.json"
    record_play(tmp_path, tool_env, "--check")
    assert not layout.exists()
    record_play(tmp_path, tool_env)
    full = json.loads(layout.read_text())
    assert [(n["name"], n["provisioned"], n["model"]["path"]) for n in full["nodes"]] == [
        (f"node{i}", True, f"{tmp_path}/root/models/m") for i in (1, 2)]
    # Limited, and like --tags hostfile (no role set a fact): the record stays as it was.
    assert "changed=0" in record_play(tmp_path, tool_env, "--limit", "node2", learn=False)
    assert json.loads(layout.read_text()) == full
    record_play(tmp_path, tool_env, "-e", f"cluster_root={tmp_path}/moved", "--check",
                learn=False)
    assert json.loads(layout.read_text()) == full
