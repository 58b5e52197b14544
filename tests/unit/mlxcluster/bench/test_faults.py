"""invoke bench.faults' figures, read from the output of a run that went through a fault (the
benchmark itself runs on a lab: `invoke bench.faults`)."""

from __future__ import annotations

import pytest

from mlxcluster.bench import faults
from mlxcluster.errors import UserError

OUTPUT = [
    (1.0, "iter 14/40  loss 2.10  lr 1.00e-03"),
    (2.0, "iter 15/40  loss 2.00  lr 1.00e-03"),
    # the fault, at 2.5
    (4.0, "mpirun noticed that process rank 2 with PID 9 on node 10.0.0.3 exited on signal 9 (Killed)."),
    (5.0, "==> node3 is left out (killed); restarting run 20261126-150853 from its checkpoint at step 10"),
    (16.0, "resuming from /opt/c/runs/20261126-150853/checkpoints/0000010 (step 10 of 40)"),
    (16.5, "iter 10/40  val_loss 4.131  (0.3 s)"),
    (17.3, "iter 11/40  loss 2.60  lr 1.00e-03"),
]


def test_the_time_to_training_again_and_the_steps_lost_come_from_the_output():
    found = faults.measured(faults.Timeline(list(OUTPUT)), fault_at=2.5)
    assert found == {"last_step_before_fault": 15, "resumed": True, "resumed_from_step": 10,
                     "steps_lost": 5, "steps_saved_after_fault": 0,
                     "fault_to_stuck_s": None, "fault_to_resumed_s": 13.5, "fault_to_training_s": 14.8}


def test_a_hang_s_time_to_being_called_stuck_comes_from_the_controller_s_line():
    stuck = [*OUTPUT[:2], (24.0, "==> stuck: no rank progressed for 21 s after step 15 (...)"), *OUTPUT[4:]]
    assert faults.measured(faults.Timeline(stuck), fault_at=2.5)["fault_to_stuck_s"] == 21.5


def test_ranks_that_saved_after_a_killed_controller_lost_nothing():
    resumed = [(30.0, "resuming from /x/checkpoints/0000020 (step 20 of 40)"), (31.0, "iter 21/40  loss 2.0")]
    found = faults.measured(faults.Timeline([*OUTPUT[:2], *resumed]), fault_at=2.5, lost_from=15)
    assert (found["steps_lost"], found["steps_saved_after_fault"]) == (0, 5)


def test_a_run_that_never_resumed_says_so():
    assert faults.measured(faults.Timeline(list(OUTPUT[:3])), fault_at=2.5) == {
        "last_step_before_fault": 15, "resumed": False}


def test_the_verdict_names_each_fault_not_gone_through():
    result = {"faults": [
        {"fault": "kill", "finished": True, "resumed": True, "first_step_loss_difference": 2e-6},
        {"fault": "freeze", "finished": False, "output": "training failed"},
        {"fault": "unplug", "finished": True, "resumed": True, "first_step_loss_difference": 0.5},
        {"fault": "controller", "finished": True, "resumed": True, "first_step_loss_difference": 0.0,
         "nodes_stopped": False, "ranks_still_running": {"node2": 1}}]}
    assert faults.verdict(result) == [
        "freeze: the run did not finish: training failed",
        "unplug: the first step after the resume has a loss 0.5 from the uninterrupted run's "
        "(allowed 0.0001): not the same training",
        "controller: ranks ran on after invoke train was killed: {'node2': 1}"]


def test_the_restarted_run_is_held_to_the_uninterrupted_one_at_the_first_step_it_trains(tmp_path):
    for name, losses in (("reference", {10: 4.18, 11: 4.1963958, 40: 4.153}),
                         ("restarted", {10: 4.18, 11: 4.1963939, 40: 4.172})):
        (tmp_path / name).mkdir()
        lines = [f'{{"iteration": {i}, "train_loss": {loss}}}' for i, loss in losses.items()]
        lines.append('{"iteration": 0, "val_loss": 6.2}')
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(lines))
    found = faults.against_reference(tmp_path / "restarted", tmp_path / "reference", 10)
    assert found["first_step_after_resume"] == 11
    assert found["first_step_loss_difference"] == pytest.approx(1.9e-6, abs=1e-8)
    assert (found["final_train_loss"], found["final_train_loss_uninterrupted"]) == (4.172, 4.153)
    assert found["max_adapter_difference"] is None  # no adapters written here


@pytest.mark.parametrize(("args", "message"), [
    ({"nodes": 1}, "at least 2 nodes"),
    ({"faults": ["kill", "fire"]}, "fire unknown"),
    ({"iters": 16}, "give at least 18"),
    ({"parallel": "pipe"}, "--parallel must be data, tensor or pipeline"),
    ({"parallel": "pipeline"}, "a pipeline run's restarts are not measured yet"),
    ({"nodes": 4, "shares": [3, 1]}, "one weight per node"),
    ({"nodes": 2, "shares": [3, 1], "parallel": "tensor"}, "data parallelism only"),
])
def test_a_benchmark_that_cannot_be_run_is_refused_before_any_lab(args, message):
    with pytest.raises(UserError, match=message):
        faults.run(**args)


def test_mixed_macs_are_the_lab_inventory_s_nodes_with_batch_share_weights(tmp_path):
    import yaml

    inventory = tmp_path / "hosts.yml"  # the shape of mlxcluster/lab/hosts.py's write_inventory
    inventory.write_text(yaml.safe_dump({"cluster": {"children": {"linux": {"hosts": {
        f"node{i}": {"ansible_host": f"10.0.0.{i}", "mpi_slots": 1} for i in (1, 2, 10)}}}}}))
    faults.with_shares(inventory, [3, 1, 2])
    nodes = yaml.safe_load(inventory.read_text())["cluster"]["children"]["linux"]["hosts"]
    shares = {name: host["batch_share"] for name, host in nodes.items()}
    assert shares == {"node1": 3, "node2": 1, "node10": 2}
    assert nodes["node10"]["mpi_slots"] == 1
