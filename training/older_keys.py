"""This project's older setting names, read as mlx-lm's.

Before settings took mlx-lm's own keys, a run was configured with `lora_rank`, `lora_scale` and
`lora_dropout` (now `lora_parameters: {rank, scale, dropout}`), and `lr_schedule: none|cosine` with
`warmup_steps` (now mlx-lm's `lr_schedule: {name, arguments, warmup, warmup_init}`). Files and flags
written so keep working: `translate` turns one layer of values (a file's, or the flags') into
mlx-lm's keys, and `said` is the note a run prints once about each older name it met.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Older key -> the key of lora_parameters it now is.
LORA_KEYS = {"lora_rank": "rank", "lora_scale": "scale", "lora_dropout": "dropout"}
# The older schedule names; a string value of lr_schedule is one of them.
SCHEDULES = ("none", "cosine")
WARMUP = "warmup_steps"
OLDER = (*LORA_KEYS, WARMUP)


def translate(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(values under mlx-lm's keys, the older schedule settings still to resolve).

    lora_* keys go into a `lora_parameters` mapping (beside any such keys the layer gives itself;
    the two ways of giving one value are refused together in `conflicts`). The schedule needs the
    final learning rate and iteration count, so a string lr_schedule and warmup_steps are handed
    back, for `schedule` once every layer is merged.
    """
    out = {key: value for key, value in values.items() if key not in OLDER}
    older_schedule: dict[str, Any] = {}
    if WARMUP in values:
        older_schedule[WARMUP] = values[WARMUP]
    if isinstance(values.get("lr_schedule"), str):
        older_schedule["lr_schedule"] = out.pop("lr_schedule")
    lora = {LORA_KEYS[key]: value for key, value in values.items() if key in LORA_KEYS}
    if lora:
        given = out.get("lora_parameters")
        out["lora_parameters"] = {**(given if isinstance(given, Mapping) else {}), **lora}
    return out, older_schedule


def conflicts(values: Mapping[str, Any]) -> list[str]:
    """Values a layer gives twice, under an older name and under mlx-lm's."""
    given = values.get("lora_parameters")
    if not isinstance(given, Mapping):
        return []
    return [f"{key} and lora_parameters.{inner} are the same setting: give one (lora_parameters: "
            f"{{{inner}: ...}} is mlx-lm's)"
            for key, inner in LORA_KEYS.items() if key in values and inner in given]


def schedule(older: Mapping[str, Any], current: Mapping[str, Any] | None, learning_rate: float,
             iters: int) -> Mapping[str, Any] | str | None:
    """mlx-lm's lr_schedule for the older settings `older` over the merged `current` one.

    cosine: from learning_rate down towards 0 at the last step, after the warmup; none: a constant
    rate. warmup_steps alone adds a linear warmup from 0 to whatever schedule is in force. Returns a
    string when the older name is none of the known ones (the checks then refuse it by name).
    """
    warmup = older.get(WARMUP, 0)
    if not isinstance(warmup, int) or isinstance(warmup, bool):
        return current  # the checks of the merged value say what is wrong with it
    name = older.get("lr_schedule")
    if isinstance(name, str) and name not in SCHEDULES:
        return name
    if name == "cosine":
        current = {"name": "cosine_decay", "arguments": [learning_rate, max(iters - warmup, 1), 0.0]}
    elif name == "none":
        current = None
    if not warmup:
        return current
    if current is None:
        current = {"name": "linear_schedule", "arguments": [learning_rate, learning_rate, 1]}  # constant
    return {**current, "warmup": warmup, "warmup_init": current.get("warmup_init", 0.0)}


def said(layers: list[Mapping[str, Any]]) -> list[str]:
    """One note per older name the layers use, saying mlx-lm's name for it."""
    used = {key for layer in layers for key in layer if key in OLDER}
    if any(isinstance(layer.get("lr_schedule"), str) for layer in layers):
        used.add("lr_schedule")
    notes = []
    for key in sorted(used):
        if key in LORA_KEYS:
            notes.append(f"{key} is this project's older name of mlx-lm's lora_parameters.{LORA_KEYS[key]}")
        elif key == WARMUP:
            notes.append("warmup_steps is this project's older name of mlx-lm's lr_schedule.warmup")
        else:
            notes.append("lr_schedule: none|cosine is this project's older form of mlx-lm's lr_schedule "
                         "mapping (name, arguments, warmup, warmup_init)")
    return notes
