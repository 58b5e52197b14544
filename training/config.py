"""The settings of a fine-tuning run: defaults, a YAML file over them, command line flags over both.

`FinetuneConfig` holds every key with its default and help text (`training/configs/lora.yaml`
documents them again, for people); `merge_config` layers a file's values and the flags' values over
the defaults, checking each against its type; `config_problems` says everything wrong with the
result at once, for the world size the run has. `mlx_lm_args` gives the settings the names mlx-lm
writes into adapter_config.json, so that mlx-lm's own tools load the adapters.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from training.data import shares

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "lora.yaml"
LR_SCHEDULES = ("none", "cosine")
PARALLEL_MODES = ("data", "tensor")
# Integers beyond this are no step count, seed or size a run can use (and some cannot be printed).
LARGEST_INT = 10**18


class ConfigError(ValueError):
    """Settings that cannot be trained with; the message names the key and what is wrong."""


@dataclass(frozen=True)
class FinetuneConfig:
    model: str = field(default="models/base", metadata={"help": "mlx-lm model directory (or hub id)"})
    data: str = field(
        default="data/prepared", metadata={"help": "directory with train.jsonl and valid.jsonl (chat format)"}
    )
    adapter_path: str = field(default="adapters", metadata={"help": "output directory of rank 0"})
    iters: int = field(default=200, metadata={"help": "optimizer steps"})
    batch_size: int = field(
        default=4, metadata={"help": "GLOBAL batch: examples per step over all ranks, at least one each"}
    )
    parallel: str = field(
        default="data",
        metadata={"help": "data: every rank holds the whole model and trains on its share of each batch; "
                  "tensor: every rank holds a shard of the model (attention heads, MLP) and all train on "
                  "the whole batch, for a model too big for one machine"},
    )
    batch_shares: str | None = field(
        default=None,
        metadata={"help": "examples of each global batch per rank, in rank order, summing to batch_size "
                  "(e.g. 3,1 for a Mac three times as fast as the other); none: as equal as can be"},
    )
    max_micro_batch: str | None = field(
        default=None,
        metadata={"help": "most examples a rank runs at once (one per rank, or one for all; 0: no "
                  "limit): a larger share runs as micro-batches, gradients accumulated"},
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
    save_rank_weights: bool = field(
        default=False,
        metadata={"help": "every rank also writes the weights all ranks hold alike, to compare them"},
    )


CONFIG_KEYS = tuple(f.name for f in dataclasses.fields(FinetuneConfig))
_TYPES = typing.get_type_hints(FinetuneConfig)


def _shown(value: Any) -> str:
    """A value as a message shows it: short, on one line, even when it is huge."""
    try:
        text = repr(value)
    except ValueError:  # an integer too long for Python to print
        return "an integer of more than 4300 digits"
    return text if len(text) <= 60 else f"{text[:57]}..."


def _coerce(key: str, value: Any, source: str) -> Any:
    """`value` as the type of `key`, or a ConfigError naming the key and where it came from."""
    kind = _TYPES[key]
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{source}: {key} must be true or false, got {value!r}")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) < LARGEST_INT:
            return value
        raise ConfigError(f"{source}: {key} must be an integer of at most 18 digits, got {_shown(value)}")
    if kind is float:
        # PyYAML reads 1e-5 (no dot) as a string.
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            with contextlib.suppress(ValueError, OverflowError):
                number = float(value)
                if math.isfinite(number):
                    return number
        raise ConfigError(f"{source}: {key} must be a finite number, got {_shown(value)}")
    if value is None and kind == (str | None):
        return None
    if kind == (str | None) and isinstance(value, int) and not isinstance(value, bool):
        if abs(value) >= LARGEST_INT:
            raise ConfigError(f"{source}: {key} must be an integer of at most 18 digits, got {_shown(value)}")
        return str(value)  # YAML reads `max_micro_batch: 2` as a number
    if isinstance(value, str):
        return value
    raise ConfigError(f"{source}: {key} must be a string, got {_shown(value)}")


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
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (UTF-8): give a YAML settings file") from None
    except OSError as error:
        raise ConfigError(f"{path}: cannot be read ({error.strerror})") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(error).split())}") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a settings file") from None
    except ValueError:  # PyYAML's int() of a number over 4300 digits
        raise ConfigError(f"{path}: holds a number too long to read (over 4300 digits)") from None
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
    if config.parallel not in PARALLEL_MODES:
        problems.append(f"parallel must be one of {', '.join(PARALLEL_MODES)}, got {config.parallel!r}")
    elif config.parallel == "tensor" and world_size < 2:
        problems.append("parallel tensor needs at least 2 ranks to shard the model across; one process "
                        "trains with parallel data")
    if config.batch_size >= 1:
        try:
            batch_plan(config, world_size)
        except shares.ShareError as error:
            problems.append(str(error))
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


@dataclass(frozen=True)
class BatchPlan:
    """How each global batch is cut: examples per rank, and micro-batches per rank and step."""

    shares: list[int]
    limits: list[int]  # max_micro_batch per rank; 0: none
    micro_batches: int

    @property
    def equal(self) -> bool:
        return len(set(self.shares)) == 1 and self.micro_batches == 1


def data_ranks(config: FinetuneConfig, world_size: int) -> int:
    """The ranks that split each batch: all of them in data parallelism; in tensor parallelism every
    rank computes the whole batch, as one."""
    return 1 if config.parallel == "tensor" else world_size


def batch_plan(config: FinetuneConfig, world_size: int) -> BatchPlan:
    """The shares and micro-batches of `config` on `world_size` ranks (a ShareError says what
    is wrong with them)."""
    world_size = data_ranks(config, world_size)
    if config.batch_shares:
        cut = shares.parse(config.batch_shares, world_size, "batch_shares")
        if 0 in cut or sum(cut) != config.batch_size:
            raise shares.ShareError(
                f"batch_shares {config.batch_shares} must give every rank at least 1 example and sum "
                f"to batch_size {config.batch_size} (they sum to {sum(cut)})"
            )
    else:
        cut = shares.split(config.batch_size, [1] * world_size)
    limits = shares.parse(config.max_micro_batch or "0", world_size, "max_micro_batch")
    return BatchPlan(cut, limits, shares.micro_batches(cut, limits))


def validate_config(config: FinetuneConfig, world_size: int = 1) -> None:
    if problems := config_problems(config, world_size):
        # One problem, one line; several, one line each.
        raise ConfigError("invalid settings: " + (problems[0] if len(problems) == 1
                                                  else "\n  " + "\n  ".join(problems)))


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


def check_inputs(config: FinetuneConfig) -> None:
    """Files the run reads, checked before the model loads."""
    data = Path(config.data)
    if not (data / "train.jsonl").is_file():
        raise ConfigError(f"data: {data} has no train.jsonl (python -m training.data.prepare writes one)")
    if config.resume_adapter_file and not Path(config.resume_adapter_file).is_file():
        raise ConfigError(f"resume_adapter_file: {config.resume_adapter_file} does not exist")


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
