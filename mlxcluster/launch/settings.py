"""A run's training settings, read and checked on the controller by the ranks' own rules.

Every rank reads its settings with training/config.py: the config file, then the flags on its
command line. The controller runs the same parser and the same checks on the same file and flags
(`--extra` included) for the run's world size before anything is sent, so that settings the ranks
would refuse are refused here, in one line that names the value, and nothing is copied or
launched. The flags that name the run's own folders are the controller's to give: `--extra`
cannot override them (`--adapter-path /etc` would have rank 0 write into /etc on the launcher).
"""

from __future__ import annotations

import argparse
import difflib
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from mlxcluster.errors import UserError, shown
from training.command_line import build_parser, cli_values
from training.config import (
    DEFAULT_CONFIG,
    ConfigError,
    FinetuneConfig,
    merge_config,
    older_names_said,
    validate_config,
)
from training.config_file import load_config_file

# Flags of the training entry point that the controller sets for every run, and why.
RESERVED = {
    "config": "give the settings file with invoke train --config",
    "model": "give the model with invoke train --model",
    "data": "give the data with invoke train --data",
    "adapter_path": "a run writes into its own folder, runs/<id>",
    "resume": "continue a run with invoke train --resume",
    "expected_world_size": "the world size is the cluster's (mpi_slots in the inventory)",
}


class SettingsError(UserError):
    """Settings the ranks would refuse; the message names the key or flag and the fix."""


def _refuse(message: str) -> NoReturn:
    raise SettingsError(message)


def _parser() -> argparse.ArgumentParser:
    """The ranks' parser, raising instead of exiting: its message becomes a SettingsError."""
    parser = build_parser()
    parser.error = lambda message: _refuse(f"training flags: {message}")  # type: ignore[method-assign]
    return parser


def split_extra(extra: str) -> list[str]:
    """invoke train --extra as the words the ranks get; an unclosed quote is refused."""
    try:
        return shlex.split(extra or "")
    except ValueError as error:
        raise SettingsError(f"--extra {extra!r}: {error}; quote each value whole, e.g. "
                            "--extra \"--learning-rate 2e-4\"") from None


def parse_flags(flags: Sequence[str]) -> argparse.Namespace:
    """Training flags as the ranks parse them; an unknown one is refused, naming the nearest."""
    parser = _parser()
    try:
        parsed, unknown = parser.parse_known_args(list(flags))
    except SystemExit:  # --help or --version: they would print and end every rank
        raise SettingsError(f"training flags {shlex.join(flags)}: --help is no training flag; "
                            "python -m training.finetune --help lists them") from None
    if unknown:
        known = [o for action in parser._actions for o in action.option_strings]
        word = next((u for u in unknown if u.startswith("-")), unknown[0])
        close = difflib.get_close_matches(word.split("=", 1)[0], known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        what = "unknown training flag" if word.startswith("-") else "a value without its flag"
        raise SettingsError(f"{what} {word!r}{hint}: python -m training.finetune --help lists them")
    return parsed


def user_flags(flags: Sequence[str]) -> list[str]:
    """`flags` of the user's (--extra and the like), refused when they set a reserved one."""
    parsed = parse_flags(flags)
    for key, why in RESERVED.items():
        if getattr(parsed, key, None) not in (None, False):
            raise SettingsError(f"--{key.replace('_', '-')} cannot be given to a run: {why}")
    return list(flags)


def paths_in(config: Path | None) -> dict[str, str]:
    """The model and data a user's config file names (mlx-lm's `model:` and `data:`), if it does."""
    if config is None:
        return {}
    try:
        values = load_config_file(config)
    except ConfigError as error:
        raise SettingsError(str(error)) from None
    found = {}
    for key in ("model", "data"):
        value = values.get(key)
        if value is not None and not isinstance(value, str):
            raise SettingsError(f"{config}: {key} must be a folder or a Hugging Face id, got {shown(value)}")
        if value:
            found[key] = value
    return found


def older_names(config: Path | None, flags: Sequence[str]) -> list[str]:
    """The notes rank 0 prints once for this project's older key names the settings use."""
    return older_names_said(load_config_file(config or DEFAULT_CONFIG), cli_values(parse_flags(flags)))


def read(config: Path | None, flags: Sequence[str]) -> FinetuneConfig:
    """The settings every rank will train with: the config file (the shipped one by default) and
    the flags after it, merged as training/config.py merges them."""
    source = str(config or DEFAULT_CONFIG)
    try:
        return merge_config(load_config_file(config or DEFAULT_CONFIG), cli_values(parse_flags(flags)),
                            source=source)
    except ConfigError as error:
        raise SettingsError(str(error)) from None


def check(config: Path | None, flags: Sequence[str], world_size: int) -> FinetuneConfig:
    """The settings, checked as every rank checks them on `world_size` ranks."""
    settings = read(config, flags)
    try:
        validate_config(settings, world_size)
    except ConfigError as error:
        raise SettingsError(str(error)) from None
    return settings
