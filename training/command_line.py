"""The training entry point's command line: a flag for every setting, as `mlx_lm lora` has them.

Every key of training/config.py has a flag (`--batch-size 8`; booleans also as `--no-...`), so
every flag of `mlx_lm lora` means here what it means there (`-c/--config`, `--train`, `--test`,
`--fine-tune-type`, `--clear-cache-threshold 2GB`, ...). The keys mlx-lm has no flag for take YAML
(`--lora-parameters "{rank: 16}"`, `--lr-schedule "{name: cosine_decay, arguments: [1e-5, 1000]}"`),
and this project's older names keep their flags (`--lora-rank`, `--warmup-steps`, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import yaml

from training.config import CONFIG_KEYS, DEFAULTS, KEY_TYPES, FinetuneConfig, parse_size
from training.config_file import ConfigLoader


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, not {text!r}")
    return int(text)


def _yaml_value(text: str) -> Any:
    """A flag's value written in YAML: `{rank: 16, scale: 10}`, `cosine`, `null`."""
    try:
        return yaml.load(text, ConfigLoader)  # a SafeLoader
    except yaml.YAMLError as error:
        raise argparse.ArgumentTypeError(f"not valid YAML: {' '.join(str(error).split())}") from None


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


# Keys whose values are YAML on the command line (mappings, or a mapping or an older name).
YAML_FLAGS = ("optimizer_config", "lr_schedule", "lora_parameters", "hf_dataset")
# The older names' flags: (key, type, help).
OLDER_FLAGS = (
    ("lora_rank", int, "older name of lora_parameters.rank"),
    ("lora_scale", float, "older name of lora_parameters.scale"),
    ("lora_dropout", float, "older name of lora_parameters.dropout"),
    ("warmup_steps", int, "older name of lr_schedule's warmup"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m training.finetune",
        description="Fine-tuning with mlx-lm (lora, dora or full), on one process or every rank of mpirun / "
        "mlx-cluster-launch (or mlx.launch). Settings: defaults < --config FILE < flags; the keys and flags "
        "are mlx_lm lora's.",
    )
    parser.add_argument("-c", "--config", help="YAML settings file, as mlx_lm lora --config takes it")
    parser.add_argument(
        "--expected-world-size",
        type=_positive_int,
        help="ranks the launcher starts (the hostfile's total slots): any other number stops every rank",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --adapter-path from its latest checkpoint: weights, optimizer state, "
        "step, learning rate schedule and batch order (settings must match the run's config.yaml)",
    )
    for f in dataclasses.fields(FinetuneConfig):
        if f.name == "config":
            continue
        kind = KEY_TYPES[f.name]
        help_text = f"{f.metadata['help']} (default: {getattr(DEFAULTS, f.name)})"
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif f.name in YAML_FLAGS:
            parser.add_argument(flag, type=_yaml_value, default=None, help=help_text)
        elif f.name == "clear_cache_threshold":
            parser.add_argument(flag, type=_size, default=None, help=help_text)
        else:
            kind = kind if kind in (int, float) else str
            parser.add_argument(flag, type=kind, default=None, help=help_text)
    for key, kind, help_text in OLDER_FLAGS:
        parser.add_argument("--" + key.replace("_", "-"), type=kind, default=None, help=help_text)
    return parser


CLI_KEYS = tuple(key for key in CONFIG_KEYS if key != "config") + tuple(key for key, _, _ in OLDER_FLAGS)


def cli_values(args: argparse.Namespace) -> dict[str, Any]:
    return {key: getattr(args, key) for key in CLI_KEYS if getattr(args, key, None) is not None}
