"""bench.calibrate's figures (mlxcluster/bench/calibrate.py): each node's first run at a rank's
equal share of the global batch, and a second at another batch size, whose line through both steps
(a fixed part of every pass, then tokens/s) the plan's step times take."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxcluster.bench import calibrate
from mlxcluster.describe.cluster import Recorded
from tests.unit import fake_inputs
from tests.unit.mlxcluster.launch.test_stages import layout as cluster_of


def summary(tokens_per_second: float, step_seconds: float | None) -> dict:
    return {"tokens_per_second": tokens_per_second, "peak_memory_gb": 0.5, "step_seconds": step_seconds}


def test_the_second_run_is_at_half_the_share_or_at_two_examples_where_the_share_is_one(tmp_path: Path):
    data, model = fake_inputs.dataset(tmp_path / "data"), fake_inputs.model(tmp_path / "model")
    rec = Recorded("inventory/lab.yml", cluster_of({"node1": 1, "node2": 1}), tmp_path)

    def planned(batch: int) -> calibrate.Plan:
        return calibrate.plan(rec, iters=4, batch_size=batch, data=str(data), model=str(model), config=None,
                              threads=None, extra="--max-seq-length 128")

    for batch, first, second in ((8, 4, 2), (6, 3, 1), (2, 1, 2), (1, 1, 2)):
        the_plan = planned(batch)
        assert (the_plan.per_rank, the_plan.second_rows) == (first, second)
        flags = the_plan.second_request.overrides
        assert flags[flags.index("--batch-size") + 1] == str(second)
        assert flags[-2:] == ["--max-seq-length", "128"]  # the same settings, but for the batch


def test_a_node_s_row_keeps_both_runs_and_the_line_through_their_steps():
    # 4 examples, 400 tokens in 5 s; 2 examples, 200 tokens in 3 s: 1 s a step, then 100 tokens/s.
    first, second = summary(80.0, 5.0), summary(200 / 3, 3.0)
    row = calibrate.with_pace(calibrate.node_row(first), first, second, 2)
    assert row["tokens_per_second"] == 80.0 and row["step_seconds"] == 5.0
    assert row["second"] == {"examples_per_step": 2, "tokens_per_second": 66.7, "peak_memory_gb": 0.5,
                             "step_seconds": 3.0}
    assert row["marginal_tokens_per_second"] == pytest.approx(100.0)
    assert row["overhead_seconds"] == pytest.approx(1.0)
    # A run that reported once has no steady step: both runs kept, no line.
    once = calibrate.with_pace(calibrate.node_row(first), first, summary(70.0, None), 2)
    assert "marginal_tokens_per_second" not in once and once["second"]["examples_per_step"] == 2
