"""Checkpoints a fine-tuning run can be resumed from, each written whole or not at all.

    <adapter_path>/checkpoints/0000100/adapters.safetensors   the LoRA weights after step 100
                                       optimizer.safetensors  the optimizer's state (adam's moments), step, lr
                                       state.json             step, tokens, RNG key, the settings

A checkpoint is written into a hidden `.0000100.partial` directory and renamed into place once
every file is on disk, so a rank or node dying mid-write leaves either the previous checkpoints or
a complete new one, never a half-written one that `--resume` would load. Files outside
`checkpoints/` (adapters.safetensors, ...) are replaced the same way: written aside, then renamed.

Only rank 0 writes and reads checkpoints; on resume it sends what it read to the other ranks over
the run's own distributed group (`broadcast`), so they need no copy of the run directory.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import mlx.core as mx

from training import config, older_keys
from training.loop.checkpoint_files import (
    ADAPTERS,
    DIRECTORY,
    OPTIMIZER,
    STATE,
    file_digest,
    newest_whole,
    safetensors_short,
)

# The settings that change what training computes: a checkpoint only resumes a run with the same.
# (Reporting, validation and saving intervals, paths of outputs and grad_checkpoint do not.)
TRAINING_SETTINGS = (
    "fine_tune_type",
    "optimizer",
    "optimizer_config",
    "iters",
    "batch_size",
    "learning_rate",
    "lr_schedule",
    "lora_parameters",
    "num_layers",
    "max_seq_length",
    "mask_prompt",
    "grad_accumulation_steps",
    "seed",
)


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_safetensors(path: Path, arrays: Mapping[str, mx.array]) -> None:
    """mx.save_safetensors, with a failed write an OSError (ENOSPC when the disk is full). MLX
    raises a RuntimeError ("[write] Unable to write ...") on a full file system, and nothing at
    all on some failed writes (measured: to /dev/full), so the file is also checked against its
    own header."""
    try:
        mx.save_safetensors(str(path), dict(arrays))
    except RuntimeError as error:
        if not str(error).startswith("[write]"):
            raise
        _write_failed(path, str(error))
    if short := safetensors_short(path):
        _write_failed(path, f"written short, {short}")


def _write_failed(path: Path, how: str) -> NoReturn:
    free = shutil.disk_usage(path.parent).free
    raise OSError(errno.ENOSPC if free < (1 << 20) else errno.EIO,
                  f"{path.name}: {how} ({free} bytes free there)", str(path))


def save_safetensors(path: Path, arrays: Mapping[str, mx.array]) -> None:
    """Write `arrays` to `path` atomically: a reader sees the old file or the whole new one."""
    # mx.save_safetensors appends .safetensors to a name without it: keep the suffix last.
    partial = path.with_name(f".{path.stem}.partial.safetensors")
    try:
        write_safetensors(partial, arrays)
        _fsync(partial)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, path)


def save(
    adapter_path: Path,
    step: int,
    adapters: Mapping[str, mx.array],
    optimizer_state: Mapping[str, mx.array],
    state: Mapping[str, Any],
) -> Path:
    """Write the checkpoint of `step` under adapter_path/checkpoints; its directory."""
    root = adapter_path / DIRECTORY
    final = root / f"{step:07d}"
    partial = root / f".{step:07d}.partial"
    shutil.rmtree(partial, ignore_errors=True)  # left by a writer that died
    partial.mkdir(parents=True)
    try:
        write_safetensors(partial / ADAPTERS, adapters)
        write_safetensors(partial / OPTIMIZER, optimizer_state)
        # The arrays' digests: a resume tells a whole checkpoint from a truncated or overwritten one.
        files = {name: file_digest(partial / name) for name in (ADAPTERS, OPTIMIZER)}
        (partial / STATE).write_text(json.dumps({"step": step, **state, "files": files}, indent=2) + "\n")
        for name in (ADAPTERS, OPTIMIZER, STATE):
            _fsync(partial / name)
    except BaseException:
        # A full disk (or anything else) mid-write: the part written goes, giving its space back;
        # the checkpoints before it are untouched.
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if final.exists():
        # The same step from an earlier attempt of this run (resumed from before it): replaced.
        stale = root / f".{step:07d}.stale"
        shutil.rmtree(stale, ignore_errors=True)
        final.rename(stale)
        partial.rename(final)
        shutil.rmtree(stale)
    else:
        partial.rename(final)
    _fsync(root)
    return final


def latest(adapter_path: Path, passed: list[str] | None = None) -> Checkpoint | None:
    """The newest whole checkpoint under adapter_path (checkpoint_files.newest_whole), or None if
    there is none; the newer damaged ones passed over are added to `passed`."""
    path, state, damaged = newest_whole(adapter_path)
    if passed is not None:
        passed += damaged
    return Checkpoint(path, state) if path is not None and state is not None else None


def load_arrays(checkpoint: Checkpoint) -> tuple[dict[str, mx.array], dict[str, mx.array]]:
    """(adapter weights, flat optimizer state) of a checkpoint."""
    adapters = mx.load(str(checkpoint.path / ADAPTERS))
    optimizer = mx.load(str(checkpoint.path / OPTIMIZER))
    assert isinstance(adapters, dict) and isinstance(optimizer, dict)
    return adapters, optimizer


def _as_current(settings: Mapping[str, Any]) -> Mapping[str, Any]:
    """Settings as this version names and completes them (older key names read as mlx-lm's)."""
    try:
        return dataclasses.asdict(config.merge_config(
            {k: v for k, v in settings.items() if k in (*config.CONFIG_KEYS, *older_keys.OLDER)}, {}))
    except config.ConfigError:
        return settings  # compared as they are: what differs is named


def settings_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """What keeps a checkpoint made with `saved` settings from resuming a run with `current`."""
    saved, current = _as_current(saved), _as_current(current)
    return [
        f"{key}: the checkpoint was made with {saved.get(key)!r}, this run has {current.get(key)!r}"
        for key in TRAINING_SETTINGS
        if saved.get(key) != current.get(key)
    ]


def broadcast(arrays: Mapping[str, mx.array], group: Any) -> dict[str, mx.array]:
    """Rank 0's `arrays` on every rank. Other ranks pass arrays of the same names, shapes and
    dtypes (their values are ignored): a sum with zeros from every other rank is an exact copy."""
    if group.size() == 1:
        return dict(arrays)
    mine = group.rank() == 0
    # In the same order on every rank, whatever order each rank's mapping has (a file's, a model's).
    out = {
        name: mx.distributed.all_sum(
            arrays[name] if mine else mx.zeros(arrays[name].shape, arrays[name].dtype),
            group=group,
            stream=mx.cpu,
        )
        for name in sorted(arrays)
    }
    mx.eval(out)
    return out
