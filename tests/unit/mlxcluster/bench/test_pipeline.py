"""The pipeline bench's report, from real runs on local ring ranks (a 5-layer llama, rows cut to 16
tokens so that every micro-batch's shape is known): the counters pipeline.py writes into
summary.json, each stage's idle fraction and bubble, the bytes on each cable against what the
micro-batches' shapes imply, the derived all-reduce bytes, the aims, the JSON and the PNG."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlxcluster.bench import pipeline as bench
from mlxcluster.errors import UserError
from tests.unit import rings
from tests.unit.training.sharding.test_tensor_parallel import single_run
from tests.unit.training.test_finetune import run_launcher, training_args
from tests.unit.training.test_shares_training import uneven_inputs

LAYERS = 5
SEQ = 16  # --max-seq-length: every example is longer, so every batch is 16 wide, its inputs 15
ROWS = 4  # training_args' batch
STEPS = 10  # training_args' iters
FLOAT32 = 4


def ring_run(root: Path, out: str, ranks: int, *extra: str) -> dict[str, Any]:
    """A run on `ranks` local ring ranks: its summary.json."""
    args = training_args(root / "model", root / "data", root / out, "--expected-world-size", str(ranks),
                         "--max-seq-length", str(SEQ), *extra)
    command = [*rings.launch(ranks), sys.executable, "-m", "training.finetune", *args]
    result = run_launcher(command, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((root / out / "summary.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = uneven_inputs(tmp_path_factory.mktemp("bench-pipeline"), num_hidden_layers=LAYERS)
    single_run(root, "single", "--max-seq-length", str(SEQ))
    found: dict[str, Any] = {"root": root,
                             "single": json.loads((root / "single" / "summary.json").read_text())}
    for mode in ("pipeline", "tensor", "data"):
        found[mode] = ring_run(root, mode, 2, "--parallel", mode)
    found["hidden"] = json.loads((root / "model" / "config.json").read_text())["hidden_size"]
    return found


def implied_bytes(hidden: int, rows: int = ROWS, micro_batches: int = 4) -> int:
    """One way's bytes of a step's micro-batches: rows x seq x hidden x float32, each micro-batch."""
    per_micro = rows // micro_batches
    return per_micro * (SEQ - 1) * hidden * FLOAT32 * micro_batches


def test_the_counters_in_summary_json_are_what_a_two_stage_run_sent_and_waited(runs: dict[str, Any]):
    counters = runs["pipeline"]["pipeline_per_rank"]
    one_way = STEPS * implied_bytes(runs["hidden"])
    # Each stage sent exactly its micro-batches' activations (forward) or gradients (back), in
    # training steps only: validation's sends are not counted.
    assert [c["bytes_sent_to"] for c in counters] == [{"1": one_way}, {"0": one_way}]
    assert [c["steps"] for c in counters] == [STEPS, STEPS]
    assert [c["micro_batches"] for c in counters] == [STEPS * 4, STEPS * 4]  # min(batch 4, 2 x 2 stages)
    assert [c["layers"] for c in counters] == [[0, 3], [3, 5]]
    assert {c["total_layers"] for c in counters} == {LAYERS} and {c["stages"] for c in counters} == {2}
    for c in counters:
        assert 0 < c["recv_wait_seconds"] < c["step_seconds"]
    assert "pipeline_per_rank" not in runs["tensor"] and "pipeline_per_rank" not in runs["data"]


def test_the_report_from_real_runs_holds_the_bubble_the_bytes_and_every_aim(runs: dict[str, Any],
                                                                            tmp_path: Path):
    rows = [bench.row(1, "data", runs["single"])] + [bench.row(2, mode, runs[mode]) for mode in bench.MODES]
    gradients = bench.safetensors_bytes(runs["root"] / "single" / "adapters.safetensors")
    adapters = mx.load(str(runs["root"] / "single" / "adapters.safetensors"))
    assert gradients == sum(a.nbytes for a in adapters.values()) > 0
    report, aims = bench.judged(rows, gradients, LAYERS, -1)
    one_peak = max(runs["single"]["peak_memory_gb_per_rank"])
    pipeline = next(r for r in report if r["mode"] == "pipeline")
    for rank, figures in enumerate(pipeline["stage_figures"]):
        assert 0 <= figures["idle_fraction"] <= 1
        assert figures["bubble"] == pytest.approx(1 / 5, abs=1e-4)  # (2 - 1) / (4 + 2 - 1)
        share = [3, 2][rank] / LAYERS
        assert figures["peak_limit_gb"] == pytest.approx(one_peak * (share + 0.10), abs=1e-4)
        assert figures["peak_met"] == (figures["peak_gb"] <= figures["peak_limit_gb"])
    # The one cable carried each step's activations forward and their gradients back.
    two_ways = 2 * implied_bytes(runs["hidden"])
    assert pipeline["cables"] == [{"ranks": [0, 1], "bytes_per_step": two_ways}]
    assert pipeline["cable_bytes_per_step"] == two_ways
    tensor = next(r for r in report if r["mode"] == "tensor")
    # 1 + 2 x 5 forward, 1 + 5 x 4 + 2 backward; 2 ranks: each sends the whole message on the one cable.
    assert tensor["cable_bytes_per_step"] == 34 * 2 * (two_ways / 2)
    data = next(r for r in report if r["mode"] == "data" and r["nodes"] == 2)
    assert data["cable_bytes_per_step"] == 2 * gradients
    whats = [a["what"] for a in aims]
    assert sum("peak" in w for w in whats) == 2 and sum("idle" in w for w in whats) == 2
    bytes_aim = next(a for a in aims if "busiest cable" in a["what"])
    assert bytes_aim["met"] is True and bytes_aim["figure"] == two_ways
    assert all(isinstance(a["met"], bool) for a in aims)
    json.dumps({"rows": report, "aims": aims})  # the JSON holds every figure
    png = bench.plot(report, tmp_path / "pipeline.png", "tiny")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_the_schedule_s_idle_is_gpipe_s_bubble_with_the_last_stage_s_forward_run_once():
    # 2 stages of 2 layers, 4 micro-batches: the first does 4 units a layer and micro-batch (forward,
    # then forward and backward again), the last 3; the step is (2 + 6 + 6) + 3 x (2 + 6) = 38 units.
    first, last = bench.schedule_idle([2, 2], 4)
    assert first == pytest.approx(1 - 4 * 8 / 38) and last == pytest.approx(1 - 4 * 6 / 38)
    assert last > bench.bubble(2, 4) > first
    # More micro-batches, less idling; a stage of more layers holds the others up.
    assert max(bench.schedule_idle([2, 2], 16)) < max(bench.schedule_idle([2, 2], 4))
    assert bench.schedule_idle([3, 1, 2], 6)[1] > bench.schedule_idle([2, 2, 2], 6)[1]


def test_the_bubble_and_the_ring_s_bytes_are_their_formulas():
    assert bench.bubble(2, 4) == pytest.approx(1 / 5)
    assert bench.bubble(3, 6) == pytest.approx(2 / 8)
    assert bench.bubble(4, 8) == pytest.approx(3 / 11)
    assert bench.bubble(1, 4) == 0
    # Each rank sends 2 (N - 1) / N of the message: one cable between 2 ranks, N cables in a ring of N.
    assert bench.ring_cable_bytes(1200, 2) == 1200 * 2
    assert bench.ring_cable_bytes(1200, 3) == pytest.approx(1600)
    assert bench.ring_cable_bytes(1200, 4) == pytest.approx(1800)
    assert bench.tensor_all_sums(30, 16) == 1 + 60 + 1 + 75 + 2
    assert bench.tensor_all_sums(30, -1) == bench.tensor_all_sums(30, 30) == 1 + 60 + 1 + 145 + 2


def test_pipeline_and_data_cables_stay_within_a_replica():
    figures = [{"bytes_sent_per_step": sent} for sent in ({"1": 10}, {"0": 20}, {"3": 30}, {"2": 40})]
    assert bench.pipeline_cables(figures, 2) == [{"ranks": [0, 1], "bytes_per_step": 30},
                                                 {"ranks": [2, 3], "bytes_per_step": 70}]


def test_the_plan_is_one_process_each_count_in_each_mode_then_pipeline_and_data_where_it_divides():
    assert bench.configurations([2, 3, 4], 2) == [
        (1, "data", None), (2, "data", None), (2, "tensor", None), (2, "pipeline", None),
        (3, "data", None), (3, "tensor", None), (3, "pipeline", None),
        (4, "data", None), (4, "tensor", None), (4, "pipeline", None), (4, bench.PIPELINE_DATA, 2)]
    assert bench.node_counts(None, 3) == [2, 3]
    with pytest.raises(UserError, match="from 2 up to the 4"):
        bench.node_counts("1,2", 4)
