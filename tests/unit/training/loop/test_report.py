"""training.loop.report: the summary and the loss plot of a run, from its metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.training.loop.test_metrics import report_a_run
from tests.unit.training.test_distributed import FakeGroup
from training.loop import report
from training.loop.metrics import MetricsCallback


def test_plot_and_summary_from_a_metrics_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    run = tmp_path / "run"
    report_a_run(MetricsCallback(FakeGroup(0, 2), run / "metrics.jsonl", peak_memory_gb=lambda: 1.0))

    assert report.main([str(run)]) == 0
    assert capsys.readouterr().out == f"{run / 'loss.png'}\n"
    assert (run / "loss.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")

    summary = report.summarize(report.read_metrics(run / "metrics.jsonl"), wall_time=9.0)
    assert summary == {
        "iterations": 15,
        "world_size": 2,
        "world_sizes": [2],
        "first_train_loss": 2.5,
        "final_train_loss": 2.0,
        "first_val_loss": 3.0,
        "final_val_loss": 2.2,
        "trained_tokens": 3000,
        "train_time": 3.0,
        "tokens_per_second": 1000.0,
        "tokens_per_second_overall": 1000.0,
        "step_seconds": 0.2,  # the reports past the first: 2 s over steps 6 to 15
        "peak_memory_gb": 1.5,
        "wall_time": 9.0,
    }


def test_a_run_that_went_on_without_a_node_says_each_number_of_ranks_in_turn():
    records = [{"iteration": i, "world_size": n, "peak_memory_gb": 0.1}
               for i, n in ((5, 3), (20, 3), (25, 2), (30, 2))]
    assert report.world_sizes(records) == [3, 2] and report.world_sizes([]) == [1]
    summary = report.summarize(records, wall_time=1.0)
    assert summary["world_size"] == 2 and summary["world_sizes"] == [3, 2]


def test_report_errors_name_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert report.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'metrics.jsonl'}: no such file\n"
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 1, "train_loss": 2.0}\nnot json\n')
    assert report.main([str(tmp_path)]) == 2
    assert "metrics.jsonl: line 2: not JSON" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("")
    assert report.main([str(tmp_path)]) == 2
    assert "no train_loss or val_loss records to plot" in capsys.readouterr().err
