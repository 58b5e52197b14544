"""The scaling report: rows from run files, speedup and efficiency, the table and the PNG."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from mlxcluster.bench import scaling


def summary(tokens_per_second: float, training: float) -> dict:
    return {"tokens_per_second": tokens_per_second, "wall_time": 99.0, "iterations": 30,
            "final_train_loss": 1.5,
            "time_split": {"model_load": 2.0, "training": training, "evaluation": 1.0,
                           "gradient_sync_estimate": 0.25}}


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

    console = Console(record=True, width=160)
    console.print(scaling.table(rows, "SmolLM2 on the lab"))
    text = console.export_text()
    assert "1.90x" in text and "95%" in text and "240" in text

    png = scaling.plot(rows, tmp_path / "scaling.png", "SmolLM2 on the lab")
    assert png.read_bytes().startswith(b"\x89PNG")


def test_a_report_needs_the_one_node_baseline():
    with pytest.raises(ValueError, match="needs the 1-node configuration"):
        scaling.with_speedup([scaling.row(2, 2, summary(190.0, 21.0), {})])
