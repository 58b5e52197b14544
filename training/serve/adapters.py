"""The adapters a server offers: each a run's folder as mlx-lm writes it (adapter_config.json and
adapters.safetensors), named for the API's `model` field, checked before anything is loaded.

Adapters are whole in their files whatever mode trained them (rank 0 gathers them: training/finetune.py),
so one folder serves a single process and any number of tensor-parallel ranks alike. `full` runs
hold a whole model, not an adapter over a shared base: they are served as a model of their own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ADAPTER_TYPES = ("lora", "dora")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]*$")


class AdapterError(ValueError):
    """An adapter folder or name the server cannot take; the message says what to fix."""


@dataclass(frozen=True)
class Adapter:
    name: str  # what a request's `model` says to use it
    path: Path  # the folder: adapter_config.json, adapters.safetensors
    fine_tune_type: str  # lora or dora
    num_layers: int
    lora_parameters: dict[str, Any]

    @property
    def weights(self) -> Path:
        return self.path / "adapters.safetensors"


def read(name: str, path: Path) -> Adapter:
    """The adapter in `path`, named `name`; AdapterError says what is missing or wrong."""
    if not NAME.match(name):
        raise AdapterError(f"adapter name {name!r}: use letters, digits and . _ : @ / - (it is the "
                           "API's model field)")
    config_file, weights = path / "adapter_config.json", path / "adapters.safetensors"
    for needed in (config_file, weights):
        if not needed.is_file():
            raise AdapterError(f"adapter {name}: {needed} is missing (a run's folder, trained to its end "
                               "or with a checkpoint, holds both)")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as error:
        raise AdapterError(f"adapter {name}: {config_file} is not JSON: {error}") from None
    kind = config.get("fine_tune_type", "lora")
    if kind not in ADAPTER_TYPES:
        raise AdapterError(f"adapter {name}: fine_tune_type {kind} trains the whole model, not an "
                           "adapter over a shared base: make it a model folder (mlx_lm fuse) and serve "
                           "that with --model")
    layers, parameters = config.get("num_layers"), config.get("lora_parameters")
    if not isinstance(layers, int) or not isinstance(parameters, dict) or "rank" not in parameters:
        raise AdapterError(f"adapter {name}: {config_file} lacks num_layers or lora_parameters "
                           "(not an mlx-lm adapter folder?)")
    return Adapter(name, path, kind, layers, dict(parameters))


def parse(given: Sequence[str]) -> list[Adapter]:
    """`NAME=FOLDER` (or a bare FOLDER, named by its folder's name) as the server's flags give them;
    each name once."""
    adapters: list[Adapter] = []
    for item in given:
        name, sep, folder = item.partition("=")
        path = Path(folder if sep else item)
        adapters.append(read(name if sep else path.name, path))
    names = [a.name for a in adapters]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise AdapterError(f"adapter names must differ: {', '.join(twice)} given more than once")
    return adapters
