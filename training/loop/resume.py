"""What makes a run resumable: checkpoints written while it trains, and picking up from the latest.

`Checkpointer` writes one (rank 0, `training/loop/checkpoint.py`: adapters, optimizer state, step,
RNG key, the settings and the training data's digest) at the first train report at or after every
`save_every` steps, and after every `save_every_minutes` (by rank 0's clock). `resume_point` reads
the latest on rank 0, checks that it belongs to this run, and gives every rank its adapters, Adam
moments and RNG key; with the seed-only batch order (`training/data/batches.py`) the resumed run
ends with the adapters of an uninterrupted one.

`resume_from` is the other, simpler kind of resume, mlx-lm's: a new run that starts from saved
adapter weights alone, with a fresh optimizer (`resume_adapter_file`).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from training.config import ConfigError, FinetuneConfig
from training.loop import checkpoint
from training.loop.metrics import MetricsCallback, ResumePoint
from training.loop.progress import ProgressDisplay

# --- writing checkpoints --------------------------------------------------------------------------


@dataclass
class Checkpointer:
    """Writes a checkpoint (rank 0) at the first train report at or after every `save_every` steps
    that ends an update: with grad_accumulation_steps G, an iteration that is a multiple of G (in
    between, gradients are half summed, and a checkpoint holds no gradients).

    Checkpoints are taken at reports so that the checkpoint's metrics and token count include its
    step, and so that a run resumed from it reports at the same steps as an uninterrupted run
    (the trainer counts its steps from where it starts).
    """

    config: FinetuneConfig
    layout: Any  # training/tensor_parallel.Layout: its group, and the LoRA shards to gather
    model: nn.Module
    optimizer: optim.Optimizer
    callback: MetricsCallback
    display: ProgressDisplay
    first_step: int
    data_digest: str

    clock: Callable[[], float] = time.monotonic
    # A save's phase told to the controller (training/loop/heartbeat.py's busy): as long as it takes.
    busy: Callable[[str], AbstractContextManager[None]] = lambda phase: contextlib.nullcontext()

    def __post_init__(self) -> None:
        self.due = (self.first_step // self.config.save_every + 1) * self.config.save_every
        self.saved_at = self.clock()

    def after_report(self, step: int) -> None:
        if step % self.config.grad_accumulation_steps != 0:
            return
        if step >= self.due or self._time_is_up():
            self.save(step)
            self.due = (step // self.config.save_every + 1) * self.config.save_every
            self.saved_at = self.clock()

    def _time_is_up(self) -> bool:
        """save_every_minutes passed since the last checkpoint (or the start), by rank 0's clock:
        every rank must agree, as a save gathers sharded arrays from all of them."""
        if not self.config.save_every_minutes:
            return False
        group = self.layout.group
        mine = group.rank() == 0 and self.clock() - self.saved_at >= 60 * self.config.save_every_minutes
        return bool(checkpoint.broadcast({"due": mx.array([int(mine)])}, group)["due"].item())

    def save(self, step: int) -> None:
        with self.busy("save"):
            self._save(step)

    def _save(self, step: int) -> None:
        # Whole arrays, as one process has them (sharded ones are gathered: every rank takes part).
        adapters = self.layout.whole(dict(tree_flatten(self.model.trainable_parameters())))
        optimizer_state = self.layout.whole(dict(tree_flatten(self.optimizer.state)))
        if self.layout.group.rank() != 0:
            return
        path = checkpoint.save(
            Path(self.config.adapter_path),
            step,
            adapters,
            optimizer_state,
            {
                "trained_tokens": self.callback.trained_tokens,
                "wall_time": self.callback.wall_time,
                "world_size": self.layout.group.size(),
                "parallel": self.config.parallel,
                "random_key": mx.random.state[0].tolist(),
                "data_sha256": self.data_digest,
                "settings": asdict(self.config),
            },
        )
        checkpoint.save_safetensors(Path(self.config.adapter_path) / "adapters.safetensors", adapters)
        self.display.report_save(path)


# --- resuming from the latest checkpoint ----------------------------------------------------------


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


def _bundle(
    adapters: Mapping[str, mx.array], optimizer_state: Mapping[str, mx.array], random_key: mx.array
) -> dict[str, mx.array]:
    """What a resume gives every rank, as one mapping of named arrays (the form `broadcast` sends)."""
    arrays = {f"adapters/{k}": v for k, v in adapters.items()}
    arrays |= {f"optimizer/{k}": v for k, v in optimizer_state.items()}
    arrays["random_key"] = random_key
    return arrays


def _part(arrays: Mapping[str, mx.array], prefix: str) -> list[tuple[str, mx.array]]:
    return [(k.removeprefix(prefix), v) for k, v in arrays.items() if k.startswith(prefix)]


def _read_latest(
    config: FinetuneConfig, data_digest: str, expected: dict[str, mx.array]
) -> tuple[checkpoint.Checkpoint | None, str, dict[str, mx.array]]:
    """Rank 0: the latest checkpoint, why it cannot resume this run ("" when it can), and the arrays
    to send (its own, or `expected` when there are none to read)."""
    passed: list[str] = []
    found = checkpoint.latest(Path(config.adapter_path), passed)
    for line in passed:  # the controller names the same step (mlxcluster.launch.runs.latest_checkpoint)
        print(f"note: {line}", flush=True)
    if found is None:
        return None, "", expected
    problem = "\n  ".join(checkpoint.settings_differences(found.state.get("settings", {}), asdict(config)))
    if found.state.get("data_sha256") != data_digest:
        what = ("hf_dataset's files are not the ones" if config.hf_dataset
                else f"{config.data}/train.jsonl is not the file")
        problem += f"\n  data: {what} the run was trained on"
    if problem:
        return found, problem, expected
    adapters, optimizer_state = checkpoint.load_arrays(found)
    saved = _bundle(adapters, optimizer_state, mx.array(found.state["random_key"], dtype=mx.uint32))
    problem = fit_problems(saved, expected) or "\n  ".join(
        f"{name}: {value.dtype}, this run's is {expected[name].dtype}"
        for name, value in saved.items()
        if value.dtype != expected[name].dtype
    )
    return found, problem, saved


def _agreed_step(
    config: FinetuneConfig, group: Any, found: checkpoint.Checkpoint | None, problem: str
) -> int:
    """Rank 0 tells every rank whether to go on, and from which step (-1: there is no checkpoint)."""
    status = mx.array([1 if problem else 0, found.step if found else -1])
    status = checkpoint.broadcast({"status": status}, group)["status"].tolist()
    if status[0]:
        if group.rank() == 0:
            where = found.path if found else Path(config.adapter_path)
            raise ConfigError(f"cannot resume from {where}:\n  {problem.strip()}")
        raise ConfigError("rank 0 could not resume the run (its message says why)")
    return int(status[1])


def _load(arrays: Mapping[str, mx.array], model: nn.Module, optimizer: optim.Optimizer, layout: Any) -> None:
    """Whole arrays into this rank's model and optimizer (its shards of the sharded ones)."""
    model.load_weights(list(layout.shard(dict(_part(arrays, "adapters/"))).items()), strict=False)
    optimizer.state = tree_unflatten(list(layout.shard(dict(_part(arrays, "optimizer/"))).items()))
    # mx.random.state cannot be assigned to; a seed is the key's two 32-bit halves.
    high, low = arrays["random_key"].tolist()
    mx.random.seed((high << 32) | low)


def _resumed_on_rank0(
    config: FinetuneConfig, group: Any, found: checkpoint.Checkpoint, step: int
) -> ResumePoint:
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
        records=_records_before(Path(config.adapter_path) / "metrics.jsonl", step),
    )


def resume_point(
    config: FinetuneConfig, layout: Any, model: nn.Module, optimizer: optim.Optimizer, data_digest: str
) -> ResumePoint | None:
    """Load the latest checkpoint of the run in adapter_path on every rank; None if there is none.

    Rank 0 reads it and checks that it belongs to this run (same settings and data); every rank
    then gets its adapters, optimizer state and RNG key from rank 0. A checkpoint holds whole
    arrays, whatever the layout (`layout`, training/sharding/tensor_parallel.py) that wrote or reads it.
    """
    group = layout.group
    rank0 = group.rank() == 0
    # What every rank will receive, with this rank's own (ignored) values to give names and shapes.
    optimizer.init(model.trainable_parameters())
    arrays = _bundle(
        layout.whole(dict(tree_flatten(model.trainable_parameters()))),
        layout.whole(dict(tree_flatten(optimizer.state))),
        mx.random.state[0],
    )
    found, problem = None, ""
    if rank0:
        found, problem, arrays = _read_latest(config, data_digest, arrays)
    step = _agreed_step(config, group, found, problem)
    if step < 0:
        if rank0:
            where = Path(config.adapter_path) / checkpoint.DIRECTORY
            print(f"note: no checkpoint in {where} yet: starting from step 0", flush=True)
        return None
    _load(checkpoint.broadcast(arrays, group), model, optimizer, layout)
    if not rank0:
        return ResumePoint(step=step)
    assert found is not None
    return _resumed_on_rank0(config, group, found, step)


# --- starting from saved adapters (mlx-lm's resume) -----------------------------------------------


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


def resume_from(model: nn.Module, path: str, layout: Any) -> None:
    """Load saved adapter weights, which must be exactly this model's trainable parameters (whole:
    as one process has them; a sharded rank keeps its shards, `layout`)."""
    weights = mx.load(path)
    assert isinstance(weights, dict)
    if problems := fit_problems(weights, layout.whole(dict(tree_flatten(model.trainable_parameters())))):
        raise ConfigError(
            f"resume_adapter_file: {path} does not fit (other lora_rank or num_layers?):\n  {problems}"
        )
    model.load_weights(list(layout.shard(weights).items()), strict=False)
