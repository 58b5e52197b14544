"""training.loop.metrics and training.loop.progress: the metrics.jsonl rank 0 writes, and what it shows."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from rich.console import Console

from tests.unit.training.test_distributed import FakeGroup
from training.loop import report
from training.loop.metrics import MetricsCallback
from training.loop.progress import ProgressDisplay


def train_info(iteration: int, loss: float, tokens: int) -> dict[str, Any]:
    # As mlx-lm reports it, with its tokens/s over the steps since the last report.
    return {
        "iteration": iteration,
        "train_loss": loss,
        "learning_rate": 1e-4,
        "iterations_per_second": 5.0,
        "tokens_per_second": 1000.0,
        "trained_tokens": tokens,
        "peak_memory": 1.5,
    }


def report_a_run(callback: MetricsCallback) -> None:
    callback.on_val_loss_report({"iteration": 0, "val_loss": 3.0, "val_time": 0.5})
    callback.on_train_loss_report(train_info(10, 2.5, 2000))
    callback.on_train_loss_report(train_info(15, 2.0, 3000))  # a last, shorter report
    callback.on_val_loss_report({"iteration": 15, "val_loss": 2.2, "val_time": 0.4})


def test_rank_0_writes_one_json_line_per_report(tmp_path: Path):
    ticks = iter([100.0, 101.0, 102.0, 103.0, 104.0])
    callback = MetricsCallback(
        FakeGroup(0, 2),
        tmp_path / "run" / "metrics.jsonl",
        clock=lambda: next(ticks),
        peak_memory_gb=lambda: 1.25,
    )
    report_a_run(callback)

    records = report.read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert records == callback.records
    assert [(r["iteration"], "val_loss" in r) for r in records] == [
        (0, True),
        (10, False),
        (15, False),
        (15, True),
    ]
    assert records[0] == {
        "iteration": 0,
        "val_loss": 3.0,
        "val_time": 0.5,
        "peak_memory_gb": 1.25,
        "world_size": 2,
        "wall_time": 1.0,
    }
    assert records[2] == {
        "iteration": 15,
        "train_loss": 2.0,
        "learning_rate": 1e-4,
        "tokens_per_second": 1000.0,
        "iterations_per_second": 5.0,  # 5 steps in 1 s (1000 tokens at 1000 tok/s), not mlx-lm's 10 / 1 s
        "trained_tokens": 3000,
        "train_time": 1.0,
        "peak_memory_gb": 1.5,
        "world_size": 2,
        "wall_time": 3.0,
    }
    assert (records[1]["train_time"], records[1]["iterations_per_second"]) == (2.0, 5.0)


def test_other_ranks_write_nothing(tmp_path: Path):
    callback = MetricsCallback(FakeGroup(1, 2), tmp_path / "run" / "metrics.jsonl")
    report_a_run(callback)
    assert not (tmp_path / "run").exists()


def test_progress_is_plain_lines_off_a_terminal_and_nothing_on_other_ranks(tmp_path: Path):
    out = io.StringIO()
    ticks = iter([0.0, 0.0, *[10.0] * 20])
    display = ProgressDisplay(
        40, Console(file=out, force_terminal=False, width=60), clock=lambda: next(ticks)
    )
    callback = MetricsCallback(
        FakeGroup(0, 1), tmp_path / "metrics.jsonl", display, peak_memory_gb=lambda: 1.0
    )
    with display:
        report_a_run(callback)
        display.report_save(Path("adapters/0000015_adapters.safetensors"))

    assert out.getvalue().splitlines() == [
        "iter  0/40  val_loss 3.000  (0.5 s)",
        "iter 10/40  loss 2.500  lr 1.00e-04  1,000 tok/s  5.00 it/s  peak 1.50 GB  eta 0:00:30",
        "iter 15/40  loss 2.000  lr 1.00e-04  1,000 tok/s  5.00 it/s  peak 1.50 GB  eta 0:00:16",
        "iter 15/40  val_loss 2.200  (0.4 s)",
        "iter  0/40  saved adapters/0000015_adapters.safetensors",
    ]
    assert "\x1b[" not in out.getvalue()

    silent = ProgressDisplay(40, None)
    with silent, silent.val_task(3) as advance:
        advance()
        silent.show_train(callback.records[1])
        silent.advance()


def test_progress_bar_on_a_terminal(tmp_path: Path):
    out = io.StringIO()
    display = ProgressDisplay(20, Console(file=out, force_terminal=True, width=150))
    callback = MetricsCallback(
        FakeGroup(0, 1), tmp_path / "metrics.jsonl", display, peak_memory_gb=lambda: 1.0
    )
    with display:
        for _ in range(15):
            display.advance()
        with display.val_task(2) as advance:
            advance()
        report_a_run(callback)
    assert display.progress is not None
    assert display.progress.tasks[0].completed == 15
    assert "15/20" in out.getvalue() and "2.000" in out.getvalue() and "2.200" in out.getvalue()
