"""The base served in pipeline stages: each rank loads only its run of whole layers (as a
pipeline-parallel run trained them, training/sharding/pipeline.py), with every adapter's layers
among them, and the model's own call runs as an inference pipeline, so that mlx-lm's generation code
runs unchanged, and in step, on every rank.

One call of the model on a stage: a stage after the first receives the stage before's activations
for the call's tokens (their width and dtype agreed once, at load), runs its layers and their KV
caches, and a stage before the last sends its output on; both are evaluated then and there, so that
a call whose output mlx-lm never reads (a chunk of a long prompt: it reads only the caches) still
passes its activations on. The last stage's logits reach every rank as an all_sum with zeros on
the other stages, evaluated when mlx-lm reads them, as every rank does alike: every rank samples the
same token. `make_prompt_cache` counts the model's layers, which on a stage are its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load as mlx_lm_load

from training.config import ConfigError
from training.model import quantization
from training.serve.adapters import Adapter
from training.serve.model import Served, adapter_layers, load_weights, ready
from training.sharding.pipeline import (
    WIRE_DTYPES,
    StageModel,
    Wire,
    agree_on_wires,
    layers_owner,
    make_stage,
    probed_wire,
    stage_layers,
)
from training.sharding.stage_layout import PipelineLayout


@dataclass(frozen=True)
class Relay:
    """What one stage does around its layers on every call of the model."""

    stage: StageModel
    group: Any
    incoming: Wire | None  # what the stage before sends (None: the first stage)
    outgoing: Wire | None  # what this stage sends on (None: the last stage)
    logits: Wire  # the last stage's logits: their vocabulary and dtype

    def __call__(self, call: Any, model: nn.Module, inputs: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        stage, here = self.stage, self.stage.stage
        if self.incoming is not None:
            received = mx.distributed.recv(self.incoming.shape(inputs), self.incoming.dtype, here - 1,
                                           group=self.group, stream=mx.cpu)
            mx.eval(received)
            stage.boundary.incoming = received
        out = call(model, inputs, *args, **kwargs)
        if self.outgoing is None:
            logits = out
        else:
            sent = stage.boundary.outgoing.astype(self.outgoing.dtype)
            mx.eval(mx.distributed.send(sent, here + 1, group=self.group, stream=mx.cpu))
            logits = mx.zeros(self.logits.shape(inputs), dtype=self.logits.dtype)
        stage.boundary.incoming = stage.boundary.outgoing = None  # not held between calls
        if stage.stages == 1:
            return logits
        return mx.distributed.all_sum(logits, group=self.group, stream=mx.cpu)


def agree_on_logits(stage: StageModel, incoming: Wire | None, group: Any) -> Wire:
    """The logits' width (the vocabulary) and dtype, as the last stage's model makes them, told to
    every stage: the last builds (and never evaluates) its forward for one token."""
    code = mx.zeros((2,), dtype=mx.int32)
    if stage.last:
        logits = probed_wire(stage, incoming, "the model's logits", "pipeline serving shares")
        code = mx.array([logits.width, WIRE_DTYPES.index(logits.dtype)], dtype=mx.int32)
    if stage.stages > 1:
        code = mx.distributed.all_sum(code, group=group, stream=mx.cpu)
    width, dtype = code.tolist()
    return Wire(width, WIRE_DTYPES[dtype])


def read_weights(stage: StageModel, incoming: Wire | None) -> None:
    """Read now, in this thread, every weight this stage's calls read and no other (its layers; the
    embeddings on the first stage, the norm and head on the last): one token through the stage.
    mlx-lm generates in a thread of its own, which cannot read a weight loaded lazily in this one."""
    tokens = mx.zeros((1, 1), dtype=mx.int32)
    mx.eval(stage.forward(tokens, None if incoming is None else mx.zeros(incoming.shape(tokens),
                                                                          dtype=incoming.dtype)))


def pipelined(model: nn.Module, relay: Relay) -> None:
    """Make this one model's call (not its class's other instances') go through `relay`."""
    base = type(model)

    def __call__(self: nn.Module, inputs: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        return relay(base.__call__, self, inputs, *args, **kwargs)

    model.__class__ = type(f"Pipelined{base.__name__}", (base,), {"__call__": __call__})


def stage_runs(model: nn.Module, model_path: str, ranks: int,
               counts: Sequence[int] | None) -> list[tuple[int, int]]:
    """Each rank's run of layers: `counts` (the run's recorded stages) when given, else as equal as can
    be; a ConfigError that says what to do for a model without a list of layers, or too few layers."""
    try:
        owner, _ = layers_owner(model)
    except ConfigError:
        raise ConfigError(f"cannot serve {model_path} in pipeline stages: its body is not a list of "
                          "layers (model.layers); serve it with --parallel single or tensor") from None
    total = len(owner["layers"])
    if ranks > total:
        raise ConfigError(f"cannot serve {model_path} in pipeline stages on {ranks} ranks: it has {total} "
                          f"layers, and each stage holds at least one; serve it on at most {total} ranks, "
                          "or with --parallel single or tensor")
    return stage_layers(total, ranks, counts=counts)


def load_stage(model_path: str, adapters: Sequence[Adapter], group: Any, *,
               counts: Sequence[int] | None = None,
               tokenizer_config: Mapping[str, Any] | None = None) -> Served:
    """This rank's stage of the base (`counts`: each stage's layers, else as equal as can be) with
    every adapter's layers among them, each loaded from the adapter's whole file by this stage's
    names; its call an inference pipeline (`Relay`); the base in use. Weights outside the stage are
    never read."""
    model, tokenizer, config = mlx_lm_load(model_path, lazy=True, return_config=True,
                                           tokenizer_config=dict(tokenizer_config or {}))
    runs = stage_runs(model, model_path, group.size(), counts)
    model.freeze()
    # mlx-lm's layers for the whole model (an adapter's num_layers counts the whole model's), kept
    # where they are on this stage, under its names.
    whole = {adapter.name: adapter_layers(model, adapter) for adapter in adapters}
    stage = make_stage(model, group.rank(), runs)
    layers = dict(model.named_modules())
    sets = {name: {local: layer for path, layer in loras.items()
                   if (local := stage.local_name(path)) is not None}
            for name, loras in whole.items()}
    del whole  # the other stages' layers go with it, their weights never read
    bare = {path: layers[path] for held in sets.values() for path in held}
    served = Served(model, tokenizer, quantization.base_weights(config), bare, sets,
                    stages=tuple(stop - start for start, stop in runs))
    owner, _ = layers_owner(model)
    if len(make_prompt_cache(model)) != len(owner["layers"]):
        raise ConfigError(f"cannot serve {model_path} in pipeline stages: its KV cache is not one entry "
                          "per layer of a stage; serve it with --parallel single or tensor")
    for layer in owner["layers"]:  # this stage's layers, read a layer at a time
        mx.eval(layer.parameters())
    incoming, outgoing = agree_on_wires(stage, group)
    logits = agree_on_logits(stage, incoming, group)
    read_weights(stage, incoming)
    for adapter in adapters:  # every stage in the same order: joining the layouts is a collective
        load_weights(served, adapter, lambda _: PipelineLayout(group, stage))
    pipelined(model, Relay(stage, group, incoming, outgoing, logits))
    return ready(served)
