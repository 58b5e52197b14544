"""bench.tensor's comparison of a tensor-parallel run's losses with one process's, step by step."""

from __future__ import annotations

import json
from pathlib import Path

from mlxcluster.bench import tensor


def metrics(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_the_largest_loss_difference_is_taken_step_by_step_and_none_when_steps_differ(tmp_path):
    def losses(first: float, second: float) -> list[dict]:
        return [{"iteration": 1, "train_loss": first}, {"iteration": 2, "train_loss": second},
                {"iteration": 2, "val_loss": 2.2}]

    one = metrics(tmp_path / "one", losses(2.5, 2.0))
    many = metrics(tmp_path / "many", losses(2.5001, 1.9998))
    found = tensor.loss_difference(one, many)
    assert found["max_train_loss_difference"] == 0.0002 and found["max_val_loss_difference"] == 0.0
    short = metrics(tmp_path / "short", [{"iteration": 1, "train_loss": 2.5}])
    assert tensor.loss_difference(one, short) == {"max_train_loss_difference": None,
                                                  "max_val_loss_difference": None}
