"""A run going on without a node (mlxcluster/jobs/restarts.py, mlxcluster/describe/drained.py):
the layout of the nodes left, the record of the node left out, and when a run restarts."""

from __future__ import annotations

import json

import pytest

from mlxcluster.check import doctor
from mlxcluster.check.doctor import Check
from mlxcluster.describe import drained
from mlxcluster.describe.cluster import Cluster, NotReady
from mlxcluster.errors import UserError
from mlxcluster.jobs.restarts import Policy
from mlxcluster.launch import builder, runs


def four(**extra) -> Cluster:
    return Cluster.from_json({"launcher": "node1", "backend": {"name": "mpi", "why": "a bridge"}, "nodes": [
        {"name": f"node{i}", "thunderbolt_ip": f"10.0.0.{i}", "slots": 1, "cluster_root": "/opt/c",
         "venv": "/opt/c/venv", "env_file": "/opt/c/env.sh", "openmpi_prefix": "/usr",
         "connection": {"type": "ssh", "host": f"node{i}.mgmt", "user": "mlx"}, **extra}
        for i in (1, 2, 3, 4)]})


def test_the_nodes_left_are_a_layout_of_their_own_that_reaches_no_node_left_out():
    left = four().without({"node3"})
    assert [n.name for n in left.nodes] == ["node1", "node2", "node4"]
    assert (left.launcher, left.world_size, left.provisioned) == ("node1", 3, False)
    assert four().without(set()) == four()


def test_when_the_launcher_is_left_out_the_first_node_left_launches():
    left = four().without({"node1", "node2"})
    assert left.launcher == "node3" and left.head.name == "node3"
    with pytest.raises(NotReady, match="no node that trains is left"):
        four().without({"node1", "node2", "node3", "node4"})


def test_mpirun_on_the_nodes_left_gets_their_own_hostfile_not_the_provisioned_one():
    left = four().without({"node2"})
    line = builder.command(left, builder.Job(["python", "-m", "training.finetune"]))[-1]
    # Written before mpirun starts, into the work directory, the launcher first.
    assert line.startswith("printf '%s\\n' '10.0.0.1 slots=1\n10.0.0.3 slots=1\n10.0.0.4 slots=1' > "
                           "/opt/c/work/layout-hostfile && ")
    assert "--hostfile /opt/c/work/layout-hostfile -np 3" in line
    # The whole cluster, as provisioned, keeps the hostfile provisioning rendered.
    assert "--hostfile /opt/c/hostfile -np 4" in builder.command(four(), builder.Job(["x"]))[-1]


def test_a_node_left_out_is_recorded_replaced_and_lets_back_in(tmp_path):
    assert drained.read(tmp_path) == {}
    first = drained.Drained.now("node3", "frozen", "frozen: ...", "20261126-100000", 20)
    drained.add(tmp_path, first)
    drained.add(tmp_path, drained.Drained.now("node2", "lost", "lost: ...", "20261126-100000", 40))
    again = drained.Drained.now("node3", "killed", "killed ...", "20261126-110000", 60)
    drained.add(tmp_path, again)
    found = drained.read(tmp_path)
    assert sorted(found) == ["node2", "node3"] and found["node3"] == again
    assert again.line.startswith("node3 left out since ") and again.line.endswith(
        "by run 20261126-110000 (killed)")
    assert drained.rejoin(tmp_path, {"node3", "node9"}) == [again]
    assert sorted(drained.read(tmp_path)) == ["node2"]
    drained.rejoin(tmp_path, {"node2"})
    assert not (tmp_path / drained.FILE).exists()  # nothing left out: no file


def test_an_unreadable_record_counts_as_none_and_says_so(tmp_path, capsys):
    (tmp_path / drained.FILE).write_text("[{\"node\": ")
    assert drained.read(tmp_path) == {}
    assert "cannot be read" in capsys.readouterr().out


def test_doctor_shows_a_node_left_out_red_until_its_checks_pass():
    entry = drained.Drained.now("node2", "lost", "lost: ...", "20261126-100000", 20)
    red = [Check("node1 -> node2", "ssh over the cluster link", False, "timed out")]
    [row] = doctor.left_out([entry], red)
    assert (row.scope, row.name, row.ok) == ("node2", "left out of training", False)
    assert "by run 20261126-100000 (lost); 1 of its checks fail" in row.detail
    [row] = doctor.left_out([entry], [Check("node2", "venv", True, "/opt/c/venv")])
    assert row.ok and "the next invoke train lets it back in" in row.detail


@pytest.mark.parametrize(("policy", "restarts", "left", "refusal"), [
    (Policy(), 0, 3, ""),
    (Policy(), 2, 1, ""),
    (Policy(), 3, 3, "it was restarted 3 times already (--max-restarts 3)"),
    (Policy(max_restarts=0), 0, 3, "restarts are off (--max-restarts 0)"),
    (Policy(min_nodes=3), 0, 2, "2 nodes would be left, fewer than --min-nodes 3"),
    (Policy(min_nodes=2), 0, 0, "0 nodes would be left, fewer than --min-nodes 2"),
])
def test_a_run_restarts_within_its_bounds(policy, restarts, left, refusal):
    layout = four().without({f"node{i}" for i in range(left + 1, 5)}) if left else None
    assert policy.refusal(restarts, layout) == refusal


def test_bounds_that_make_no_sense_are_refused():
    with pytest.raises(UserError, match="--min-nodes must be 1 or more"):
        Policy(min_nodes=0)
    with pytest.raises(UserError, match=r"--min-nodes 4, but 3 nodes can train now \(1 left out"):
        Policy(min_nodes=4).check_start(four().without({"node2"}), four())
    with pytest.raises(UserError, match=r"--min-nodes 5, but 4 nodes can train$"):
        Policy(min_nodes=5).check_start(four(), four())


def test_the_run_record_keeps_the_nodes_it_went_on_without(tmp_path, monkeypatch):
    from mlxcluster.jobs import restarts

    monkeypatch.setattr(runs, "RUNS", tmp_path / "runs")
    run = tmp_path / "runs" / "20261126-100000"
    (run / "checkpoints" / "0000020").mkdir(parents=True)
    runs.write_info(run, {"status": "failed"})
    rec = type("Rec", (), {"build": tmp_path / "build"})()
    entry = restarts.left_out(rec, run.name, "node2", "killed", "killed from outside")
    assert json.loads((run / "run.json").read_text())["drained"] == [
        {"node": "node2", "cause": "killed", "why": "killed from outside", "run": run.name,
         "at": entry.at, "step": None}]  # an empty checkpoint folder is no checkpoint
    assert drained.read(tmp_path / "build") == {"node2": entry}


def test_a_ring_of_cables_less_one_node_is_no_ring_and_says_so():
    """A ring of four Macs less node3 is a line: no backend of the links can run on it, which a
    restart says instead of going on (a full mesh less one node is still one)."""
    from tests.unit.mlxcluster.describe.test_links_layout import ring_of_four

    ring = ring_of_four()
    left = ring.without({"node3"})
    assert [n.name for n in left.nodes] == ["node1", "node2", "node4"]
    assert all("node3" not in json.dumps(cable) for cable in left.cables)
    with pytest.raises(UserError, match="the cables make no ring through the nodes that train"):
        builder.choice_for(left, None)
