"""What rank 0 shows while a run trains: a progress bar on a terminal, plain lines in a pipe.

The lines are read by programs as well as people, so their wording is kept: the controller finds
the last step a failed run reported in `iter N/M  loss ...` (mlxcluster/launch/builder.py), and the cluster
tests wait for `saved .../checkpoints/0000020`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def train_line(record: Mapping[str, Any], total: int, eta_seconds: float | None) -> str:
    eta = "" if eta_seconds is None else f"  eta {_duration(eta_seconds)}"
    return (
        f"iter {record['iteration']:>{len(str(total))}}/{total}  loss {record['train_loss']:.3f}"
        f"  lr {record['learning_rate']:.2e}  {record['tokens_per_second']:,.0f} tok/s"
        f"  {record['iterations_per_second']:.2f} it/s  peak {record['peak_memory_gb']:.2f} GB{eta}"
    )


def val_line(record: Mapping[str, Any], total: int) -> str:
    return (
        f"iter {record['iteration']:>{len(str(total))}}/{total}  val_loss {record['val_loss']:.3f}"
        f"  ({record['val_time']:.1f} s)"
    )


def done_line(summary: Mapping[str, Any], out: Path) -> str:
    """The last line of a run, from its summary."""
    ranks = summary["world_size"]
    val = summary["final_val_loss"]
    return (
        f"done: {summary['iterations']} iterations on {ranks} rank{'s' if ranks > 1 else ''} in "
        f"{_duration(summary['wall_time'])}, train loss {summary['final_train_loss']:.3f}"
        + (f", val loss {val:.3f}" if val is not None else "")
        + f", {summary['tokens_per_second']:,.0f} tok/s; adapters in {out}"
    )


class ProgressDisplay:
    """What rank 0 shows while training; silent on other ranks (console None).

    On a terminal: a rich progress bar (iteration, losses, tokens/s, peak memory, ETA) under the
    report lines. Elsewhere (mpirun pipes stdout back to the launcher): the report lines alone, each
    flushed as it is printed so that progress streams back line by line.

    It also stands in for mlx-lm's TrainUI during `trainer.train` (same methods), whose output would
    otherwise be printed besides this one, with colour codes even into a pipe.
    """

    def __init__(
        self,
        total_iters: int,
        console: Console | None,
        clock: Callable[[], float] = time.monotonic,
        first_iteration: int = 0,
        micro_batches: int = 1,
    ):
        self.total = total_iters
        # mlx-lm advances once per micro-batch: a step is `micro_batches` of them.
        self.micro_batches = micro_batches
        self._micro = 0
        self.console = console
        self.clock = clock
        self.started = clock()
        self.first_iteration = first_iteration  # a resumed run's checkpoint step
        self.iteration = first_iteration
        # Called on every rank after each step, and after each step or validation batch.
        self.step_hooks: list[Callable[[], None]] = []
        self.progress_hooks: list[Callable[[], None]] = []
        self.progress: Progress | None = None
        if console is not None and console.is_terminal:
            self.progress = Progress(
                TextColumn("{task.description:<5}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeRemainingColumn(),
                console=console,
            )
            self.task = self.progress.add_task(
                "train", total=total_iters, completed=first_iteration, stats=""
            )
        self.stats = {"loss": "-", "val": "-", "tok/s": "-", "peak": "-"}

    def __enter__(self) -> ProgressDisplay:
        self.started = self.clock()
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()

    def print(self, line: str) -> None:
        if self.console is not None:
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)
            self.console.file.flush()

    def eta(self, iteration: int) -> float | None:
        done = iteration - self.first_iteration
        if done <= 0:
            return None
        return (self.clock() - self.started) / done * (self.total - iteration)

    def show_train(self, record: Mapping[str, Any]) -> None:
        self.print(train_line(record, self.total, self.eta(record["iteration"])))
        self.stats |= {
            "loss": f"{record['train_loss']:.3f}",
            "tok/s": f"{record['tokens_per_second']:,.0f}",
            "peak": f"{record['peak_memory_gb']:.2f} GB",
        }
        self._update_stats()

    def show_val(self, record: Mapping[str, Any]) -> None:
        self.print(val_line(record, self.total))
        self.stats["val"] = f"{record['val_loss']:.3f}"
        self._update_stats()

    def _update_stats(self) -> None:
        if self.progress is not None:
            stats = "  ".join(f"{name} {value}" for name, value in self.stats.items())
            self.progress.update(self.task, stats=stats)

    # mlx-lm's TrainUI interface; the callback reports the numbers, with more of them.
    def advance(self) -> None:
        self._micro += 1
        if self._micro % self.micro_batches:
            self.progressed()  # a micro-batch done: progress, but not yet a step
            return
        self.iteration += 1
        if self.progress is not None:
            self.progress.advance(self.task)
        for hook in self.step_hooks:
            hook()
        self.progressed()

    def progressed(self) -> None:
        for hook in self.progress_hooks:
            hook()

    def report_train(self, *args: object) -> None:
        pass

    def report_val(self, *args: object) -> None:
        pass

    def report_save(self, checkpoint: Path) -> None:
        self.print(f"iter {self.iteration:>{len(str(self.total))}}/{self.total}  saved {checkpoint}")

    @contextlib.contextmanager
    def val_task(self, total: int) -> Iterator[Callable[[], None]]:
        if self.progress is None:
            yield self.progressed
            return
        task = self.progress.add_task("val", total=total, stats="")

        def advance() -> None:
            self.progress.advance(task)  # type: ignore[union-attr]
            self.progressed()

        try:
            yield advance
        finally:
            self.progress.remove_task(task)
