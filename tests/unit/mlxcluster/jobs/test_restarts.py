"""A run going on without a node (mlxcluster/jobs/restarts.py, mlxcluster/describe/drained.py):
the layout of the nodes left, the record of the node left out, and when a run restarts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxcluster.check import doctor
from mlxcluster.check.doctor import Check
from mlxcluster.check.faults import FROZEN, HUNG, KILLED, Fault, TrainFailed
from mlxcluster.describe import drained
from mlxcluster.describe.cluster import Cluster, NotReady
from mlxcluster.errors import UserError
from mlxcluster.jobs import restarts
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
    (Policy(min_nodes=2), 0, 1, "1 node would be left, fewer than --min-nodes 2"),
])
def test_a_run_restarts_within_its_bounds(policy, restarts, left, refusal):
    layout = four().without({f"node{i}" for i in range(left + 1, 5)})
    assert policy.refusal(restarts, layout) == refusal


class Run:
    """A plan as run_with_restarts sees it: the layout it runs on."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster


def failing(*faults: Fault | None):
    """An execute that fails with each fault in turn, then finishes: the layouts it was given."""
    given, pending = [], list(faults)

    def execute(run: Run) -> Path:
        given.append([n.name for n in run.cluster.training_nodes])
        if pending:
            fault = pending.pop(0)
            raise TrainFailed("training failed (exit 137): " + (fault.why if fault else "a traceback"),
                              137, fault, after="; what arrived is in runs/x")
        return Path("runs/x")
    return execute, given


def test_go_on_restarts_without_each_node_that_fails_until_the_run_ends():
    execute, given = failing(Fault("killed", KILLED, "node3"), Fault("frozen", FROZEN, "node1"))
    said = []

    def again(current, left, fault, restart):
        said.append((fault.node, restart))
        return Run(left)

    assert restarts.run_with_restarts(Run(four()), execute, Policy(), again) == Path("runs/x")
    assert given == [["node1", "node2", "node3", "node4"], ["node1", "node2", "node4"], ["node2", "node4"]]
    assert said == [("node3", 1), ("node1", 2)]


def test_go_on_stops_with_the_reason_said_after_the_failure():
    # The run's own failure (no node to blame) is raised as it is.
    execute, _ = failing(Fault("rank 0: error: bad data"))
    with pytest.raises(TrainFailed, match=r"bad data; what arrived is in runs/x$"):
        restarts.run_with_restarts(Run(four()), execute, Policy(), lambda *_: pytest.fail("restarted"))
    # Past a bound, and where the plan for the nodes left cannot be made.
    execute, _ = failing(Fault("killed", KILLED, "node3"))
    with pytest.raises(TrainFailed, match=r"killed; not restarted without node3: restarts are off "
                                          r"\(--max-restarts 0\); what arrived is in runs/x$"):
        restarts.run_with_restarts(Run(four()), execute, Policy(max_restarts=0),
                                   lambda *_: pytest.fail("restarted"))

    def cannot(*_):
        raise UserError("the model's 9 heads do not divide among 3 ranks")

    execute, _ = failing(Fault("killed", KILLED, "node3"))
    with pytest.raises(TrainFailed, match="not restarted without node3: the model's 9 heads do not divide"):
        restarts.run_with_restarts(Run(four()), execute, Policy(), cannot)


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


def test_a_ring_of_cables_less_one_node_closes_over_the_management_network():
    """A ring of four Macs less node3 is a line of cables node4 - node1 - node2: MLX's ring runs
    over them and closes between node2 and node4 over the management network, one connection each
    way as on the cables; rank 0 stays the launcher, the ranks in the order the nodes are listed.
    The inventory's own cabling gets no such way round (its check asks for the missing cable)."""
    from tests.unit.mlxcluster.describe.test_links_layout import ring_of_four

    ring = ring_of_four()
    left = ring.without({"node3"})
    assert [n.name for n in left.nodes] == ["node1", "node2", "node4"] and left.left_out == {"node3"}
    assert all("node3" not in json.dumps(cable) for cable in left.cables)
    choice = builder.choice_for(left, None)
    assert choice.backend == "ring"
    assert "closes it over the management network between node2 and node4" in choice.why
    hosts = builder.ring_hosts(left)["hosts"]
    # Ring order node1 -> node2 -> node4 -> node1; each rank listens where its left neighbour
    # reaches it: node1 on its cable to node4, node2 on its cable to node1, node4 (whose left
    # neighbour node2 has no cable to it) on its management address.
    assert [(h["ssh"], h["ips"]) for h in hosts] == [
        ("10.78.5.1", ["10.78.5.14"]), ("10.78.5.2", ["10.78.5.2"]), ("10.78.5.13", ["10.77.5.14"])]
    # Two nodes left of four with no cable between them have no cluster link at all; one node
    # left trains alone.
    with pytest.raises(NotReady, match=r"no cable joins the nodes left without node2, node4 \(node1, node3"):
        ring.without({"node2", "node4"})
    assert builder.choice_for(ring.without({"node2", "node3", "node4"}), None).backend == "direct"
    # The cluster as provisioned keeps refusing what its cabling cannot run.
    assert builder.choice_for(ring, None).backend == "ring"


def test_a_full_mesh_less_one_node_keeps_jaccl_and_a_jaccl_ring_less_one_falls_back_to_tcp():
    from mlxcluster.describe import backends, topology

    hosts = ["a", "b", "c", "d"]
    pool = topology.DEFAULT_POOL

    def cabled(pairs):
        links, errors = topology.cables([[f"{x}:en{i}", f"{y}:en{i}"] for i, (x, y) in enumerate(pairs)],
                                        pool, hosts)
        assert not errors
        return links

    mesh = cabled([(x, y) for i, x in enumerate(hosts) for y in hosts[i + 1:]])
    ring = cabled([("a", "b"), ("b", "c"), ("c", "d"), ("d", "a")])
    rdma = {h: [f"rdma_en{i}" for i in range(6)] for h in hosts}
    mesh_left = backends.choose("links", ["a", "b", "d"], mesh, rdma, close_over_management=True)
    assert mesh_left.backend == "jaccl"
    line = backends.choose("links", ["a", "b", "d"], ring, rdma, close_over_management=True)
    assert line.backend == "ring" and "between b and d" in line.why
    with pytest.raises(ValueError, match="no ring"):
        backends.choose("links", ["a", "b", "d"], ring, rdma)
    # A node left out of a ring of three leaves two joined by their cable: a ring of two.
    assert backends.choose("links", ["a", "b"], ring, rdma, close_over_management=True).backend == "jaccl"


def test_a_ring_of_eight_less_two_nodes_apart_closes_both_gaps_and_no_more():
    from mlxcluster.describe import topology

    hosts = [f"n{i}" for i in range(1, 9)]
    pairs = zip(hosts, hosts[1:] + hosts[:1], strict=True)
    links, errors = topology.cables([[f"{a}:en1", f"{b}:en2"] for a, b in pairs], topology.DEFAULT_POOL,
                                    hosts)
    assert not errors
    left = [h for h in hosts if h not in ("n3", "n6")]
    order = topology.ring_over_gaps(left, links)
    assert order is not None and order[0] == "n1" and sorted(order) == sorted(left)
    assert len(topology.gaps_of(order, links)) == 2
    hostfile = topology.mlx_hostfile("ring", left, links, {h: h for h in left},
                                     management={h: f"{h}.mgmt" for h in left})
    over_management = [h["ssh"] for h in hostfile["hosts"] if h["ips"][0].endswith(".mgmt")]
    assert len(over_management) == 2 and all(len(h["ips"]) == 1 for h in hostfile["hosts"])
    # Without the management addresses (the cabling as provisioned) a broken ring is refused.
    with pytest.raises(ValueError, match="needs the cables to make a ring"):
        topology.mlx_hostfile("ring", left, links, {h: h for h in left})


def test_a_hang_restarts_the_run_on_the_same_nodes_within_the_bounds():
    hung = Fault("stuck: ...; hung: a collective that never completed", HUNG)
    execute, given = failing(hung)
    said = []

    def again(current, left, fault, restart):
        said.append((fault.cause, restart))
        return Run(left)

    assert restarts.run_with_restarts(Run(four()), execute, Policy(), again) == Path("runs/x")
    assert given == [["node1", "node2", "node3", "node4"]] * 2 and said == [("hung", 1)]
    execute, _ = failing(hung)
    with pytest.raises(TrainFailed, match=r"not restarted again: restarts are off"):
        restarts.run_with_restarts(Run(four()), execute, Policy(max_restarts=0), lambda *_: pytest.fail("x"))
