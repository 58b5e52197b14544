"""The scaling report: the plan of runs (node counts by parallelism), rows from run files, speedup,
efficiency and peak memory against one node, stock mlx_lm lora's row from its output (and for real
on a tiny 4-bit model), the table and the PNG."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from mlx_lm.lora import CONFIG_DEFAULTS
from rich.console import Console

from mlxcluster.bench import overhead, scaling, stock
from mlxcluster.errors import UserError
from mlxcluster.jobs import train
from mlxcluster.jobs.request import Request
from mlxcluster.launch import settings as run_settings
from tests.unit.training.model.test_folder import tiny_model
from training.data.prepare import prepare

REPO = Path(__file__).resolve().parents[4]


def summary(tokens_per_second: float, training: float, peaks: list[float] | None = None,
            base_weights: list[str] | None = None) -> dict:
    found = {"tokens_per_second": tokens_per_second, "wall_time": 99.0, "iterations": 30,
             "final_train_loss": 1.5, "peak_memory_gb_per_rank": peaks or [0.8],
             "time_split": {"model_load": 2.0, "training": training, "evaluation": 1.0,
                            "gradient_sync_estimate": 0.25}}
    if base_weights is not None:
        found["base_weights_per_rank"] = base_weights
    return found


def test_speedup_and_efficiency_are_against_one_node(tmp_path: Path):
    rows = scaling.with_speedup([
        scaling.row(1, 1, summary(100.0, 40.0), {"wall_time_s": 60.0, "sync_s": 3.0}),
        scaling.row(2, 2, summary(190.0, 21.0), {"wall_time_s": 40.0, "sync_s": 4.0}),
        scaling.row(3, 3, summary(240.0, 17.0), {"wall_time_s": 35.0, "sync_s": 5.0}),
    ])
    assert [(r["speedup"], r["efficiency"]) for r in rows] == [(1.0, 1.0), (1.9, 0.95), (2.4, 0.8)]
    assert rows[1]["time_split_s"] == {"sync": 4.0, "model_load": 2.0, "training": 21.0,
                                       "evaluation": 1.0}
    assert rows[1]["gradient_sync_estimate_s"] == 0.25
    assert [(r["program"], r["parallel"]) for r in rows] == [("ours", "data")] * 3

    console = Console(record=True, width=200)
    console.print(scaling.table(rows, "SmolLM2 on the lab"))
    text = console.export_text()
    assert "1.90x" in text and "95%" in text and "240" in text

    png = scaling.plot(rows, tmp_path / "scaling.png", "SmolLM2 on the lab")
    assert png.read_bytes().startswith(b"\x89PNG")


def test_a_report_needs_the_one_node_baseline():
    with pytest.raises(ValueError, match="needs the 1-node configuration"):
        scaling.with_speedup([scaling.row(2, 2, summary(190.0, 21.0), {})])


# --- the plan ----------------------------------------------------------------------------------


def test_the_baseline_runs_once_and_each_larger_count_in_each_mode():
    modes = scaling.parallel_modes("data,tensor")
    counts = scaling.node_counts("1,2,3", 3)
    assert scaling.configurations(counts, modes) == [
        (1, "data"), (2, "data"), (2, "tensor"), (3, "data"), (3, "tensor")]
    # Tensor parallelism on one node would split nothing: the baseline stays the one data run.
    assert scaling.configurations([1, 3], ["tensor"]) == [(1, "data"), (3, "tensor")]
    assert scaling.configurations([1], ["data", "tensor"]) == [(1, "data")]


def test_parallel_modes_default_to_data_and_keep_the_modes_order():
    assert scaling.parallel_modes(None) == ["data"]
    assert scaling.parallel_modes("") == ["data"]
    assert scaling.parallel_modes("tensor") == ["tensor"]
    assert scaling.parallel_modes(" tensor , data") == ["data", "tensor"]
    assert scaling.parallel_modes("pipeline,data") == ["data", "pipeline"]


@pytest.mark.parametrize("wrong", ["pipe", "data,pipe", "data,data", ",", "data,"])
def test_other_parallel_modes_are_refused_with_the_choices(wrong: str):
    refused = r"--parallel .*give data, tensor or pipeline.*\(data,tensor,pipeline\)"
    with pytest.raises(UserError, match=refused):
        scaling.parallel_modes(wrong)


def test_each_run_is_launched_with_its_mode_as_flag_and_as_the_requests_parallel(tmp_path: Path,
                                                                                 monkeypatch):
    launched: list[tuple[int, Request]] = []

    def launch_run(layout: Any, request: Request, inventory: str) -> Path:
        run_dir = tmp_path / f"run{len(launched)}"
        run_dir.mkdir()
        ranks = layout.world_size
        (run_dir / "summary.json").write_text(json.dumps(summary(100.0 * ranks, 10.0, [0.5] * ranks)))
        launched.append((ranks, request))
        return run_dir

    monkeypatch.setattr(train, "launch_run", launch_run)
    monkeypatch.setattr(scaling.runs, "read_info", lambda run_dir: {"wall_time_s": 10.0})
    request = Request(tmp_path / "data", tmp_path / "model", overrides=["--iters", "30"])
    layouts = {n: SimpleNamespace(world_size=n) for n in (1, 2)}
    rows, run_dirs = scaling._our_runs(SimpleNamespace(inventory="lab.yml"),
                                       [(1, "data"), (2, "data"), (2, "tensor")], layouts, request,
                                       "30 steps")
    assert [(ranks, r.parallel, list(r.overrides)) for ranks, r in launched] == [
        (1, "data", ["--iters", "30", "--parallel", "data"]),
        (2, "data", ["--iters", "30", "--parallel", "data"]),
        (2, "tensor", ["--iters", "30", "--parallel", "tensor"])]
    assert [(r["nodes"], r["parallel"], r["tokens_per_second"]) for r in rows] == [
        (1, "data", 100.0), (2, "data", 200.0), (2, "tensor", 200.0)]
    assert run_dirs == {"1": str(tmp_path / "run0"), "2": str(tmp_path / "run1"),
                        "2-tensor": str(tmp_path / "run2")}


# --- rows of both parallelisms and stock's ------------------------------------------------------


def stock_lines(peak: str = "0.6123") -> list[str]:
    """Stock mlx_lm lora's output as the relay gets it (mlx_lm/cli_ui.py TrainUI: the header, a
    validation, the train reports with their ANSI colours, the progress bar), then PEAK_AT_EXIT's."""
    return [
        "Loading configuration file /w/bench-overhead/lora.yaml",
        "  iter   train_loss     tok/s     tokens",
        "     1    \x1b[1mval\x1b[0m 3.210    1.20s",
        "     5    \x1b[1;32m2.345 ▼\x1b[0m    1,000    \x1b[2m  2.0k\x1b[0m",
        "    10    2.200 ▼    1,000      4.0k",
        "    15    2.100 ▼      500      6.0k",
        "    15    \x1b[1mval\x1b[0m 2.900    1.10s",
        "    20    2.400 ▲    1,000      8.0k",
        "train ████████████████████████████████ 100% ·    20/20",
        f"\x1b[0mpeak memory {peak} GB\r",
    ]


def stamped(lines: list[str]) -> list[tuple[float, str]]:
    return [(float(i), line) for i, line in enumerate(lines)]


def test_stocks_peak_memory_is_read_from_the_line_it_prints_at_exit():
    assert stock.peak_memory_gb(stamped(stock_lines("12.3456"))) == 12.3456
    with pytest.raises(UserError, match="printed no peak memory"):
        stock.peak_memory_gb(stamped(stock_lines()[:-1]))


def test_stocks_row_counts_tokens_per_second_on_mlx_lms_own_clock_as_summary_json_does():
    row = stock.row(stamped(stock_lines()), iters=20, steps_per_report=5,
                    base_weights="4-bit affine, group 64")
    # After the first report: 6,000 tokens in 2 + 4 + 2 seconds inside the steps.
    assert row["tokens_per_second"] == 750.0
    # The arrival clock over the steady window (reports 5 to 15, arriving 2 s apart): 4,000 tokens.
    assert row["tokens_per_second_window"] == 2000.0
    assert row["peak_memory_gb_per_rank"] == [0.6123]
    assert row["base_weights"] == ["4-bit affine, group 64"]
    assert (row["program"], row["nodes"], row["ranks"], row["parallel"]) == ("mlx_lm lora", 1, 1, None)
    assert (row["iterations"], row["final_train_loss"]) == (20, 2.4)
    with pytest.raises(UserError, match="no train report"):
        stock.row(stamped(stock_lines()[:3]), iters=20, steps_per_report=5, base_weights=None)


def test_rows_of_both_modes_and_stock_against_our_one_node_run(tmp_path: Path):
    quantized = ["4-bit affine, group 64"]
    stocks = stock.row(stamped(stock_lines("0.9")), iters=20, steps_per_report=5,
                       base_weights=quantized[0])
    rows = scaling.with_speedup([
        stocks,  # listed first: the baseline is still our 1-node run
        scaling.row(1, 1, summary(500.0, 40.0, [0.8], quantized), {"sync_s": 3.0}),
        scaling.row(2, 2, summary(900.0, 22.0, [0.8, 0.8], quantized * 2), {"sync_s": 4.0}, "data"),
        scaling.row(2, 2, summary(400.0, 30.0, [0.46, 0.5], quantized * 2), {"sync_s": 4.0}, "tensor"),
        scaling.row(3, 3, summary(450.0, 28.0, [0.4, 0.4, 0.4]), {"sync_s": 5.0}, "tensor"),
    ])
    found = [(r["program"], r["nodes"], r["parallel"], r["speedup"], r["efficiency"],
              r["peak_memory_ratio"]) for r in rows]
    assert found == [("mlx_lm lora", 1, None, 1.5, None, 1.125),
                     ("ours", 1, "data", 1.0, 1.0, 1.0),
                     ("ours", 2, "data", 1.8, 0.9, 1.0),
                     ("ours", 2, "tensor", 0.8, 0.4, 0.625),
                     ("ours", 3, "tensor", 0.9, 0.3, 0.5)]
    assert rows[3]["peak_memory_gb_per_rank"] == [0.46, 0.5]
    assert rows[3]["base_weights"] == quantized * 2 and rows[4]["base_weights"] is None

    assert scaling.speedup_lines(rows) == {"data": ([1, 2], [1.0, 1.8]),
                                           "tensor": ([1, 2, 3], [1.0, 0.8, 0.9])}
    assert [scaling.bar_label(r) for r in rows[1:]] == ["1 node", "2 nodes, data", "2 nodes, tensor",
                                                         "3 nodes, tensor"]

    console = Console(record=True, width=220)
    console.print(scaling.table(rows, "SmolLM2 4-bit on the lab"))
    lines = console.export_text().splitlines()
    tensor = next(line for line in lines if "tensor" in line and " 3 " in line)
    assert "450" in tensor and "0.90x" in tensor and "0.40" in tensor and "0.50x" in tensor
    stock_line = next(line for line in lines if "mlx_lm lora" in line)
    assert "750" in stock_line and "0.90" in stock_line and "1.12x" in stock_line  # 1.125 shown as 1.12x

    png = scaling.plot(rows, tmp_path / "scaling.png", "SmolLM2 4-bit on the lab")
    assert png.read_bytes().startswith(b"\x89PNG")


def test_only_the_modes_run_get_a_speedup_line():
    rows = scaling.with_speedup([scaling.row(1, 1, summary(100.0, 40.0), {}),
                                 scaling.row(2, 2, summary(150.0, 30.0), {}, "tensor")])
    assert scaling.speedup_lines(rows) == {"data": ([1], [1.0]), "tensor": ([1, 2], [1.0, 1.5])}


def test_the_models_quantization_in_a_few_words(tmp_path: Path):
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 30, "quantization": {"bits": 4, "group_size": 64, "mode": "affine"}}))
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "config.json").write_text(json.dumps({"num_hidden_layers": 30}))
    assert scaling.quantization(tmp_path / "q") == "4-bit affine, group 64"
    assert scaling.quantization(tmp_path / "f") == "float"
    assert scaling.quantization(tmp_path / "missing") is None


# --- stock's settings and its program, for real -----------------------------------------------


def test_stock_trains_with_our_runs_settings_in_mlx_lms_keys(tmp_path: Path):
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    ours = run_settings.read(None, ["--iters", "30", "--batch-size", "6", "--steps-per-report", "5",
                                    "--learning-rate", "2e-4", "--grad-checkpoint"])
    settings = stock.settings_for(ours, tiny)
    assert (settings["batch_size"], settings["steps_per_report"], settings["learning_rate"]) == (6, 5, 2e-4)
    assert settings["grad_checkpoint"] is True and settings["fine_tune_type"] == "lora"
    # lora.yaml's 8 layers, capped to the model's 2 (mlx-lm refuses more).
    assert settings["num_layers"] == 2 and ours.num_layers == 8
    config = overhead.config_for(settings["fine_tune_type"], model="/m", data="/d", iters=ours.iters,
                                 settings=settings)
    assert sorted(set(config) - set(CONFIG_DEFAULTS)) == []


def test_stocks_program_is_mlx_lms_entry_point_with_the_peak_printed_at_exit():
    argv = stock.program("/w/lora.yaml", "/runs/stock")
    assert argv[:2] == ["python", "-c"] and "cli.main()" in argv[2] and "\n" not in argv[2]
    assert argv[3:] == ["lora", "--config", "/w/lora.yaml", "--train", "--adapter-path", "/runs/stock"]


def test_stock_trains_a_4bit_model_for_real_and_its_row_is_read_from_its_output(tmp_path: Path):
    tiny_model(tmp_path / "tiny", quantized=True)
    prepare(REPO / "training/data/pirate.jsonl", tmp_path / "data")
    ours = run_settings.read(None, ["--iters", "15", "--batch-size", "4", "--steps-per-report", "5",
                                    "--max-seq-length", "256", "--val-batches", "2"])
    settings = stock.settings_for(ours, tmp_path / "tiny")
    config = overhead.config_for("lora", model=str(tmp_path / "tiny"), data=str(tmp_path / "data"),
                                 iters=15, settings=settings)
    path = overhead.write_config(config, tmp_path)
    argv = stock.program(str(path), str(tmp_path / "stock"))
    env = {**os.environ, "TTY_COMPATIBLE": "0", "HF_HUB_OFFLINE": "1", "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    row = stock.row(stamped(proc.stdout.splitlines()), iters=15, steps_per_report=5,
                    base_weights=scaling.quantization(tmp_path / "tiny"))
    assert row["base_weights"] == ["4-bit affine, group 32"]
    assert row["iterations"] == 15 and row["tokens_per_second"] > 0
    assert 0 < row["peak_memory_gb_per_rank"][0] < 2
    trained = json.loads((tmp_path / "stock" / "adapter_config.json").read_text())
    assert (trained["num_layers"], trained["batch_size"]) == (2, 4)
