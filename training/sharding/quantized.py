"""Quantized layers cut across tensor-parallel ranks, and which cuts a quantization allows.

A quantized linear layer (mlx's `QuantizedLinear`, as `mlx_lm convert -q` writes it) keeps its
weight packed: each row's inputs in groups of `group_size` that share a scale (and a bias, in the
affine mode), `bits` per input, 32 bits to a stored word. Its output rows cut anywhere, as a float
layer's do: each row is whole. Its inputs cut only where a group and a word both end: a rank's
columns must start and stop on a multiple of `unit(group_size, bits)`. A row-parallel layer (the
attention's output projection, the MLP's down projection) is cut along its inputs, so its cuts
must fall there, at every rank's boundary; this module says where (`unit`), cuts the packed arrays
(`rows`, `columns`), and finds, from config.json alone, the cuts a quantization cannot take
(`problems`), so the controller refuses them before anything is sent.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import (
    AllToShardedLinear,
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
    ShardedToAllLinear,
)
from mlx.utils import tree_unflatten

from training.model import quantization
from training.sharding.parts import bounds

QUANTIZED = (nn.QuantizedLinear, nn.QuantizedEmbedding)
# What a quantized layer holds besides its packed weight, cut with it.
PACKED_WITH = ("scales", "biases")
WORD_BITS = 32


def unit(group_size: int, bits: int) -> int:
    """The fewest inputs a cut of a packed row can hold: whole groups, in whole 32-bit words."""
    return math.lcm(group_size, WORD_BITS // math.gcd(bits, WORD_BITS))


def input_unit(layer: nn.Module) -> int:
    """Where `layer`'s inputs can be cut: anywhere (1) for a float layer, else at `unit`."""
    return unit(layer.group_size, layer.bits) if is_packed(layer) else 1


def is_packed(layer: nn.Module) -> bool:
    """Whether a layer holds quantized weights (mlx's quantized layers, or a shard of one)."""
    return isinstance(layer, QUANTIZED) or "scales" in layer


def settings(layer: nn.Module) -> dict[str, Any]:
    """A quantized layer's constructor settings."""
    return {"group_size": layer.group_size, "bits": layer.bits, "mode": getattr(layer, "mode", "affine")}


def rows(layer: nn.Module, start: int, stop: int) -> dict[str, mx.array]:
    """Output rows [start, stop) of a float or quantized layer's weight (and scales, biases)."""
    return {name: mx.contiguous(layer[name][start:stop])
            for name in ("weight", *PACKED_WITH) if layer.get(name) is not None}


def columns(layer: nn.Module, start: int, stop: int) -> dict[str, mx.array]:
    """Input columns [start, stop) of a float or quantized layer's weight (and scales, biases):
    for a quantized one, the words and groups that hold them, which `start` and `stop` must bound."""
    if not is_packed(layer):
        return {"weight": mx.contiguous(layer.weight[:, start:stop])}
    step = input_unit(layer)
    if start % step or stop % step:
        raise ValueError(f"inputs [{start}, {stop}) of a {described(layer)} layer: a cut must "
                         f"fall on a multiple of {step} inputs")
    per_word = WORD_BITS // math.gcd(layer.bits, WORD_BITS)  # inputs filling whole words
    words = layer.bits // math.gcd(layer.bits, WORD_BITS)  # the words they fill
    out = {"weight": mx.contiguous(layer.weight[:, start // per_word * words:stop // per_word * words])}
    for name in PACKED_WITH:
        if layer.get(name) is not None:
            out[name] = mx.contiguous(layer[name][:, start // layer.group_size:stop // layer.group_size])
    return out


def float_weight(layer: nn.Module) -> mx.array:
    """A float or quantized layer's weight as floats (a quantized one's dequantized)."""
    if not is_packed(layer):
        return layer["weight"]
    return mx.dequantize(layer["weight"], layer["scales"], layer.get("biases"), group_size=layer.group_size,
                         bits=layer.bits, mode=getattr(layer, "mode", "affine"))


def dequantize_shards(model: nn.Module, dtype: mx.Dtype) -> None:
    """Turn this rank's packed shards into float ones of `dtype`, in place: each sharded layer into
    its float twin holding the same rows or inputs, a packed vocabulary shard into a float one, and
    any layer left whole through mlx-lm's own dequantizing. The cuts stay those of the packed model,
    which every rank made alike (a float model would be cut elsewhere: not in whole groups)."""
    from mlx_lm.utils import dequantize_model

    twins = {QuantizedAllToShardedLinear: AllToShardedLinear, QuantizedShardedToAllLinear: ShardedToAllLinear}
    swapped = []
    for path, layer in model.named_modules():
        if type(layer) in twins:
            size = layer.group.size()
            twin = twins[type(layer)](size, size, bias=False, group=layer.group)  # given its arrays next
            twin.weight = float_weight(layer).astype(dtype)
            if "bias" in layer:
                twin.bias = layer.bias
            swapped.append((path, twin))
        elif getattr(layer, "packed", False):  # a vocabulary shard (training/sharding/vocab_parallel.py)
            layer.dequantize(dtype)
    model.update_modules(tree_unflatten(swapped))
    dequantize_model(model)


def describe(settings_of_one: Mapping[str, Any]) -> str:
    """One layer's quantization as people name it: `4-bit affine, group 64`."""
    return quantization.describe({"quantization": settings_of_one})


def described(layer: nn.Module) -> str:
    return describe(settings(layer))


# --- from config.json, before anything is loaded ---------------------------------------------------


def problems(config: Mapping[str, Any], ranks: int, name: str) -> list[str]:
    """Why the ranks cannot cut this quantized model's row-parallel layers as they would (empty
    when they can, or when it is not quantized). The attention's output projection is cut where
    a rank's key-value head groups end (training/sharding/head_groups.py), which must be where a
    quantization group ends; the MLP's down projection is cut at its groups, each rank taking as
    equal a number of them as can be, so it needs a group for every rank."""
    if not isinstance(config.get("quantization"), Mapping):
        return []
    heads, groups = config.get("num_attention_heads"), config.get("num_key_value_heads")
    groups = groups or heads
    hidden, inner, layers = (config.get(k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers"))
    if not all(isinstance(v, int) and v > 0 for v in (heads, groups, hidden, layers)):
        return []
    head_dim = config.get("head_dim") or hidden // heads
    starts = [bounds(groups, ranks, r)[0] * heads // groups * head_dim for r in range(1, ranks)]
    found: dict[str, list[int]] = {}
    for i in range(layers):
        if (attention := quantization.of_layer(config, f"model.layers.{i}.self_attn.o_proj")) is not None:
            step = unit(attention["group_size"], attention["bits"])
            if bad := [s for s in starts if s % step]:
                found.setdefault(
                    f"self_attn.o_proj ({describe(attention)}): a rank's part of its inputs would begin at "
                    f"input {bad[0]}, inside a group of {step}; train on a number of nodes that splits its "
                    "key-value head groups at a group's end, or with --parallel data", []).append(i)
        mlp = quantization.of_layer(config, f"model.layers.{i}.mlp.down_proj")
        step = unit(mlp["group_size"], mlp["bits"]) if mlp is not None else 1
        if mlp is not None and isinstance(inner, int) and inner // step < ranks:
            found.setdefault(
                f"mlp.down_proj ({describe(mlp)}): its {inner} inputs are {inner // step} groups of {step}, "
                f"fewer than the {ranks} ranks that would each hold whole ones; train on at most "
                f"{inner // step} nodes, or with --parallel data", []).append(i)
    return [f"model {name}, {what} (layers {_span(at)})" for what, at in found.items()]


def _span(layers: list[int]) -> str:
    return f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else str(layers[0])
