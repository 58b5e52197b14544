"""LoRA fine-tuning on every rank of the cluster, built on mlx-lm's trainer.

    python -m training.finetune [--config training/configs/lora.yaml] [--iters 200 ...]
    mpirun --hostfile HOSTFILE -np N python -m training.finetune --config FILE --expected-world-size N
    mlx.launch --backend ring --hostfile hosts.json -- python -m training.finetune --config FILE

Every rank runs this same command. Settings come from the defaults below, overridden by the YAML
file given with `--config` (`training/configs/lora.yaml` documents every key), overridden by the
command line flags (one per key: `--batch-size 8`, `--grad-checkpoint` / `--no-grad-checkpoint`).

mlx-lm's trainer already does the data parallelism, so this module does not redo it: each rank gets
every N-th example of each global batch (`batch_size` is the GLOBAL batch and must be divisible by
the world size), gradients are averaged across ranks by the trainer (never average them again),
losses and token counts are summed across ranks, and only rank 0 saves adapters.

What this adds:
- a loud distributed start: `mx.distributed.init(strict=True)` with the launcher's backend, and a
  check that the ranks MLX joined are as many as expected (`--expected-world-size`, or the size the
  launcher announces), instead of N processes each silently training alone;
- the same seeds on every rank (the LoRA init and dropout), and a batch order that depends on the
  seed alone (`training/batches.py`), the same on every rank and after a resume;
- on rank 0 only: a progress bar (plain lines when stdout is not a terminal, as under mpirun),
  `metrics.jsonl`, `config.yaml` (the resolved settings: `--config` it to run again),
  `adapter_config.json` as mlx-lm writes it, `loss.png` and `summary.json`, next to the adapters.

Every `save_every` steps rank 0 writes a checkpoint (`training/checkpoint.py`: adapters, optimizer
state, step, RNG key, written aside and renamed into place). `--resume` continues the run in
`adapter_path` from its latest checkpoint: the same adapters, Adam moments, step counter, learning
rate schedule position and batch order (`training/batches.py`), so an interrupted and resumed run
ends with the adapters of an uninterrupted one. `resume_adapter_file` instead starts a new run from
saved adapter weights alone, with a fresh optimizer, as mlx-lm does.

A rank with no finished step or validation batch for `stall_timeout` seconds stops itself
(`training/watchdog.py`): a node gone from the network otherwise leaves the rest waiting for ever.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import json
import os
import sys
import time
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import yaml
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm import load
from mlx_lm.tuner import trainer
from mlx_lm.tuner.callbacks import TrainingCallback
from mlx_lm.tuner.datasets import CacheDataset, load_local_dataset
from mlx_lm.tuner.utils import build_schedule, linear_to_lora_layers, print_trainable_parameters
from mlx_lm.utils import save_config
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from training import checkpoint, report
from training.batches import seeded_iterate_batches
from training.watchdog import StallWatchdog

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "lora.yaml"
LR_SCHEDULES = ("none", "cosine")
# What rank 0 leaves in adapter_path, besides the checkpoints/ directory.
OUTPUT_FILES = (
    "adapters.safetensors",
    "adapter_config.json",
    "config.yaml",
    "metrics.jsonl",
    "loss.png",
    "summary.json",
)


class ConfigError(ValueError):
    """Settings that cannot be trained with; the message names the key and what is wrong."""


class DistributedError(RuntimeError):
    """The ranks did not come together as expected; the message says how many and why."""

    def __init__(self, message: str, group: Group | None = None):
        super().__init__(message)
        self.group = group  # the ranks that did join, if any


class Group(Protocol):
    """What this module needs of `mx.distributed.Group` (tests pass a stand-in)."""

    def rank(self) -> int: ...

    def size(self) -> int: ...


# --- settings ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FinetuneConfig:
    model: str = field(default="models/base", metadata={"help": "mlx-lm model directory (or hub id)"})
    data: str = field(
        default="data/prepared", metadata={"help": "directory with train.jsonl and valid.jsonl (chat format)"}
    )
    adapter_path: str = field(default="adapters", metadata={"help": "output directory of rank 0"})
    iters: int = field(default=200, metadata={"help": "optimizer steps"})
    batch_size: int = field(
        default=4, metadata={"help": "GLOBAL batch: examples per step over all ranks; divisible by them"}
    )
    learning_rate: float = field(
        default=1e-4, metadata={"help": "Adam learning rate (peak, with a schedule)"}
    )
    lr_schedule: str = field(default="none", metadata={"help": f"one of {', '.join(LR_SCHEDULES)}"})
    warmup_steps: int = field(default=0, metadata={"help": "steps of linear warmup from 0"})
    lora_rank: int = field(default=8, metadata={"help": "rank of the LoRA matrices"})
    lora_scale: float = field(default=20.0, metadata={"help": "LoRA output scale (PEFT's alpha / rank)"})
    lora_dropout: float = field(default=0.0, metadata={"help": "dropout on the LoRA input"})
    num_layers: int = field(default=8, metadata={"help": "last layers to adapt; -1 for all"})
    max_seq_length: int = field(default=2048, metadata={"help": "longer examples are truncated"})
    mask_prompt: bool = field(default=False, metadata={"help": "learn only the assistant's last reply"})
    steps_per_report: int = field(default=10, metadata={"help": "steps between train loss reports"})
    steps_per_eval: int = field(default=50, metadata={"help": "steps between validations"})
    val_batches: int = field(default=25, metadata={"help": "batches per validation; -1 for all"})
    save_every: int = field(default=100, metadata={"help": "steps between adapter checkpoints"})
    seed: int = field(default=0, metadata={"help": "seed of LoRA init, dropout and batch order"})
    grad_checkpoint: bool = field(default=False, metadata={"help": "recompute activations to save memory"})
    stall_timeout: int = field(
        default=30,
        metadata={"help": "seconds without progress after which a rank stops (a node or link is gone)"},
    )
    resume_adapter_file: str | None = field(
        default=None, metadata={"help": "adapters.safetensors to start a new run from"}
    )


CONFIG_KEYS = tuple(f.name for f in dataclasses.fields(FinetuneConfig))
_TYPES = typing.get_type_hints(FinetuneConfig)


def _coerce(key: str, value: Any, source: str) -> Any:
    """`value` as the type of `key`, or a ConfigError naming the key and where it came from."""
    kind = _TYPES[key]
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{source}: {key} must be true or false, got {value!r}")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{source}: {key} must be an integer, got {value!r}")
    if kind is float:
        # PyYAML reads 1e-5 (no dot) as a string.
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            with contextlib.suppress(ValueError):
                return float(value)
        raise ConfigError(f"{source}: {key} must be a number, got {value!r}")
    if value is None and kind == (str | None):
        return None
    if isinstance(value, str):
        return value
    raise ConfigError(f"{source}: {key} must be a string, got {value!r}")


def merge_config(
    file_values: Mapping[str, Any], cli_values: Mapping[str, Any], source: str = "config"
) -> FinetuneConfig:
    """Defaults, overridden by a config file's values, overridden by command line values.

    Unknown keys in the file are an error (a typo would otherwise be ignored silently); a CLI value
    of None means "not given".
    """
    unknown = [key for key in file_values if key not in CONFIG_KEYS]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(str(key), CONFIG_KEYS, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigError(f"{source}: unknown key {', '.join(hints)}; known keys: {', '.join(CONFIG_KEYS)}")
    values = {key: _coerce(key, value, source) for key, value in file_values.items()}
    values |= {
        key: _coerce(key, value, "command line") for key, value in cli_values.items() if value is not None
    }
    return FinetuneConfig(**values)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping a YAML config file holds (an empty file is an empty mapping)."""
    try:
        values = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: a config file must hold a mapping of keys to values")
    return values


def config_problems(config: FinetuneConfig, world_size: int = 1) -> list[str]:
    """Everything wrong with the settings for a run on `world_size` ranks (empty when all is well)."""
    problems = []
    for key in ("model", "data", "adapter_path"):
        if not getattr(config, key):
            problems.append(f"{key} must not be empty")
    at_least_one = (
        "iters",
        "batch_size",
        "lora_rank",
        "steps_per_report",
        "steps_per_eval",
        "save_every",
        "stall_timeout",
    )
    for key in at_least_one:
        if getattr(config, key) < 1:
            problems.append(f"{key} must be at least 1, got {getattr(config, key)}")
    for key in ("num_layers", "val_batches"):
        if getattr(config, key) != -1 and getattr(config, key) < 1:
            problems.append(f"{key} must be -1 (all) or at least 1, got {getattr(config, key)}")
    if config.batch_size >= 1 and config.batch_size % world_size != 0:
        multiple = -(-config.batch_size // world_size) * world_size
        problems.append(
            f"batch_size {config.batch_size} is not divisible by the world size {world_size}: mlx-lm "
            f"gives each rank batch_size / world size examples of every global batch "
            f"(use a multiple of {world_size}, e.g. {multiple})"
        )
    if not config.learning_rate > 0:
        problems.append(f"learning_rate must be positive, got {config.learning_rate}")
    if not config.lora_scale > 0:
        problems.append(f"lora_scale must be positive, got {config.lora_scale}")
    if config.lr_schedule not in LR_SCHEDULES:
        problems.append(f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got {config.lr_schedule!r}")
    if not 0 <= config.warmup_steps < max(config.iters, 1):
        problems.append(f"warmup_steps must be at least 0 and less than iters, got {config.warmup_steps}")
    if not 0 <= config.lora_dropout < 1:
        problems.append(f"lora_dropout must be in [0, 1), got {config.lora_dropout}")
    if config.max_seq_length < 2:
        problems.append(f"max_seq_length must be at least 2, got {config.max_seq_length}")
    if not 0 <= config.seed < 2**32:
        problems.append(f"seed must be in [0, 2**32), got {config.seed}")
    return problems


def validate_config(config: FinetuneConfig, world_size: int = 1) -> None:
    if problems := config_problems(config, world_size):
        raise ConfigError("invalid settings:\n  " + "\n  ".join(problems))


def lr_schedule_config(config: FinetuneConfig) -> dict[str, Any] | None:
    """mlx-lm's `lr_schedule` (for `build_schedule` and adapter_config.json); None: a constant rate."""
    lr = config.learning_rate
    if config.lr_schedule == "cosine":
        # From the peak after warmup down towards 0 at the last step.
        schedule: dict[str, Any] = {
            "name": "cosine_decay",
            "arguments": [lr, max(config.iters - config.warmup_steps, 1), 0.0],
        }
    elif config.warmup_steps:
        schedule = {"name": "linear_schedule", "arguments": [lr, lr, 1]}  # constant after warmup
    else:
        return None
    if config.warmup_steps:
        schedule |= {"warmup": config.warmup_steps, "warmup_init": 0.0}
    return schedule


def mlx_lm_args(config: FinetuneConfig) -> dict[str, Any]:
    """The settings under `mlx_lm.lora`'s names, as it writes adapter_config.json.

    `mlx_lm.load(..., adapter_path=...)`, `mlx_lm.generate --adapter-path` and `mlx_lm.fuse` read
    fine_tune_type, num_layers and lora_parameters from it.
    """
    return {
        "model": config.model,
        "data": config.data,
        "fine_tune_type": "lora",
        "optimizer": "adam",
        "num_layers": config.num_layers,
        "lora_parameters": {
            "rank": config.lora_rank,
            "scale": config.lora_scale,
            "dropout": config.lora_dropout,
        },
        "batch_size": config.batch_size,
        "iters": config.iters,
        "learning_rate": config.learning_rate,
        "lr_schedule": lr_schedule_config(config),
        "val_batches": config.val_batches,
        "steps_per_report": config.steps_per_report,
        "steps_per_eval": config.steps_per_eval,
        "save_every": config.save_every,
        "max_seq_length": config.max_seq_length,
        "mask_prompt": config.mask_prompt,
        "grad_checkpoint": config.grad_checkpoint,
        "resume_adapter_file": config.resume_adapter_file,
        "adapter_path": config.adapter_path,
        "seed": config.seed,
    }


# --- distributed start -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Launch:
    backend: str  # "mpi" or "ring": the MLX backend that talks to the launcher's other ranks
    size: int  # the ranks the launcher started


def detect_launch(environ: Mapping[str, str]) -> Launch | None:
    """The launcher that started this process, from the environment it set; None: started by hand.

    mpirun (Open MPI) sets OMPI_COMM_WORLD_SIZE; `mlx.launch --backend ring` sets MLX_RANK and
    MLX_HOSTFILE, a file listing the ranks' addresses (empty with one host).
    """
    if "OMPI_COMM_WORLD_SIZE" in environ:
        return Launch("mpi", int(environ["OMPI_COMM_WORLD_SIZE"]))
    if "MLX_RANK" in environ and "MLX_HOSTFILE" in environ:
        text = Path(environ["MLX_HOSTFILE"]).read_text().strip()
        return Launch("ring", len(json.loads(text)) if text else 1)
    return None


def world_size_problem(
    group: Group, expected: int | None, expected_from: str = "the hostfile's slots"
) -> str | None:
    """Why the joined ranks are not the expected ones (None when they are, or nothing is expected)."""
    size = group.size()
    if expected is None or size == expected:
        return None
    message = (
        f"rank {group.rank()}: MLX joined {size} process(es) but {expected} were expected ({expected_from}). "
    )
    if size == 1:
        return message + (
            "Each process would train alone. Likely causes: MLX could not load the MPI library "
            "(on Linux set MLX_MPI_LIBNAME=libmpi.so.40, on macOS DYLD_LIBRARY_PATH=/opt/homebrew/lib, "
            "and pass them with mpirun -x), or the script was not started by mpirun / mlx.launch."
        )
    return message + (
        "Likely cause: the launcher was given another hostfile or number of ranks (mpirun -np) than "
        "the one counted."
    )


def check_world_size(group: Group, expected: int | None, expected_from: str = "the hostfile's slots") -> None:
    if problem := world_size_problem(group, expected, expected_from):
        raise DistributedError(problem, group)


def init_distributed(
    environ: Mapping[str, str], expected_world_size: int | None, init: Callable[..., Any] | None = None
) -> Any:
    """The distributed group of this run, checked against the expected number of ranks.

    Under a launcher of several ranks MLX must join them (strict: a missing MPI library is an error,
    not a silent group of one); started by hand, it is a group of one.
    """
    init = init or mx.distributed.init
    launch = detect_launch(environ)
    if launch is not None and launch.size > 1:
        try:
            group = init(strict=True, backend=launch.backend)
        except RuntimeError as error:
            hint = ""
            if launch.backend == "mpi":
                hint = (
                    " Is libmpi loadable (MLX_MPI_LIBNAME=libmpi.so.40 on Linux, "
                    "DYLD_LIBRARY_PATH=/opt/homebrew/lib on macOS)?"
                )
            raise DistributedError(
                f"MLX could not join the {launch.size} ranks {launch.backend} started: {error}.{hint}"
            ) from None
    else:
        group = init()
    if expected_world_size is not None:
        check_world_size(group, expected_world_size)
    elif launch is not None:
        check_world_size(group, launch.size, f"the ranks {launch.backend} started")
    return group


# --- progress and metrics (rank 0) -------------------------------------------------------------------


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
    ):
        self.total = total_iters
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


# --- the run ---------------------------------------------------------------------------------------


def check_inputs(config: FinetuneConfig) -> None:
    """Files the run reads, checked before the model loads."""
    data = Path(config.data)
    if not (data / "train.jsonl").is_file():
        raise ConfigError(f"data: {data} has no train.jsonl (python -m training.prepare writes one)")
    if config.resume_adapter_file and not Path(config.resume_adapter_file).is_file():
        raise ConfigError(f"resume_adapter_file: {config.resume_adapter_file} does not exist")


def load_data(config: FinetuneConfig, tokenizer: Any) -> tuple[Any, Any]:
    """The train and valid sets (valid possibly empty), sized for the global batch."""
    train_set, valid_set, _ = load_local_dataset(
        Path(config.data), tokenizer, types.SimpleNamespace(mask_prompt=config.mask_prompt)
    )
    # mlx-lm's batching needs a whole global batch of each set.
    for name, dataset in (("train", train_set), ("valid", valid_set)):
        if 0 < len(dataset) < config.batch_size or (name == "train" and not dataset):
            raise ConfigError(
                f"data: {name}.jsonl has {len(dataset)} examples, fewer than batch_size {config.batch_size}"
            )
    return train_set, valid_set


def fit_problems(saved: Mapping[str, mx.array], expected: Mapping[str, mx.array]) -> str:
    """Why saved arrays are not exactly `expected`'s names and shapes ("" when they are)."""
    problems = [f"{name}: not a parameter of this model" for name in saved if name not in expected]
    problems += [f"{name}: missing" for name in expected if name not in saved]
    problems += [
        f"{name}: shape {tuple(w.shape)}, the model's is {tuple(expected[name].shape)}"
        for name, w in saved.items()
        if name in expected and w.shape != expected[name].shape
    ]
    shown = problems[:5] + ([f"... and {len(problems) - 5} more"] if len(problems) > 5 else [])
    return "\n  ".join(shown)


def resume_from(model: nn.Module, path: str) -> None:
    """Load saved adapter weights, which must be exactly this model's trainable parameters."""
    weights = mx.load(path)
    assert isinstance(weights, dict)
    if problems := fit_problems(weights, dict(tree_flatten(model.trainable_parameters()))):
        raise ConfigError(
            f"resume_adapter_file: {path} does not fit (other lora_rank or num_layers?):\n  {problems}"
        )
    model.load_weights(list(weights.items()), strict=False)


def _records_before(metrics_file: Path, step: int) -> tuple[dict[str, Any], ...]:
    """The metrics records a checkpoint at `step` had behind it (validations at `step` are redone)."""
    try:
        lines = metrics_file.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return ()
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            break  # the last line, cut short by the interruption
    return tuple(
        r for r in records if r["iteration"] < step or (r["iteration"] == step and "train_loss" in r)
    )


def resume_point(
    config: FinetuneConfig, group: Any, model: nn.Module, optimizer: optim.Optimizer, data_digest: str
) -> ResumePoint | None:
    """Load the latest checkpoint of the run in adapter_path on every rank; None if there is none.

    Rank 0 reads it and checks that it belongs to this run (same settings and data); every rank
    then gets its adapters, optimizer state and RNG key from rank 0.
    """
    out = Path(config.adapter_path)
    rank0 = group.rank() == 0
    # What every rank will receive, with this rank's own (ignored) values to give names and shapes.
    optimizer.init(model.trainable_parameters())
    arrays = {f"adapters/{k}": v for k, v in tree_flatten(model.trainable_parameters())}
    arrays |= {f"optimizer/{k}": v for k, v in tree_flatten(optimizer.state)}
    arrays["random_key"] = mx.random.state[0]
    problem, found = "", None
    if rank0:
        found = checkpoint.latest(out)
        if found is not None:
            problem = "\n  ".join(
                checkpoint.settings_differences(found.state.get("settings", {}), asdict(config))
            )
            if found.state.get("data_sha256") != data_digest:
                problem += f"\n  data: {config.data}/train.jsonl is not the file the run was trained on"
            if not problem:
                adapters, optimizer_state = checkpoint.load_arrays(found)
                saved = {f"adapters/{k}": v for k, v in adapters.items()}
                saved |= {f"optimizer/{k}": v for k, v in optimizer_state.items()}
                saved["random_key"] = mx.array(found.state["random_key"], dtype=mx.uint32)
                problem = fit_problems(saved, arrays) or "\n  ".join(
                    f"{name}: {value.dtype}, this run's is {arrays[name].dtype}"
                    for name, value in saved.items()
                    if value.dtype != arrays[name].dtype
                )
                arrays = saved
    # Rank 0 tells every rank whether to go on, and from which step.
    status = mx.array([1 if problem else 0, found.step if found else -1])
    status = checkpoint.broadcast({"status": status}, group)["status"].tolist()
    if status[0]:
        if rank0:
            raise ConfigError(f"cannot resume from {found.path if found else out}:\n  {problem.strip()}")
        raise ConfigError("rank 0 could not resume the run (its message says why)")
    if status[1] < 0:
        if rank0:
            print(
                f"note: no checkpoint in {out / checkpoint.DIRECTORY} yet: starting from step 0", flush=True
            )
        return None
    arrays = checkpoint.broadcast(arrays, group)
    model.load_weights(
        [(k.removeprefix("adapters/"), v) for k, v in arrays.items() if k.startswith("adapters/")],
        strict=False,
    )
    optimizer.state = tree_unflatten(
        [(k.removeprefix("optimizer/"), v) for k, v in arrays.items() if k.startswith("optimizer/")]
    )
    # mx.random.state cannot be assigned to; a seed is the key's two 32-bit halves.
    high, low = arrays["random_key"].tolist()
    mx.random.seed((high << 32) | low)
    step = int(status[1])
    if not rank0:
        return ResumePoint(step=step)
    assert found is not None
    if found.state.get("world_size") != group.size():
        print(
            f"note: the checkpoint was made on {found.state.get('world_size')} ranks, this run has "
            f"{group.size()}: the same batches, but their per-rank averages round differently",
            flush=True,
        )
    print(f"resuming from {found.path} (step {step} of {config.iters})", flush=True)
    return ResumePoint(
        step=step,
        trained_tokens=int(found.state.get("trained_tokens", 0)),
        wall_time=float(found.state.get("wall_time", 0.0)),
        records=_records_before(out / "metrics.jsonl", step),
    )


class Checkpointer:
    """Writes a checkpoint (rank 0) at the first train report at or after every `save_every` steps.

    Checkpoints are taken at reports so that the checkpoint's metrics and token count include its
    step, and so that a run resumed from it reports at the same steps as an uninterrupted run
    (the trainer counts its steps from where it starts).
    """

    def __init__(
        self,
        config: FinetuneConfig,
        group: Any,
        model: nn.Module,
        optimizer: optim.Optimizer,
        callback: MetricsCallback,
        display: ProgressDisplay,
        first_step: int,
        data_digest: str,
    ):
        self.config = config
        self.writes = group.rank() == 0
        self.world_size = group.size()
        self.model = model
        self.optimizer = optimizer
        self.callback = callback
        self.display = display
        self.data_digest = data_digest
        self.due = (first_step // config.save_every + 1) * config.save_every

    def after_report(self, step: int) -> None:
        if step >= self.due:
            self.save(step)
            self.due = (step // self.config.save_every + 1) * self.config.save_every

    def save(self, step: int) -> None:
        if not self.writes:
            return
        adapters = dict(tree_flatten(self.model.trainable_parameters()))
        path = checkpoint.save(
            Path(self.config.adapter_path),
            step,
            adapters,
            dict(tree_flatten(self.optimizer.state)),
            {
                "trained_tokens": self.callback.trained_tokens,
                "wall_time": self.callback.wall_time,
                "world_size": self.world_size,
                "random_key": mx.random.state[0].tolist(),
                "data_sha256": self.data_digest,
                "settings": asdict(self.config),
            },
        )
        checkpoint.save_safetensors(Path(self.config.adapter_path) / "adapters.safetensors", adapters)
        self.display.report_save(path)


@contextlib.contextmanager
def _replaced(owner: object, name: str, value: object) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def gradient_sync_seconds(model: nn.Module, group: Any, repeats: int = 5) -> float:
    """Seconds one all-reduce of the gradients takes, timed alone: the all_sum of an array as big
    as the trainable parameters (mlx-lm's step fuses it with the compute, so it cannot be timed
    within). 0.0 on one rank."""
    if group.size() == 1:
        return 0.0
    count = sum(p.size for _, p in tree_flatten(model.trainable_parameters()))
    grads = mx.zeros((count,), dtype=mx.float32)
    times = []
    for _ in range(repeats + 1):  # the first one warms the connections up
        tic = time.perf_counter()
        mx.eval(mx.distributed.all_sum(grads, group=group, stream=mx.cpu))
        times.append(time.perf_counter() - tic)
    return sorted(times[1:])[repeats // 2]


def time_split(
    records: Sequence[Mapping[str, Any]], model_load: float, sync_per_step: float, steps: int
) -> dict[str, float]:
    """Where rank 0's time went: loading, training steps, validation, and of the training the
    estimated share of the gradient all-reduce (the one timed alone, times the steps)."""
    return {
        "model_load": model_load,
        "training": sum(r.get("train_time", 0.0) for r in records if "train_loss" in r),
        "evaluation": sum(r.get("val_time", 0.0) for r in records if "val_loss" in r),
        "gradient_sync_estimate": sync_per_step * steps,
    }


def weight_spread_across_ranks(model: nn.Module, group: Any) -> float:
    """Largest difference between any rank's trainable weights and rank 0's (0.0 alone)."""
    if group.size() == 1:
        return 0.0
    flat = mx.concatenate([p.flatten() for _, p in tree_flatten(model.trainable_parameters())])
    gathered = mx.distributed.all_gather(flat[None].astype(mx.float32), group=group, stream=mx.cpu)
    return float(mx.max(mx.abs(gathered - gathered[:1])).item())


def openblas_loaded(maps: Path = Path("/proc/self/maps")) -> bool:
    """Whether this process runs with OpenBLAS mapped in (Linux: env.sh preloads it; without it
    mlx[cpu] falls back to its bundled reference BLAS, tens of times slower)."""
    try:
        return "libopenblas" in maps.read_text()
    except OSError:  # no /proc: macOS, where MLX uses Accelerate and Metal
        return False


def ranks_with_openblas(group: Any) -> int:
    """How many ranks have OpenBLAS loaded, so a run shows that no node fell back to slow BLAS."""
    mine = mx.array([1.0 if openblas_loaded() else 0.0])
    if group.size() == 1:
        return int(mine.item())
    return int(mx.distributed.all_sum(mine, group=group, stream=mx.cpu).item())


def run(
    config: FinetuneConfig, group: Any, console: Console | None = None, resume: bool = False
) -> dict[str, Any] | None:
    """Train on this rank; rank 0 writes the outputs and returns the summary.

    resume: continue the run in adapter_path from its latest checkpoint (if it has one).
    """
    rank0 = group.rank() == 0
    started = time.monotonic()
    model, tokenizer = load(config.model)
    if config.num_layers > len(model.layers):
        raise ConfigError(f"num_layers {config.num_layers}: the model has only {len(model.layers)} layers")
    train_set, valid_set = load_data(config, tokenizer)
    # Tokenized once, on first use, for the training loop and the last validation alike.
    valid = CacheDataset(valid_set) if valid_set else None

    # Same seeds on every rank: the LoRA matrices start equal everywhere (mlx). The batch order has
    # its own RNG from the same seed (training/batches.py); numpy's global one is seeded for anything
    # else that draws from it.
    mx.random.seed(config.seed)
    np.random.seed(config.seed)
    model.freeze()
    args = mlx_lm_args(config)
    linear_to_lora_layers(model, config.num_layers, args["lora_parameters"])
    if config.resume_adapter_file:
        resume_from(model, config.resume_adapter_file)
    print_trainable_parameters(model)
    model_load = time.monotonic() - started

    out = Path(config.adapter_path)
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(asdict(config), sort_keys=False))
        save_config(args, out / "adapter_config.json")
        if not valid_set:
            print(
                f"warning: {config.data} has no valid.jsonl examples: training without validation", flush=True
            )

    schedule = lr_schedule_config(config)
    optimizer = optim.Adam(learning_rate=build_schedule(schedule) if schedule else config.learning_rate)
    data_digest = checkpoint.file_digest(Path(config.data) / "train.jsonl") if rank0 else ""
    resumed = resume_point(config, group, model, optimizer, data_digest) if resume else None
    first_step = resumed.step if resumed else 0

    display = ProgressDisplay(
        config.iters, (console or Console()) if rank0 else None, first_iteration=first_step
    )
    callback = MetricsCallback(group, out / "metrics.jsonl", display, resumed=resumed)
    checkpointer = Checkpointer(config, group, model, optimizer, callback, display, first_step, data_digest)
    callback.report_hooks.append(checkpointer.after_report)
    prefix = f"rank {group.rank()}: " if group.size() > 1 else ""
    # Compiling and the first step can take minutes on a big model; after that, the run's pace.
    watchdog = StallWatchdog(
        config.stall_timeout, first_timeout=max(600, 10 * config.stall_timeout), describe=lambda: prefix
    )
    display.step_hooks.append(watchdog.step)
    display.progress_hooks.append(watchdog.pet)
    # The trainer's own saves are off (checkpoints are the Checkpointer's), and its final save goes
    # to a partial file that is renamed once complete.
    final_partial = out / ".adapters.partial.safetensors"
    training_args = trainer.TrainingArgs(
        batch_size=config.batch_size,
        iters=config.iters - first_step,
        val_batches=config.val_batches,
        steps_per_report=config.steps_per_report,
        steps_per_eval=config.steps_per_eval,
        steps_per_save=config.iters + 1,
        max_seq_length=config.max_seq_length,
        adapter_file=str(final_partial),
        grad_checkpoint=config.grad_checkpoint,
    )
    batches = seeded_iterate_batches(config.seed, skip=first_step)
    watchdog.start()
    try:
        with _replaced(trainer, "TrainUI", lambda *_, **__: display):
            trainer.train(
                model=model,
                optimizer=optimizer,
                train_dataset=CacheDataset(train_set),
                val_dataset=valid,
                args=training_args,
                iterate_batches=batches,
                training_callback=callback,
            )
        if rank0:
            os.replace(final_partial, out / "adapters.safetensors")
        # mlx-lm's last validation runs before the last step: validate the adapters it saved.
        if valid is not None:
            tic = time.perf_counter()
            val_loss = trainer.evaluate(
                model=model,
                dataset=valid,
                batch_size=config.batch_size,
                num_batches=config.val_batches,
                max_seq_length=config.max_seq_length,
                iterate_batches=batches,
                progress_callback=display.progressed,
            )
            # The callback counts the trainer's iterations, which start at the resumed step.
            callback.on_val_loss_report(
                {
                    "iteration": config.iters - first_step,
                    "val_loss": val_loss,
                    "val_time": time.perf_counter() - tic,
                }
            )
        # Every rank must end with the same LoRA weights (mlx-lm averages the gradients): check it.
        spread = weight_spread_across_ranks(model, group)
        openblas = ranks_with_openblas(group)
        sync_per_step = gradient_sync_seconds(model, group)
    finally:
        watchdog.stop()
    if not rank0:
        return None
    summary = report.summarize(callback.records, wall_time=time.monotonic() - started)
    summary["max_weight_difference_across_ranks"] = spread
    summary["ranks_with_openblas"] = openblas
    summary["resumed_from_step"] = first_step if resumed else None
    summary["time_split"] = time_split(
        callback.records, model_load, sync_per_step, steps=config.iters - first_step
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    try:
        report.plot_losses(callback.records, out / "loss.png")
    except ImportError:
        print(
            f"note: no matplotlib on this node, so no loss.png yet: invoke train draws it on the controller "
            f"(or run python -m training.report {out} where matplotlib is)",
            flush=True,
        )
    display.print(
        f"done: {summary['iterations']} iterations on {summary['world_size']} "
        f"rank{'s' if summary['world_size'] > 1 else ''} in "
        f"{_duration(summary['wall_time'])}, train loss {summary['final_train_loss']:.3f}"
        + (f", val loss {summary['final_val_loss']:.3f}" if summary["final_val_loss"] is not None else "")
        + f", {summary['tokens_per_second']:,.0f} tok/s; adapters in {out}"
    )
    return summary


# --- command line ----------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, not {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m training.finetune",
        description="LoRA fine-tuning with mlx-lm, on one process or every rank of mpirun / mlx.launch. "
        "Settings: defaults < --config FILE < flags.",
    )
    parser.add_argument(
        "--config", help=f"YAML settings file (every key documented in {DEFAULT_CONFIG.name})"
    )
    parser.add_argument(
        "--expected-world-size",
        type=_positive_int,
        help="ranks the launcher starts (the hostfile's total slots): any other number stops every rank",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --adapter-path from its latest checkpoint: adapters, optimizer state, "
        "step, learning rate schedule and batch order (settings must match the run's config.yaml)",
    )
    defaults = FinetuneConfig()
    for f in dataclasses.fields(FinetuneConfig):
        kind = _TYPES[f.name]
        help_text = f"{f.metadata['help']} (default: {getattr(defaults, f.name)})"
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(
                flag, type=kind if kind in (int, float) else str, default=None, help=help_text
            )
    return parser


def cli_values(args: argparse.Namespace) -> dict[str, Any]:
    return {key: getattr(args, key) for key in CONFIG_KEYS if getattr(args, key) is not None}


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    environ = os.environ if environ is None else environ
    # Piped stdout (mpirun, mlx.launch) is block-buffered: progress must stream back line by line.
    if reconfigure := getattr(sys.stdout, "reconfigure", None):
        reconfigure(line_buffering=True)
    prefix = ""
    try:
        file_values = load_config_file(args.config) if args.config else {}
        config = merge_config(file_values, cli_values(args), source=args.config or "defaults")
        group = init_distributed(environ, args.expected_world_size)
        if group.size() > 1:
            prefix = f"rank {group.rank()}: "
        validate_config(config, group.size())
        check_inputs(config)
        run(config, group, resume=args.resume)
    except ConfigError as error:
        print(f"{prefix}error: {error}", file=sys.stderr, flush=True)
        return 2
    except DistributedError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        # Launchers kill every rank once one exits with an error: wait until all have said why.
        if error.group is not None and error.group.size() > 1:
            mx.eval(mx.distributed.all_sum(mx.array(0), group=error.group, stream=mx.cpu))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
