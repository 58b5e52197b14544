"""What stopped a run, and on which node (mlxcluster/check/faults.py): each cause told apart from
launch outputs as mpirun and mlx-cluster-launch print them, and from the node checks."""

from __future__ import annotations

import pytest

from mlxcluster.check import faults
from mlxcluster.check.doctor import Check
from mlxcluster.describe.cluster import Cluster

KILLED_ON_NODE2 = ("iter 3/50 loss 2.1\n"
                   "mpirun noticed that process rank 1 with PID 4242 on node 10.0.0.2 exited on "
                   "signal 9 (Killed).\n")
STALLED = "iter 3/50 loss 2.1\nrank 0: error: no progress for 30 s (allowed 30 s): another rank is gone\n"
TRACEBACK = ("rank 1: error: max_seq_length must be a positive whole number\n"
             "Process name: [[123,1],1]\nExit code: 1\n")


def three() -> Cluster:
    return Cluster.from_json({"launcher": "node1", "nodes": [
        {"name": f"node{i}", "thunderbolt_ip": f"10.0.0.{i}", "slots": 1} for i in (1, 2, 3)]})


def never_asked() -> list[Check]:
    raise AssertionError("the node checks were asked for although the output named the cause")


def diagnose(output: str, code: int | None = 137, *, before=None, after=None, frozen=(), red=never_asked):
    counts = {"node1": 0, "node2": 0, "node3": 0}
    return faults.diagnose(three(), output, code, "data", (before or counts, after or counts), frozen, red)


def test_an_outside_kill_names_the_node_and_lets_the_run_go_on_without_it():
    fault = diagnose(KILLED_ON_NODE2)
    assert (fault.cause, fault.node, fault.goes_on_without_node) == ("killed", "node2", True)
    assert "killed from outside the run, not for memory" in fault.why


def test_an_out_of_memory_kill_is_the_run_s_and_never_restarts():
    fault = diagnose(KILLED_ON_NODE2, after={"node1": 0, "node2": 1, "node3": 0})
    assert (fault.cause, fault.node, fault.goes_on_without_node) == ("out of memory", "node2", False)
    assert "out of memory: the kernel's out-of-memory killer ended a process on node2" in fault.why


def test_a_kill_where_the_count_cannot_be_read_may_be_memory_and_does_not_restart():
    unknown = {"node1": None, "node2": None, "node3": None}
    fault = diagnose(KILLED_ON_NODE2, before=unknown, after=unknown)
    assert fault.node == "node2" and not fault.goes_on_without_node
    assert "most often out of memory" in fault.why


def test_a_frozen_rank_s_node_is_named_and_left_out():
    fault = diagnose(STALLED, 1, frozen=["node3"])
    assert (fault.cause, fault.node, fault.goes_on_without_node) == ("frozen", "node3", True)
    assert "frozen: a rank's process on node3 was stopped" in fault.why


def test_a_stall_with_a_node_s_link_down_names_that_node_as_lost():
    red = [Check("node3", "interface bridge0", False, "down"),
           Check("node1 -> node3", "ssh over the cluster link", False, "10.0.0.3: timed out"),
           Check("node2 -> node3", "ssh over the cluster link", False, "10.0.0.3: timed out"),
           Check("node3 -> node1", "ssh over the cluster link", False, "10.0.0.1: timed out")]
    fault = diagnose(STALLED, 1, red=lambda: red)
    assert (fault.cause, fault.node, fault.goes_on_without_node) == ("lost", "node3", True)
    assert "lost: node3 dropped off the cluster (interface bridge0: down)" in fault.why


def test_a_node_gone_altogether_is_lost_too():
    red = [Check("node2", "management ssh", False, "ssh mlx@node2: No route to host")]
    fault = diagnose("ssh: connect to host 10.0.0.2 port 22: No route to host\n", 255, red=lambda: red)
    assert (fault.cause, fault.node) == ("lost", "node2")


@pytest.mark.parametrize("red", [
    [],  # all green: nobody to blame
    [Check("node2", "interface bridge0", False, "down"),
     Check("node3", "interface bridge0", False, "down")],  # a tie between two nodes
])
def test_a_stall_that_no_single_node_explains_stops_the_run(red):
    fault = diagnose(STALLED, 1, red=lambda: red)
    assert fault.node is None and not fault.goes_on_without_node
    assert "the nodes now: " in fault.why


def test_a_stall_whose_pair_fails_both_ways_while_both_nodes_are_well_is_a_dead_link():
    red = [Check("node1 -> node2", "ssh over the cluster link", False, "x"),
           Check("node2 -> node1", "ssh over the cluster link", False, "x")]
    fault = diagnose(STALLED, 1, red=lambda: red)
    assert (fault.cause, fault.node) == ("dead link", "node2")


def test_a_rank_s_own_error_is_the_run_s_and_asks_no_node():
    fault = diagnose(TRACEBACK, 1)
    assert fault.cause is None and not fault.goes_on_without_node
    assert fault.why.startswith("rank 1 on node2 exited with status 1")


def test_a_rise_in_a_nodes_out_of_memory_kills_names_it_after_a_failed_run():
    # Read as a run reads it: this machine's kernel count (the local node runs the line in bash).
    local = Cluster.from_json({"launcher": "node1", "nodes": [
        {"name": name, "thunderbolt_ip": ip, "slots": 1, "connection": {"type": "local"}}
        for name, ip in (("node1", "10.0.0.1"), ("node2", "10.0.0.2"))]})
    counts = faults.oom_kills(local)
    assert set(counts) == {"node1", "node2"} and all(isinstance(c, int) for c in counts.values())
    assert faults.ran_out_of_memory({"node1": 4, "node2": 7, "node3": None},
                                    {"node1": 5, "node2": 7, "node3": 9}) == ["node1"]


STOPPED = ("iter 6/50 loss 2.0\nmpirun noticed that process rank 1 with PID 4242 on node 10.0.0.2 exited on "
           "signal 9 (Killed).\n")  # the ranks were stopped from the controller


def stuck(*silent: int):
    return faults.Stuck(idle=21.0, bound=20.5, slowest=0.5, step=6, silent=silent)


def diagnose_stuck(red=(), frozen=(), silent=()):
    counts = {"node1": 0, "node2": 0, "node3": 0}
    return faults.diagnose(three(), STOPPED, 137, "data", (counts, counts), frozen, never_asked,
                           (stuck(*silent), list(red)))


def test_a_stuck_run_with_every_rank_alive_and_every_link_green_is_a_hang_that_restarts_everywhere():
    fault = diagnose_stuck()
    assert (fault.cause, fault.node, fault.goes_on_everywhere, fault.goes_on_without_node) == \
        ("hung", None, True, False)
    assert fault.why.startswith("stuck: no rank progressed for 21 s after step 6 (the slowest step so far "
                                "took 0.5 s; allowed 20 s); every rank was stopped on every node; hung:")
    assert "killed by signal" not in fault.why  # the stop's signals are not the cause


def test_a_stuck_run_whose_pair_carries_nothing_names_the_link_and_leaves_out_its_far_end():
    red = [Check("node1 -> node2", "ssh over the cluster link", False, "10.0.0.2: timed out"),
           Check("node2 -> node1", "ssh over the cluster link", False, "10.0.0.1: timed out")]
    fault = diagnose_stuck(red)
    assert (fault.cause, fault.node, fault.goes_on_without_node) == ("dead link", "node2", True)
    assert "dead link: the link between node1 and node2 is up but carries nothing" in fault.why
    # Between two nodes neither of which launches: the later in rank order.
    assert faults.left_out_of_link(three(), ["node3", "node2"]) == "node3"


def test_a_stuck_run_names_a_frozen_node_a_lost_one_or_a_silent_rank_s():
    frozen = diagnose_stuck(frozen=["node3"])
    assert (frozen.cause, frozen.node) == ("frozen", "node3")
    red = [Check("node3", "interface bridge0", False, "down"),
           Check("node1 -> node3", "ssh over the cluster link", False, "timed out")]
    lost = diagnose_stuck(red)
    assert (lost.cause, lost.node) == ("lost", "node3")
    silent = diagnose_stuck(silent=(2,))
    assert (silent.cause, silent.node) == ("lost", "node3")
    assert "rank 2 on node3 stopped answering (its beats stopped)" in silent.why
    assert diagnose_stuck(silent=(1, 2)).node is None  # two nodes: no single one to blame


def test_a_launcher_that_exits_0_is_not_trusted_over_the_ranks_records():
    fault = faults.unrecorded(three(), [1, 2], {0: 0, 1: None, 2: 3})
    assert fault.why == ("the launcher exited 0, but rank 1 on node2 left no exit record; rank 2 on node3 "
                         "ended with code 3: the run did not finish")
    assert fault.node is None


def test_a_node_whose_every_pair_fails_while_its_own_checks_pass_has_a_dead_link():
    # node3's one link to the bridge carries nothing: every pair with it fails, its interface is up.
    red = [Check("node1 -> node3", "ssh over the cluster link", False, "10.0.0.3: timed out"),
           Check("node2 -> node3", "ssh over the cluster link", False, "10.0.0.3: timed out"),
           Check("node3 -> node1", "ssh over the cluster link", False, "10.0.0.1: timed out"),
           Check("node3 -> node2", "ssh over the cluster link", False, "10.0.0.2: timed out")]
    fault = diagnose_stuck(red)
    assert (fault.cause, fault.node, fault.goes_on_without_node) == ("dead link", "node3", True)
    assert "dead link: node3's cluster link is up but carries nothing (4 pairs with it fail" in fault.why
