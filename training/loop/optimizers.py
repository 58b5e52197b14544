"""The optimizer and learning rate schedule of a run, built as `mlx_lm lora` builds them.

mlx-lm takes `optimizer` (adam, adamw, muon, sgd, adafactor), passes that optimizer's mapping of
`optimizer_config` to its constructor, and gives it `lr_schedule` (mlx-lm's `build_schedule`: a
schedule of mlx.optimizers by name, its arguments, and an optional linear warmup) or else the
constant `learning_rate`. `problems` checks all of that before a model is loaded: an unknown
setting of an optimizer, or a schedule mlx cannot build, is named here rather than in a traceback
on every rank.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

import mlx.optimizers as optim
from mlx_lm.tuner.utils import build_schedule

# The settings are training/config.py's FinetuneConfig, which imports this module to check them:
# they are typed by what is read of them, not by that class.
FinetuneConfig = Any

CLASSES: dict[str, type[optim.Optimizer]] = {
    "adam": optim.Adam,
    "adamw": optim.AdamW,
    "muon": optim.Muon,
    "sgd": optim.SGD,
    "adafactor": optim.Adafactor,
}
SCHEDULES = ("cosine_decay", "exponential_decay", "linear_schedule", "step_decay")
SCHEDULE_KEYS = ("name", "arguments", "warmup", "warmup_init")


def settings_of(name: str) -> list[str]:
    """The settings an optimizer's constructor takes, besides the learning rate."""
    signature = inspect.signature(CLASSES[name].__init__)
    return [p for p in signature.parameters if p not in ("self", "learning_rate")]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _kind_problem(default: Any, value: Any) -> str | None:
    """What is wrong with `value` for a setting whose default is `default` (None when nothing): the
    constructors keep any value, and a wrong kind fails only at the first update, on every rank."""
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "must be true or false"
    if isinstance(default, int):
        return None if isinstance(value, int) and not isinstance(value, bool) else "must be a whole number"
    if isinstance(default, float):
        return None if _is_number(value) else "must be a finite number"
    if isinstance(default, (list, tuple)):
        fits = isinstance(value, (list, tuple)) and len(value) == len(default) and all(map(_is_number, value))
        return None if fits else f"must be a list of {len(default)} finite numbers"
    if default is None:
        return None if value is None or _is_number(value) else "must be a finite number or null"
    return None


def _optimizer_problems(config: FinetuneConfig) -> list[str]:
    problems = []
    for name, settings in config.optimizer_config.items():
        if name not in CLASSES:
            continue  # the config's own checks name it
        known = settings_of(name)
        defaults = {p.name: p.default for p in inspect.signature(CLASSES[name].__init__).parameters.values()}
        for key, value in settings.items():
            if key not in known:
                problems.append(f"optimizer_config.{name} has no setting {key!r}; {name} takes "
                                f"{', '.join(known)}")
            elif why := _kind_problem(defaults[key], value):
                problems.append(f"optimizer_config.{name}.{key} {why}, got {_short(value)}")
    name = config.optimizer
    if name in CLASSES and not any(p.startswith((f"optimizer_config.{name} ", f"optimizer_config.{name}."))
                                     for p in problems):
        try:
            CLASSES[name](learning_rate=config.learning_rate, **config.optimizer_config.get(name, {}))
        except (TypeError, ValueError) as error:
            problems.append(f"optimizer_config.{name}: {error}")
    return problems


def _short(value: Any) -> str:
    text = repr(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    return text if len(text) <= 60 else f"{text[:57]}..."


def _schedule_problems(schedule: Any) -> list[str]:
    if schedule is None:
        return []
    if isinstance(schedule, str):
        return [f"lr_schedule must be a mapping (name, arguments, warmup, warmup_init), or the older none "
                f"or cosine; got {schedule!r}"]
    unknown = [key for key in schedule if key not in SCHEDULE_KEYS]
    if unknown:
        return [f"lr_schedule has no key {unknown[0]!r}; its keys are {', '.join(SCHEDULE_KEYS)}"]
    if schedule.get("name") not in SCHEDULES:
        return [f"lr_schedule.name must be one of {', '.join(SCHEDULES)}, got {schedule.get('name')!r}"]
    arguments = schedule.get("arguments")
    if not isinstance(arguments, list) or not arguments:
        return [f"lr_schedule.arguments must be the list of {schedule['name']}'s arguments, the first "
                f"being the initial rate; got {arguments!r}"]
    warmup = schedule.get("warmup", 0)
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        return [f"lr_schedule.warmup must be a whole number of steps, at least 0, got {warmup!r}"]
    try:
        build_schedule(dict(schedule))(0)
    except (TypeError, ValueError) as error:
        return [f"lr_schedule: {schedule['name']}{tuple(arguments)} cannot be built: {error}"]
    return []


def problems(config: FinetuneConfig) -> list[str]:
    """What is wrong with the optimizer's settings and the schedule (empty when all is well)."""
    return _optimizer_problems(config) + _schedule_problems(config.lr_schedule)


def learning_rate(config: FinetuneConfig) -> Any:
    """The schedule, or the constant rate."""
    return build_schedule(dict(config.lr_schedule)) if config.lr_schedule else config.learning_rate


def make(config: FinetuneConfig) -> optim.Optimizer:
    """The run's optimizer, exactly as mlx_lm lora makes it."""
    settings: Mapping[str, Any] = config.optimizer_config.get(config.optimizer, {})
    return CLASSES[config.optimizer](learning_rate=learning_rate(config), **settings)
