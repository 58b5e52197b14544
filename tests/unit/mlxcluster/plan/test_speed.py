"""A step's time under a layout (mlxcluster/plan/speed.py), from the calibration's pace per node (a
fixed part a pass, then tokens/s) and bench.links' slowest pair: the slowest share sets a data step,
a ring all-reduce moves 2 (N-1)/N of its bytes, tensor parallelism splits the compute and sums
activations per layer, a pipeline's bubble is (stages - 1) slots of its slowest stage."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from mlxcluster.plan import ranks, speed
from mlxcluster.plan.ranks import Layout
from mlxcluster.plan.speed import Measures, Pace
from tests.unit.mlxcluster.launch.test_stages import layout as cluster_of
from tests.unit.mlxcluster.plan.test_ranks import JOB

TWO = {"node1": 1, "node2": 1}
FAST_AND_SLOW = Measures({"node1": 3000.0, "node2": 1000.0})
JOB_MEAN = replace(JOB, mean_length=400)  # 8 rows of 400 tokens on average, 512 at most


def seconds(layout: Layout, measures: Measures, slots=TWO, job=JOB_MEAN) -> float | None:
    cluster = cluster_of(slots)
    return speed.step_seconds(job, layout, cluster, ranks.peaks(job, layout, cluster.world_size), measures)


def test_a_rank_has_its_node_s_speed_shared_with_its_node_s_other_ranks_and_pays_its_own_fixed_part():
    measures = Measures({"node1": 3000.0, "node2": 1000.0}, overheads={"node1": 0.25})
    assert measures.rank_paces(cluster_of({"node1": 2, "node2": 1}), JOB) == [
        Pace(1500.0, 0.25), Pace(1500.0, 0.25), Pace(1000.0, 0.0)]
    assert Measures({"node1": 3000.0}).rank_paces(cluster_of(TWO), JOB) is None
    assert seconds(Layout("data"), Measures({"node1": 3000.0})) is None


def test_a_node_s_pace_is_the_line_through_its_two_calibrated_steps():
    # 1 row of 100 tokens in 1.5 s, 2 rows in 2.5 s: 0.5 s a step at any size, then 100 tokens/s.
    assert speed.fitted((100.0, 1.5), (200.0, 2.5)) == Pace(pytest.approx(100.0), pytest.approx(0.5))
    assert speed.fitted((200.0, 2.5), (100.0, 1.5)) == Pace(pytest.approx(100.0), pytest.approx(0.5))
    assert Pace(100.0, 0.5).seconds(300.0) == pytest.approx(3.5)
    assert Pace(100.0, 0.5).seconds(300.0, part=0.5) == pytest.approx(1.75)
    # Noise: the larger step no slower, or slower than its share (a fixed part below zero): no fixed
    # part, both steps' mean pace.
    assert speed.fitted((100.0, 2.0), (200.0, 1.9)) == Pace(pytest.approx(300 / 3.9), 0.0)
    assert speed.fitted((100.0, 1.0), (200.0, 3.0)) == Pace(pytest.approx(75.0), 0.0)


def test_the_fixed_part_is_paid_in_full_by_a_data_share_a_tensor_shard_and_each_pipeline_micro_batch():
    fixed = replace(FAST_AND_SLOW, overheads={"node1": 0.5, "node2": 0.5})
    assert seconds(Layout("data"), fixed) == pytest.approx(0.5 + 1.6)
    assert seconds(Layout("tensor"), fixed) == pytest.approx(0.5 + 8 * 400 / (2 * 1000))
    even = Measures({"node1": 1000.0, "node2": 1000.0}, overheads={"node1": 0.5, "node2": 0.5})
    # 4 micro-batches of 2 rows: each pass of the first stage's half of the layers pays half the fixed part.
    slot = 0.5 * (0.5 + 2 * 400 / 1000) * speed.RECOMPUTE
    assert seconds(Layout("pipeline", stages=(4, 4), micro_batches=4), even) == pytest.approx((4 + 1) * slot)
    # With grad checkpointing against a calibration without, the fixed part is recomputed too.
    recomputing = replace(JOB_MEAN, grad_checkpoint=True)
    assert seconds(Layout("data"), fixed, job=recomputing) == pytest.approx((0.5 + 1.6) * speed.RECOMPUTE)


def test_a_data_step_is_its_slowest_share_then_the_gradients_all_reduce():
    # 4 and 4 rows of 400 tokens: the slow node's 1600 tokens at 1000 tok/s.
    assert seconds(Layout("data"), FAST_AND_SLOW) == pytest.approx(1.6)
    # Shares as the speeds (6 and 2): both ranks take 0.8 s.
    assert seconds(Layout("data", (6, 2)), FAST_AND_SLOW) == pytest.approx(0.8)
    linked = replace(FAST_AND_SLOW, bandwidth=1e9, latency=1e-3)
    gradients = max(t.gradients + t.trainable for t in ranks.peaks(JOB_MEAN, Layout("data"), 2))
    assert speed.all_reduce(gradients, 2, linked) == pytest.approx(gradients / 1e9 + 2e-3)
    assert seconds(Layout("data"), linked) == pytest.approx(1.6 + gradients / 1e9 + 2e-3)


def test_tensor_parallelism_splits_the_compute_and_sums_the_hidden_state_four_times_a_layer():
    linked = replace(FAST_AND_SLOW, bandwidth=1e9, latency=0.0)
    compute = 8 * 400 / (2 * 1000)  # the whole batch, half on each, the slow one setting the pace
    hidden = 8 * 512 * JOB.shape.hidden * JOB.itemsize
    assert seconds(Layout("tensor"), linked) == pytest.approx(compute + 4 * JOB.shape.layers * hidden / 1e9)


def test_a_pipeline_step_is_its_slots_of_the_slowest_stage_and_more_micro_batches_shrink_the_bubble():
    even = Measures({"node1": 1000.0, "node2": 1000.0})
    # Stages of 4 layers each, 4 micro-batches of 2 rows: a slot is the first stage's 2 x 400 tokens
    # over half the layers, with its forward recomputed.
    slot = 2 * 400 * 0.5 / 1000 * speed.RECOMPUTE
    assert seconds(Layout("pipeline", stages=(4, 4), micro_batches=4), even) == pytest.approx((4 + 1) * slot)
    one = seconds(Layout("pipeline", stages=(4, 4), micro_batches=1), even)
    eight = seconds(Layout("pipeline", stages=(4, 4), micro_batches=8), even)
    assert one is not None and eight is not None and eight < one


def test_the_measures_are_the_calibration_s_speeds_and_the_newest_links_of_this_inventory(tmp_path: Path):
    calibration = {"date": "2026-11-29 05:00", "nodes": {"node1": {"tokens_per_second": 900.0},
                                                         "node2": {"tokens_per_second": 300.0}}}
    assert speed.measured(cluster_of(TWO), None, tmp_path) is None
    alone = speed.measured(cluster_of(TWO), calibration, tmp_path, "inv.yml")
    assert alone is not None and alone.speeds == {"node1": 900.0, "node2": 300.0} and alone.bandwidth is None
    assert not alone.grad_checkpoint and alone.overheads == {"node1": 0.0, "node2": 0.0}
    node = {"tokens_per_second": 900.0, "marginal_tokens_per_second": 1200.0, "overhead_seconds": 0.3}
    two_sizes = {**calibration, "nodes": {"node1": node}}
    lined = speed.measured(cluster_of(TWO), two_sizes, tmp_path, "inv.yml")
    assert lined is not None and lined.speeds == {"node1": 1200.0} and lined.overheads == {"node1": 0.3}
    checkpointed = speed.measured(cluster_of(TWO), {**calibration, "grad_checkpoint": True}, tmp_path,
                                  "inv.yml")
    assert checkpointed is not None and checkpointed.grad_checkpoint

    def links(name: str, inventory: str, bandwidth: float) -> None:
        pairs = [{"src": 0, "dst": 1, "latency_us": 50.0, "bandwidth_gb_per_s": bandwidth},
                 {"src": 1, "dst": 0, "latency_us": 80.0, "bandwidth_gb_per_s": 2 * bandwidth}]
        (tmp_path / name).write_text(json.dumps({"inventory": inventory, "date": name,
                                                 "backends": {"mpi": {"pairs": pairs}}}))

    links("links-20261128-100000.json", "inv.yml", 1.0)
    links("links-20261129-100000.json", "inv.yml", 2.5)
    links("links-20261129-110000.json", "other.yml", 9.0)
    found = speed.measured(cluster_of(TWO), calibration, tmp_path, "inv.yml")
    assert found is not None and found.bandwidth == 2.5e9 and found.latency == pytest.approx(80e-6)
    assert "bench.links of links-20261129-100000.json" in found.source


def test_a_run_with_grad_checkpointing_is_paced_by_its_recomputation_against_a_calibration_without():
    measured = seconds(Layout("data"), FAST_AND_SLOW)
    assert measured is not None
    recomputing = replace(JOB_MEAN, grad_checkpoint=True)
    paced = seconds(Layout("data"), FAST_AND_SLOW, job=recomputing)
    assert paced == pytest.approx(measured * speed.RECOMPUTE)
    checkpointed = replace(FAST_AND_SLOW, grad_checkpoint=True)
    assert seconds(Layout("data"), checkpointed, job=recomputing) == pytest.approx(measured)
    assert seconds(Layout("data"), checkpointed) == pytest.approx(measured / speed.RECOMPUTE)
