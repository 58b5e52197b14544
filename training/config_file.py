"""A settings file read as `mlx_lm lora` reads it: YAML (with `1e-5` a number, as in YAML 1.2), a
mapping of keys to values, and nothing a reader of the settings cannot walk.

The controller (mlxcluster/launch/settings.py) and every rank (training/finetune.py) read a config
file here; training/config.py then checks each value against its key's type.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """Settings that cannot be trained with; the message names the key and what is wrong."""


class ConfigLoader(yaml.SafeLoader):
    """YAML as mlx-lm reads a config file: `1e-5` (no dot) is a number, as in YAML 1.2."""


ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


# The most values a settings file holds once its aliases (&a / *a) are expanded; every reader of
# the settings (the checks, run.json) walks them expanded.
LARGEST_EXPANDED = 100_000


def _expands_within(value: Any, budget: int) -> int:
    """What is left of `budget` once `value`'s items are counted as often as aliases repeat them;
    below 0 as soon as it runs out (the walk stops there)."""
    budget -= 1
    if isinstance(value, Mapping):
        items = [*value.keys(), *value.values()]
    elif isinstance(value, (list, tuple, set)):
        items = list(value)
    else:
        return budget
    for item in items:
        if budget < 0:
            break
        budget = _expands_within(item, budget)
    return budget


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping a YAML config file holds (an empty file is an empty mapping), read as mlx-lm reads it."""
    try:
        values = yaml.load(Path(path).read_text(encoding="utf-8"), ConfigLoader)  # a SafeLoader
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
    try:
        within = _expands_within(values, LARGEST_EXPANDED) >= 0
    except RecursionError:  # an alias inside itself
        within = False
    if not within:
        raise ConfigError(f"{path}: holds more than {LARGEST_EXPANDED} values once its YAML aliases "
                          "(&name, *name) are expanded: not a settings file; write the values out")
    return values
