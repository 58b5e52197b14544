"""The plan of a run as it launches (mlxcluster/plan/of_run.py): its layout from its settings and
the controller's shares and stages, and summary.json's `ranks` beside what each rank measured."""

from __future__ import annotations

from mlxcluster.launch import settings
from mlxcluster.plan import of_run
from mlxcluster.plan.ranks import Layout
from tests.unit.mlxcluster.launch.test_stages import layout as cluster_of


def test_a_run_s_layout_is_its_settings_with_the_controller_s_shares_and_stages():
    data = settings.read(None, ["--batch-size", "8"])
    assert of_run.layout_of(data, 2, (6, 2), (0, 0), None) == Layout("data", (6, 2), (0, 0))
    tensor = settings.read(None, ["--parallel", "tensor"])
    assert of_run.layout_of(tensor, 2, None, None, None) == Layout("tensor")
    pipeline = settings.read(None, ["--parallel", "pipeline", "--pipeline-stages", "2", "--batch-size", "8"])
    assert of_run.layout_of(pipeline, 4, None, None, (10, 20)) == Layout(
        "pipeline", (4, 4), stages=(10, 20), micro_batches=4)


def test_summary_ranks_hold_each_rank_s_planned_and_measured_peak():
    cluster = cluster_of({"node1": 2, "node2": 1})
    summary = {"peak_memory_gb_per_rank": [1.5, 1.25, 2.0], "iterations": 12, "resumed_from_step": 2,
               "train_time": 25.0}
    planned = of_run.Planned((1_600_000_000, 1_300_000_000, 2_100_000_000), 2.25)
    ranks = of_run.ranks_record(cluster, planned, summary)
    assert ranks[0] == {"rank": 0, "node": "node1", "planned_peak_bytes": 1_600_000_000,
                        "peak_bytes": 1_500_000_000, "planned_step_s": 2.25, "step_s": 2.5}
    assert [r["node"] for r in ranks] == ["node1", "node1", "node2"]
    assert ranks[2]["peak_bytes"] == 2_000_000_000
