"""The plan bench's grid, its judgement of each cell against the aims (memory -5 % to +15 %, step
within 25 %), its report (JSON summary, table, PNG), and the 4-bit copy it trains, made by mlx-lm's
own convert and read by the plan as 4-bit."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from mlxcluster.bench import plan as bench
from mlxcluster.bench.plan import Cell
from mlxcluster.plan.model import weights
from tests.unit.training.model.test_folder import tiny_model

GB = 10**9


def rank(planned: float, measured: float, planned_step: float | None = 1.0, step: float | None = 1.0,
         number: int = 0) -> dict:
    return {"rank": number, "node": f"node{number + 1}", "planned_peak_bytes": round(planned * GB),
            "peak_bytes": round(measured * GB), "planned_step_s": planned_step, "step_s": step}


CELL = Cell(2, "tensor", "float", 4, 256, False)


def test_the_grid_runs_one_node_data_parallel_only_and_every_parallelism_on_more():
    cells = bench.grid([1, 2, 3], bench.PARALLELS, bench.WEIGHTS, [2, 4], [128, 256], bench.CHECKPOINTING)
    # (1 + 3 + 3) layouts x 2 weights x 2 batches x 2 lengths x 2 settings of grad checkpointing,
    # less 3 data-parallel ranks with a batch of 2 (2 weights x 2 lengths x 2 settings)
    assert len(cells) == 7 * 16 - 8 and len(set(cells)) == len(cells)
    assert Cell(3, "data", "float", 2, 128, False) not in cells
    assert Cell(3, "tensor", "float", 2, 128, False) in cells
    assert {c.parallel for c in cells if c.nodes == 1} == {"data"}
    assert [key for key, _ in bench._groups(cells)] == [("float", 128), ("float", 256), ("4bit", 128),
                                                         ("4bit", 256)]
    assert Cell(3, "pipeline", "4bit", 2, 128, True).flags() == [
        "--batch-size", "2", "--max-seq-length", "128", "--grad-checkpoint", "--parallel", "pipeline"]
    # Each group calibrates at the whole largest batch (a 1-node or tensor rank's), then half of it:
    # its cells' steps are planned between the two points.
    assert [bench.calibration_rows(group) for _, group in bench._groups(cells)] == [4, 4, 4, 4]


def test_a_cell_meets_the_memory_aim_from_5_percent_under_to_15_over_and_the_step_aim_within_25():
    met = bench.judged(CELL, [rank(1.0, 1.04, 1.2, 1.0), rank(1.14, 1.0, number=1)])
    assert met["memory_met"] and met["step_met"]
    assert met["ranks"][0]["memory_error"] == pytest.approx(1 / 1.04 - 1, abs=1e-4)
    assert met["ranks"][0]["step_error"] == pytest.approx(0.2)
    assert not bench.judged(CELL, [rank(1.0, 1.06)])["memory_met"]  # 5.7 % under
    assert not bench.judged(CELL, [rank(1.16, 1.0)])["memory_met"]  # 16 % over
    assert bench.judged(CELL, [rank(1.0, 1.0, 0.7, 1.0)])["step_met"] is False
    unplanned = bench.judged(CELL, [rank(1.0, 1.0, planned_step=None)])
    assert unplanned["step_met"] is None and unplanned["ranks"][0]["step_error"] is None
    # 3 lab ranks on 2 cores: the step is not judged, the memory is.
    shared = bench.judged(CELL, [rank(1.0, 1.0, 1.0, 3.0, n) for n in range(3)], cores=2)
    assert shared["step_met"] is None and shared["memory_met"]
    assert shared["step_not_judged"] == "3 ranks on the lab host's 2 cores"
    assert bench.judged(CELL, [rank(1.0, 1.0, 1.0, 3.0, n) for n in range(2)], cores=2)["step_met"] is False


def test_with_a_control_the_step_is_judged_against_the_plan_at_the_machine_s_speed_of_the_time():
    # Planned 1.0 s at the calibration's speed; the control ran at 0.7 of it: 1.43 s expected.
    slower = bench.judged(CELL, [rank(1.0, 1.0, 1.0, 1.45)], control=0.7)
    assert slower["control"] == 0.7 and slower["step_met"]
    assert slower["ranks"][0]["step_error"] == pytest.approx(1.0 / 1.45 - 1, abs=1e-4)  # raw: missed
    assert slower["ranks"][0]["step_error_controlled"] == pytest.approx(1.0 / 0.7 / 1.45 - 1, abs=1e-4)
    # The control can fail a step the raw error would pass: the machine ran faster than calibrated.
    assert bench.judged(CELL, [rank(1.0, 1.0, 1.0, 1.1)], control=1.5)["step_met"] is False
    assert bench.judged(CELL, [rank(1.0, 1.0, 1.0, 1.1)])["step_met"]
    assert bench.summary([slower])["step_errors_controlled"]["max"] == pytest.approx(1.0 / 0.7 / 1.45 - 1,
                                                                                       abs=1e-4)


def test_the_summary_counts_failed_cells_and_says_every_aim_met_only_when_all_ran_and_met():
    good = bench.judged(CELL, [rank(1.1, 1.0, 1.1, 1.0)])
    unplanned = bench.judged(CELL, [rank(1.0, 1.0, planned_step=None)])
    assert bench.summary([good, unplanned])["all_aims_met"]
    failed = {"cell": "3 nodes tensor", "parallel": "tensor", "error": "out of memory on node3"}
    summary = bench.summary([good, failed])
    assert summary["failed"] == 1 and not summary["all_aims_met"]
    assert summary["memory_errors"] == {"min": 0.1, "max": 0.1}
    missed = bench.judged(CELL, [rank(0.9, 1.0)])
    assert not bench.summary([good, missed])["all_aims_met"]
    assert bench.summary([good, missed])["memory_errors"] == {"min": -0.1, "max": 0.1}


def test_the_table_and_the_png_show_every_cell(tmp_path: Path):
    rows = [bench.judged(CELL, [rank(1.1, 1.0, 1.1, 1.0), rank(0.8, 1.0, 1.1, 1.0, 1)]),
            {**bench.judged(Cell(1, "data", "4bit", 2, 128, True), [])},
            {"cell": "3 nodes pipeline", "parallel": "pipeline", "error": "refused: no layout fits"}]
    console = Console(width=200, record=True)
    console.print(bench.table(rows, "title"))
    text = console.export_text()
    assert "+10.0%" in text and "-20.0%" in text and "failed: refused: no layout fits" in text
    png = bench.plot(rows, tmp_path / "plan.png", "title")
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_the_4bit_copy_is_mlx_lm_s_convert_of_the_float_model_kept_with_its_manifest(tmp_path: Path):
    tiny_model(tmp_path / "float", hidden_size=128, intermediate_size=256)
    copy = bench.quantized_copy(tmp_path / "float", tmp_path / "float-4bit")
    assert (copy / "manifest.json").is_file() and not (tmp_path / "float-4bit.convert").exists()
    packed, whole = weights(copy), weights(tmp_path / "float")
    assert packed is not None and whole is not None and packed.stored < whole.stored / 3
    assert packed.dequantized == pytest.approx(whole.stored, rel=0.01)
    assert bench.quantized_copy(tmp_path / "float", copy) == copy  # made once
