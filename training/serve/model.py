"""The base model loaded once, whole or as this rank's tensor-parallel shard, with every adapter's
LoRA (or DoRA) layers over the same base layers, and the switch between them.

Each adapter keeps its own layers, each around the base layer it adapts (the same object in every
adapter's set), so that a switch is a module swap (milliseconds), adapters may differ in rank, layers,
keys and type, and an extra adapter costs only its own low-rank matrices. Under tensor parallelism the
layers are the training's own (training/sharding/tensor_parallel.py): built for the whole model as
mlx-lm builds them, then cut with the base, each rank keeping the part of every adapter that matches
its shard, loaded from the adapter's whole file as a resumed run loads it. The vocabulary stays whole
on every rank (as mlx-lm's own shard() leaves it), so every rank computes the same whole logits and
samples the same token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.tuner.dora import DoRALinear
from mlx_lm.tuner.lora import LoRALinear
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import load as mlx_lm_load

from training.config import ConfigError
from training.loop.resume import resume_from
from training.model import quantization
from training.serve.adapters import Adapter
from training.sharding.tensor_parallel import (
    Layout,
    check_num_layers,
    shard_base,
    shard_problems,
    sharded_adapter,
)

BASE = "base"  # the model field that asks for the base model, without an adapter
ADAPTER_ARRAYS = ("lora_a", "lora_b", "m")  # what an adapter adds to a layer (m: DoRA's magnitudes)


@dataclass
class Served:
    """The model a server answers with, and the adapter in it now."""

    model: nn.Module
    tokenizer: Any
    base_weights: str  # training/model/quantization.py's words for this rank's base weights
    bare: dict[str, nn.Module]  # every adapted layer's path -> its base layer
    sets: dict[str, dict[str, nn.Module]]  # adapter name -> path -> its layer around the base
    adapter_bytes: dict[str, int] = field(default_factory=dict)  # this rank's bytes of each adapter
    stages: tuple[int, ...] = ()  # each pipeline stage's layers, in rank order (none: not in stages)
    current: str = BASE

    @property
    def names(self) -> list[str]:
        return [BASE, *self.sets]

    def use(self, name: str) -> None:
        """Answer with adapter `name` (BASE: none) from now on."""
        if name not in (BASE, *self.sets):
            raise KeyError(name)
        self.use_layers(name, {**self.bare, **self.sets.get(name, {})})

    def use_layers(self, label: str, layers: Mapping[str, nn.Module]) -> None:
        """Put `layers` (path -> layer, every adapted path) in the model, unless `label` is in it."""
        if label != self.current:
            self.model.update_modules(tree_unflatten(list(layers.items())))
            self.current = label


def adapter_layers(model: nn.Module, adapter: Adapter) -> dict[str, LoRALinear | DoRALinear]:
    """mlx-lm's LoRA (or DoRA) layers of `adapter` for the whole model, taken off it again."""
    check_num_layers(model, adapter.num_layers)
    linear_to_lora_layers(model, adapter.num_layers, adapter.lora_parameters,
                          use_dora=adapter.fine_tune_type == "dora")
    layers = {path: m for path, m in model.named_modules() if isinstance(m, (LoRALinear, DoRALinear))}
    model.update_modules(tree_unflatten([(path, m.linear) for path, m in layers.items()]))
    return layers


def load_weights(served: Served, adapter: Adapter, layout_of: Callable[[nn.Module], Any]) -> None:
    """The adapter's whole file into its layers (this rank's parts of them, when sharded: the layout
    `layout_of` gives for the model with the adapter's layers in it and trainable says which)."""
    served.use(adapter.name)
    model = served.model
    model.freeze()
    model.unfreeze(keys=["lora_a", "lora_b", *(["m"] if adapter.fine_tune_type == "dora" else [])],
                   strict=False)
    try:
        resume_from(model, str(adapter.weights), layout_of(model))
    except ConfigError as error:
        raise ConfigError(f"adapter {adapter.name}: {error}".replace("resume_adapter_file: ", "")) from None
    model.freeze()
    mine = served.sets[adapter.name]
    mx.eval([layer.parameters() for layer in mine.values()])  # its layers': a stage reads no other weights
    served.adapter_bytes[adapter.name] = sum(
        array.nbytes for path, array in tree_flatten(model.parameters())
        if path.rpartition(".")[0] in mine and path.rpartition(".")[2] in ADAPTER_ARRAYS)


def load(model_path: str, adapters: Sequence[Adapter], group: Any, *,
         tokenizer_config: Mapping[str, Any] | None = None) -> Served:
    """The base model (this rank's shard of it when `group` has several ranks) with every adapter's
    layers, each loaded from its file; the base in use (no adapter). A quantized base is served
    quantized, as mlx_lm.server serves it."""
    model, tokenizer, config = mlx_lm_load(model_path, lazy=True, return_config=True,
                                           tokenizer_config=dict(tokenizer_config or {}))
    tensor = group.size() > 1
    if tensor and (problems := shard_problems(config, group.size(), model_path, hasattr(model, "shard"))):
        raise ConfigError("cannot serve it with parallel: tensor:\n  " + "\n  ".join(problems))
    model.freeze()
    whole = {adapter.name: adapter_layers(model, adapter) for adapter in adapters}
    held = shard_base(model, config, group) if tensor else {}
    layers = dict(model.named_modules())
    sets = {name: sharded_adapter(model, loras, group, held) if tensor else dict(loras)
            for name, loras in whole.items()}
    bare = {path: layers[path] for loras in whole.values() for path in loras}
    # mlx-lm's layers for the whole model hold the whole base layers: let go of them before any
    # weight is read, or every adapted layer's whole weights would stay in this rank's memory.
    del whole
    served = Served(model, tokenizer, quantization.base_weights(config), bare, sets)
    for layer in model.layers:  # read, cut and let go of the weights a layer at a time
        mx.eval(layer.parameters())
    mode = "tensor" if tensor else "data"
    for adapter in adapters:
        load_weights(served, adapter, lambda adapted: Layout.of(mode, group, adapted))
    mx.eval(model.parameters())  # the rest of the base (embeddings, head) read now, not on the first request
    return ready(served)


def ready(served: Served) -> Served:
    """`served` answering with the base, without dropout: in the model now, and in every adapter's
    layers, swapped in later."""
    served.use(BASE)
    served.model.eval()
    for layers_of in served.sets.values():
        for layer in layers_of.values():
            layer.eval()
    return served
