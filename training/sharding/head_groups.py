"""Sharding a model whose attention heads the ranks do not divide, by key-value head groups.

A model's own `shard()` gives every rank an equal number of query and key-value heads: SmolLM2-135M
(9 query heads sharing 3 key-value heads) cannot be split across 2 ranks that way. Grouped-query
attention does not need equal parts, only whole groups: a key-value head and the query heads that
read it stay on one rank. Here each rank takes as equal a number of groups as can be (SmolLM2 on 2
ranks: 2 groups, 6 query heads, and 1 group, 3 query heads), and the MLP's hidden units likewise.

The layers are MLX's own sharded linear layers (`AllToShardedLinear`, `ShardedToAllLinear`), given
this rank's rows or columns; only blocks built as mlx-lm's llama family are (`self_attn` with
`q_proj`, `k_proj`, `v_proj`, `o_proj`, `n_heads`, `n_kv_heads`; `mlp` with `gate_proj`,
`up_proj`, `down_proj`, all float `nn.Linear`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import AllToShardedLinear, ShardedToAllLinear

from training.sharding.vocab_parallel import bounds

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


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
        if not all(type(part) is nn.Linear for part in parts) or not hasattr(attention, "n_kv_heads"):
            return "its blocks are not llama-style attention and MLP of float linear layers"
    return None


def column(linear: nn.Linear, start: int, stop: int, group: Any) -> AllToShardedLinear:
    """MLX's all-to-sharded layer holding output rows [start, stop) of `linear`."""
    # Built for N equal parts of this size, then given its own part: parts may differ by a head
    # group, which the layer's computation does not mind (only its constructor checks).
    layer = AllToShardedLinear(linear.weight.shape[1], group.size() * (stop - start), "bias" in linear, group)
    layer.weight = mx.contiguous(linear.weight[start:stop])
    if "bias" in linear:
        layer.bias = mx.contiguous(linear.bias[start:stop])
    return layer


def row(linear: nn.Linear, start: int, stop: int, group: Any) -> ShardedToAllLinear:
    """MLX's sharded-to-all layer holding input columns [start, stop) of `linear`."""
    layer = ShardedToAllLinear(group.size() * (stop - start), linear.weight.shape[0], "bias" in linear, group)
    layer.weight = mx.contiguous(linear.weight[:, start:stop])
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
        head_dim = attention.q_proj.weight.shape[0] // attention.n_heads
        first, last = bounds(attention.n_kv_heads, size, rank)
        queries = (first * per_group * head_dim, last * per_group * head_dim)
        keys = (first * head_dim, last * head_dim)
        hidden = bounds(mlp.gate_proj.weight.shape[0], size, rank)
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
