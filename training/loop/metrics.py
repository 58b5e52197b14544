"""metrics.jsonl: one JSON line per train report and per validation, written by rank 0 as they come.

mlx-lm's trainer reports through a `TrainingCallback`; `MetricsCallback` turns its numbers into
records that read as one run even when the run was resumed from a checkpoint (iterations and
tokens counted from the start), and shows each on the `ProgressDisplay`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.tuner.callbacks import TrainingCallback

from training.distributed import Group
from training.loop.progress import ProgressDisplay


def _peak_memory_gb() -> float:
    return mx.get_peak_memory() / 1e9


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run picks up: its checkpoint's step, and (rank 0) what came before."""

    step: int
    trained_tokens: int = 0
    wall_time: float = 0.0
    records: tuple[dict[str, Any], ...] = ()  # metrics.jsonl records up to the checkpoint


class MetricsCallback(TrainingCallback):
    """Writes each train report and validation as one JSON line of `metrics_file`, on rank 0 only.

    The trainer calls it on every rank with the same global numbers (it sums losses and tokens
    across ranks first); other ranks keep the records in memory and write nothing.

    In a resumed run the trainer counts iterations and tokens from the checkpoint: they are
    reported here from the start of the run, after the records that came before the checkpoint.
    """

    def __init__(
        self,
        group: Group,
        metrics_file: Path,
        display: ProgressDisplay | None = None,
        clock: Callable[[], float] = time.monotonic,
        peak_memory_gb: Callable[[], float] = _peak_memory_gb,
        resumed: ResumePoint | None = None,
    ):
        self.writes = group.rank() == 0
        self.world_size = group.size()
        self.metrics_file = metrics_file
        self.display = display
        self.clock = clock
        self.peak_memory_gb = peak_memory_gb
        start = resumed or ResumePoint(step=0)
        self.offset = start.step
        self.started = clock() - start.wall_time
        self.records: list[dict[str, Any]] = list(start.records)
        self._last_iteration = start.step
        self._last_tokens = start.trained_tokens
        self._tokens_before = start.trained_tokens
        # Called with the (run's) iteration after each train report is written.
        self.report_hooks: list[Callable[[int], None]] = []
        if self.writes:
            metrics_file.parent.mkdir(parents=True, exist_ok=True)
            text = "".join(json.dumps(record) + "\n" for record in self.records)
            partial = metrics_file.with_name(f".{metrics_file.name}.partial")
            partial.write_text(text, encoding="utf-8")
            os.replace(partial, metrics_file)

    @property
    def trained_tokens(self) -> int:
        return self._last_tokens

    @property
    def wall_time(self) -> float:
        return self.clock() - self.started

    def _write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self.writes:
            with self.metrics_file.open("a", encoding="utf-8") as out:
                out.write(json.dumps(record) + "\n")

    def on_train_loss_report(self, info: Mapping[str, Any]) -> None:
        iteration = int(info["iteration"]) + self.offset
        tokens = int(info["trained_tokens"]) + self._tokens_before
        tokens_per_second = float(info["tokens_per_second"])
        # mlx-lm measures the time of the steps since the last report; its iterations_per_second
        # assumes steps_per_report of them, one report too many when iters is not a multiple.
        train_time = (tokens - self._last_tokens) / tokens_per_second if tokens_per_second > 0 else 0.0
        steps = iteration - self._last_iteration
        record = {
            "iteration": iteration,
            "train_loss": float(info["train_loss"]),
            "learning_rate": float(info["learning_rate"]),
            "tokens_per_second": tokens_per_second,
            "iterations_per_second": steps / train_time if train_time > 0 else 0.0,
            "trained_tokens": tokens,
            "train_time": train_time,
            "peak_memory_gb": float(info["peak_memory"]),
            "world_size": self.world_size,
            "wall_time": self.clock() - self.started,
        }
        self._last_iteration, self._last_tokens = iteration, tokens
        self._write(record)
        if self.display is not None:
            self.display.show_train(record)
        for hook in self.report_hooks:
            hook(iteration)

    def on_val_loss_report(self, info: Mapping[str, Any]) -> None:
        record = {
            "iteration": int(info["iteration"]) + self.offset,
            "val_loss": float(info["val_loss"]),
            "val_time": float(info["val_time"]),
            "peak_memory_gb": self.peak_memory_gb(),
            "world_size": self.world_size,
            "wall_time": self.clock() - self.started,
        }
        self._write(record)
        if self.display is not None:
            self.display.show_val(record)
