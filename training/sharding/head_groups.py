"""Sharding a model whose attention heads the ranks do not divide, by key-value head groups.

A model's own `shard()` gives every rank an equal number of query and key-value heads: SmolLM2-135M
(9 query heads sharing 3 key-value heads) cannot be split across 2 ranks that way. Grouped-query
attention does not need equal parts, only whole groups: a key-value head and the query heads that
read it stay on one rank. Here each rank takes as equal a number of groups as can be (SmolLM2 on 2
ranks: 2 groups, 6 query heads, and 1 group, 3 query heads), and the MLP's hidden units likewise.

The layers are MLX's own sharded linear layers (`AllToShardedLinear`, `ShardedToAllLinear`, or
their quantized twins), given this rank's rows or columns; only blocks built as mlx-lm's llama
family are (`self_attn` with `q_proj`, `k_proj`, `v_proj`, `o_proj`, `n_heads`, `n_kv_heads`; `mlp`
with `gate_proj`, `up_proj`, `down_proj`, each a float or quantized linear layer). In a quantized
model the MLP's hidden units go to the ranks in whole quantization groups of the down projection
(training/sharding/quantized.py), which cuts them along its inputs.
"""

from __future__ import annotations

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

from training.sharding import quantized
from training.sharding.parts import aligned_bounds, bounds

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
LINEAR = (nn.Linear, nn.QuantizedLinear)


def splits(config: Mapping[str, Any], ranks: int) -> bool:
    """Whether whole key-value head groups can go to every one of `ranks`."""
    heads, groups = config.get("num_attention_heads"), config.get("num_key_value_heads")
    groups = groups or heads
    return (isinstance(heads, int) and isinstance(groups, int) and groups >= ranks
            and heads % groups == 0 and config.get("intermediate_size", ranks) >= ranks)


def fits(model: nn.Module) -> str | None:
    """Why this model's blocks are not built as this module shards them (None when they are)."""
    for layer in model.layers:
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        parts = [getattr(attention, name, None) for name in ATTENTION]
        parts += [getattr(mlp, name, None) for name in MLP]
        if not all(type(part) in LINEAR for part in parts) or not hasattr(attention, "n_kv_heads"):
            return "its blocks are not llama-style attention and MLP of linear layers"
    return None


def column(linear: nn.Module, start: int, stop: int, group: Any) -> nn.Module:
    """MLX's all-to-sharded layer (quantized, if `linear` is) holding output rows [start, stop)."""
    # Built for N equal parts of this size, then given its own part: parts may differ by a head
    # group, which the layer's computation does not mind (only its constructor checks).
    width = group.size() * (stop - start)
    if quantized.is_packed(linear):
        inputs = linear.weight.shape[1] * quantized.WORD_BITS // linear.bits
        layer = QuantizedAllToShardedLinear(inputs, width, "bias" in linear, group=group,
                                            **quantized.settings(linear))
    else:
        layer = AllToShardedLinear(linear.weight.shape[1], width, "bias" in linear, group)
    layer.update(quantized.rows(linear, start, stop))
    if "bias" in linear:
        layer.bias = mx.contiguous(linear.bias[start:stop])
    return layer


def row(linear: nn.Module, start: int, stop: int, group: Any) -> nn.Module:
    """MLX's sharded-to-all layer (quantized, if `linear` is) holding input columns [start, stop)."""
    width = group.size() * (stop - start)
    if quantized.is_packed(linear):
        layer = QuantizedShardedToAllLinear(width, linear.weight.shape[0], "bias" in linear, group=group,
                                            **quantized.settings(linear))
    else:
        layer = ShardedToAllLinear(width, linear.weight.shape[0], "bias" in linear, group)
    layer.update(quantized.columns(linear, start, stop))
    if "bias" in linear:
        layer.bias = linear.bias
    return layer


def shard(model: nn.Module, group: Any) -> list[tuple[nn.Module, tuple[int, int]]]:
    """Split every block across `group` by head groups and hidden units, in place; each sharded
    layer with the rows or columns [start, stop) it holds (for its LoRA)."""
    size, rank = group.size(), group.rank()
    held: list[tuple[nn.Module, tuple[int, int]]] = []
    for layer in model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        per_group = attention.n_heads // attention.n_kv_heads
        head_dim = attention.q_proj.weight.shape[0] // attention.n_heads  # output rows: never packed
        first, last = bounds(attention.n_kv_heads, size, rank)
        queries = (first * per_group * head_dim, last * per_group * head_dim)
        keys = (first * head_dim, last * head_dim)
        # The MLP's hidden units in whole quantization groups of the down projection's inputs.
        unit = quantized.input_unit(mlp.down_proj)
        hidden = aligned_bounds(mlp.gate_proj.weight.shape[0], size, rank, unit)
        cuts = {"self_attn.q_proj": (queries, column), "self_attn.k_proj": (keys, column),
                "self_attn.v_proj": (keys, column), "self_attn.o_proj": (queries, row),
                "mlp.gate_proj": (hidden, column), "mlp.up_proj": (hidden, column),
                "mlp.down_proj": (hidden, row)}
        for path, ((start, stop), kind) in cuts.items():
            owner, name = path.split(".")
            sharded = kind(getattr(getattr(layer, owner), name), start, stop, group)
            setattr(getattr(layer, owner), name, sharded)
            held.append((sharded, (start, stop)))
        attention.n_heads = (last - first) * per_group
        attention.n_kv_heads = last - first
    return held
