"""Tensor-parallel LoRA and DoRA: every rank holds a shard of the model and trains on the whole batch.

mlx-lm shards models for inference only (`Model.shard(group)`, `sharded_load`), and its LoRA layers
wrap `nn.Linear`, not the sharded layers. Here:

1. `load` reads the model lazily, lets mlx-lm place and initialize the LoRA layers on the whole
   model (the same layers and random draws as one process), takes them off again, lets the
   model's own `shard()` split attention and MLP (or, when the ranks do not divide its heads,
   splits them by whole key-value head groups: training/sharding/head_groups.py), puts a
   `ShardedLoRALinear` around every sharded layer that had LoRA, and splits the vocabulary
   (training/sharding/vocab_parallel.py). The weights are then read one layer at a time, each rank keeping
   its shard only: no rank ever holds the whole model.
2. `ShardedLoRALinear` shards LoRA with its base layer. Column-parallel (all-to-sharded: the
   input is whole on every rank, the output split): `lora_b`'s output is split, `lora_a` is
   whole, and the rank-r activation sums its gradients across ranks on the way back (it feeds
   every rank's output shard). Row-parallel (sharded-to-all: the input split, the output summed):
   `lora_a`'s input is split, and a rank-r all-sum joins the ranks' parts before the whole
   `lora_b`. Every replicated matrix gets the same gradient on every rank: no averaging. Answering
   (not training: `invoke serve`), a row-parallel layer joins its base's and LoRA's parts in one
   all-sum, not two: the all-sums are what a token costs across ranks.
   `ShardedDoRALinear` adds DoRA's magnitudes, one per output: cut like the outputs in a
   column-parallel layer (whose rows each rank holds whole, and so their norms), whole in a
   row-parallel one, where each adapted row's norm is the root of the ranks' summed squares.
3. `Layout` gathers sharded arrays into whole ones (adapters and optimizer state, for saving) and
   cuts whole ones into this rank's shard (for resuming): files are always those of one process,
   whatever the layout that wrote or reads them.

The data side is one data-parallel rank: every rank computes the same whole batch (see
`Layout.data_group`), which the trainer must not average across ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import (
    AllToShardedLinear,
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
    ShardedToAllLinear,
    sum_gradients,
)
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm import load as mlx_lm_load
from mlx_lm.tuner.dora import DoRALinear
from mlx_lm.tuner.lora import LoRALinear
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import _get_classes

from training.config import ConfigError
from training.distributed import DistributedError, detect_launch
from training.model import quantization
from training.sharding import head_groups, quantized, vocab_parallel
from training.sharding.parts import bounds

# What a model's own shard() splits into equal parts, one per rank.
SHARDED_SIZES = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
COLUMN = (AllToShardedLinear, QuantizedAllToShardedLinear)
ROW = (ShardedToAllLinear, QuantizedShardedToAllLinear)


# --- the layer -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cut:
    """The part of a whole matrix (`name`, of `total` along `axis`) one rank holds: [start, stop)."""

    name: str
    axis: int
    start: int
    stop: int
    total: int


class ShardedLoRALinear(nn.Module):
    """mlx-lm's LoRALinear around a sharded linear layer; the same parameter names and maths.

    `held`: the base layer's output rows (column-parallel) or input columns (row-parallel)
    [start, stop) this rank holds; LoRA's matching part is `cut`.
    """

    def __init__(self, base: nn.Module, lora: LoRALinear | DoRALinear, group: Any, held: tuple[int, int]):
        super().__init__()
        self.linear = base
        self.dropout = lora.dropout
        self.scale = lora.scale
        self.group = group
        self.column = isinstance(base, COLUMN)
        start, stop = held
        if self.column:
            self.lora_a = lora.lora_a
            self.lora_b = lora.lora_b[:, start:stop]
            self.cut = Cut("lora_b", 1, start, stop, lora.lora_b.shape[1])
        else:
            self.lora_a = lora.lora_a[start:stop]
            self.lora_b = lora.lora_b
            self.cut = Cut("lora_a", 0, start, stop, lora.lora_a.shape[0])

    @property
    def cuts(self) -> tuple[Cut, ...]:
        """Every trainable parameter of this layer that is a part of a whole one, and which part."""
        return (self.cut,)

    def _dropped(self, x: mx.array) -> mx.array:
        if self.column or self.dropout._p_1 == 1 or not self.training:
            return self.dropout(x)
        # The input is this rank's slice of the features: draw the whole input's mask, as one
        # process does, and keep this rank's slice, so that dropout masks the same features.
        mask = mx.random.bernoulli(self.dropout._p_1, (*x.shape[:-1], self.cut.total))
        return (mask[..., self.cut.start:self.cut.stop] * x) * (1 / self.dropout._p_1)

    def _low_rank(self, x: mx.array) -> mx.array:
        """The rank-r activation x A, whole on every rank."""
        h = self._dropped(x) @ self.lora_a
        if self.column:
            return sum_gradients(self.group)(h)  # it feeds every rank's output part
        return mx.distributed.all_sum(h, group=self.group)  # each rank holds a part of the input

    def _answered(self, x: mx.array, weight: mx.array | None = None) -> mx.array:
        """Row-parallel, not training: the ranks' parts of the base's and LoRA's outputs joined by one
        all-sum, as sum_r (x_r W_r^T + s (x_r A_r) B) = x W^T + s (x A) B, where training sums
        x A first (two all-sums a layer). Only to answer: under a gradient, `lora_b`'s would be each
        rank's part, not the whole one. `weight`: the base's as floats (DoRA), else its own."""
        base = x @ weight.T if weight is not None else unsummed(self.linear, x)
        z = (x @ self.lora_a) @ self.lora_b
        return mx.distributed.all_sum(base + (self.scale * z).astype(x.dtype), group=self.group)

    def __call__(self, x: mx.array) -> mx.array:
        if not (self.column or self.training):
            y = self._answered(x)
            return y + self.linear["bias"] if "bias" in self.linear else y
        y = self.linear(x)
        z = self._low_rank(x) @ self.lora_b
        return y + (self.scale * z).astype(x.dtype)


class ShardedDoRALinear(ShardedLoRALinear):
    """mlx-lm's DoRALinear around a sharded linear layer: LoRA's parts as ShardedLoRALinear cuts them,
    and the magnitude `m` (one per output) cut like the outputs. The norm of each adapted weight row
    is one process's: whole on each rank in a column-parallel layer (it holds whole rows), and the
    sum of the ranks' squared parts in a row-parallel one."""

    def __init__(self, base: nn.Module, dora: DoRALinear, group: Any, held: tuple[int, int]):
        super().__init__(base, dora, group, held)
        start, stop = held
        self.m = dora.m[start:stop] if self.column else dora.m

    @property
    def cuts(self) -> tuple[Cut, ...]:
        if not self.column:
            return (self.cut,)
        return (self.cut, Cut("m", 0, self.cut.start, self.cut.stop, self.cut.total))

    def _row_norms(self, weight: mx.array) -> mx.array:
        adapted = weight + (self.scale * self.lora_b.T) @ self.lora_a.T
        if self.column:
            return mx.linalg.norm(adapted, axis=1)
        squares = mx.distributed.all_sum(mx.sum(mx.square(adapted), axis=1), group=self.group)
        return mx.sqrt(squares)

    def __call__(self, x: mx.array) -> mx.array:
        weight = quantized.float_weight(self.linear)  # a quantized base's dequantized, as mlx-lm's DoRA does
        if not (self.column or self.training):
            out = self._answered(x, weight)
        else:
            y = (sum_gradients(self.group)(x) @ weight.T if self.column
                 else mx.distributed.all_sum(x @ weight.T, group=self.group))
            out = y + (self.scale * (self._low_rank(x) @ self.lora_b)).astype(x.dtype)
        denom = mx.stop_gradient(self._row_norms(weight))
        out = (self.m / denom).astype(x.dtype) * out
        if "bias" in self.linear:
            out = out + self.linear["bias"]
        return out


def unsummed(layer: nn.Module, x: mx.array) -> mx.array:
    """A row-parallel layer's (float or quantized) product of this rank's part of the input, before
    the ranks' parts are summed and the bias added: its __call__ without the all-sum."""
    if not quantized.is_packed(layer):
        return x @ layer["weight"].T
    return mx.quantized_matmul(x, layer["weight"], scales=layer["scales"], biases=layer.get("biases"),
                               transpose=True, group_size=layer.group_size, bits=layer.bits,
                               mode=getattr(layer, "mode", "affine"))


# --- loading a shard of the model ------------------------------------------------------------------


def has_shard(config: Mapping[str, Any]) -> bool:
    """Whether mlx-lm's model for this config.json can shard itself (a `shard()` method)."""
    try:
        model_class, _ = _get_classes(dict(config))
    except (ValueError, KeyError, ImportError, SystemExit):  # some model files exit when a package is missing
        return False
    return hasattr(model_class, "shard")


def shard_problems(
    config: Mapping[str, Any], ranks: int, name: str, shardable: bool | None = None
) -> list[str]:
    """Why the model of this config.json cannot be split across `ranks` by its own shard() (empty
    when it can). `shardable`: whether its class has shard() (None: look it up in mlx-lm)."""
    if not (has_shard(config) if shardable is None else shardable):
        return [f"model {name} ({config.get('model_type', 'no model_type')}) cannot be sharded: mlx-lm "
                "has no shard() for its architecture; train it with --parallel data"]
    undivided = _undivided(config, ranks)
    if not undivided or head_groups.splits(config, ranks):
        return quantized.problems(config, ranks, name)
    groups = config.get("num_key_value_heads") or config.get("num_attention_heads")
    problem = f"model {name}: {', '.join(undivided)}, which {ranks} ranks do not divide, and "
    if not isinstance(groups, int) or groups < 2:
        return [problem + "its attention has one key-value head, which no rank can share: train it "
                "with --parallel data"]
    return [problem + f"its {groups} key-value head groups cannot go whole to each of {ranks} ranks: "
            f"it shards across at most {groups} ranks"]


def _undivided(config: Mapping[str, Any], ranks: int) -> list[str]:
    """The sizes the model's own shard() would split into equal parts that `ranks` do not divide."""
    return [f"{key} is {config[key]}" for key in SHARDED_SIZES
            if isinstance(config.get(key), int) and config[key] % ranks]


def _evaluate_by_layer(model: nn.Module) -> None:
    """Read the lazily loaded weights a layer at a time: each whole tensor is read, cut, and let go
    before the next layer's, so a rank holds its shard and at most one layer whole."""
    for layer in model.layers:
        mx.eval(layer.parameters())
    mx.eval(model.parameters())


def check_num_layers(model: nn.Module, num_layers: int) -> None:
    if num_layers > len(model.layers):
        raise ConfigError(f"num_layers {num_layers}: the model has only {len(model.layers)} layers")


def load(
    model_name: str, group: Any, num_layers: int, lora_parameters: dict[str, Any], seed: int,
    dora: bool = False, dequantize_ranks: Sequence[int] = (),
) -> tuple[nn.Module, Any, str]:
    """This rank's shard of the model with its LoRA (or DoRA) layers, the tokenizer, and its base
    weights in a few words. They are placed and initialized as mlx-lm does for one process that
    seeds mx.random with `seed` once its model is built. A quantized model is sharded packed, and
    its shards dequantized on `dequantize_ranks` (the cuts are the packed model's on every rank)."""
    model, tokenizer, config = mlx_lm_load(model_name, lazy=True, return_config=True)
    if problems := shard_problems(config, group.size(), model_name, hasattr(model, "shard")):
        raise ConfigError("cannot train with parallel: tensor:\n  " + "\n  ".join(problems))
    dequantizing = quantization.dequantizes(config, group.rank(), dequantize_ranks)
    dtype = quantization.float_dtype(model) if dequantizing else None
    check_num_layers(model, num_layers)
    mx.random.seed(seed)
    model.freeze()
    linear_to_lora_layers(model, num_layers, lora_parameters, use_dora=dora)
    after_init = mx.random.state[0]
    loras = {path: m for path, m in model.named_modules() if isinstance(m, (LoRALinear, DoRALinear))}
    model.update_modules(tree_unflatten([(path, m.linear) for path, m in loras.items()]))
    held = shard_base(model, config, group)  # new layers draw random placeholders: the RNG is set back
    model.update_modules(tree_unflatten(list(sharded_adapter(model, loras, group, held).items())))
    vocab_parallel.shard_vocab(model, group)
    if dtype is not None:
        quantized.dequantize_shards(model, dtype)
    model.freeze()
    model.unfreeze(keys=["lora_a", "lora_b", *(["m"] if dora else [])], strict=False)
    high, low = after_init.tolist()
    mx.random.seed((high << 32) | low)
    _evaluate_by_layer(model)
    return model, tokenizer, quantization.base_weights(config, dtype)


def sharded_adapter(model: nn.Module, loras: Mapping[str, LoRALinear | DoRALinear], group: Any,
                    held: Mapping[int, tuple[int, int]]) -> dict[str, nn.Module]:
    """The LoRA (or DoRA) layers `loras`, made for the whole model, over its shards by path: each
    sharded base wrapped with this rank's part of its adapter, a base every rank holds whole keeping
    mlx-lm's layer. `held`: shard_base's parts by layer id."""
    layers = dict(model.named_modules())

    def wrapped(path: str, lora: LoRALinear | DoRALinear) -> nn.Module:
        base = layers[path]
        if not isinstance(base, COLUMN + ROW):
            return _rewrapped(lora, base)
        kind = ShardedDoRALinear if isinstance(lora, DoRALinear) else ShardedLoRALinear
        return kind(base, lora, group, held.get(id(base)) or _equal_part(base, lora, group))

    return {path: wrapped(path, lora) for path, lora in loras.items()}


def shard_base(model: nn.Module, config: Mapping[str, Any], group: Any) -> dict[int, tuple[int, int]]:
    """Split the model across `group`: by its own shard() when the ranks divide its heads and MLP,
    else by whole key-value head groups (training/sharding/head_groups.py). The part each layer sharded
    that way holds, by the layer's id (none: the model's own shard(), equal parts)."""
    packed = any(quantized.is_packed(m) for _, m in model.named_modules())
    # A quantized llama-family model is cut by head groups and whole quantization groups, which are
    # equal parts when they can be: the model's own shard() cuts the packed inputs blindly.
    if not _undivided(config, group.size()) and (not packed or head_groups.fits(model) is not None):
        model.shard(group)
        _check_packed_cuts(model)
        return {}
    if why := head_groups.fits(model):
        raise ConfigError(f"the {group.size()} ranks do not divide the attention heads of this model, "
                          f"and its key-value head groups cannot be split unevenly: {why}")
    return {id(layer): part for layer, part in head_groups.shard(model, group)}


def _check_packed_cuts(model: nn.Module) -> None:
    """Stop when the model's own shard() cut a quantized layer's inputs inside a group (its packed
    weight and its scales then disagree on how many inputs the rank holds)."""
    for path, layer in model.named_modules():
        if isinstance(layer, QuantizedShardedToAllLinear):
            inputs = layer.weight.shape[-1] * quantized.WORD_BITS // layer.bits
            if inputs != layer.scales.shape[-1] * layer.group_size:
                how = quantized.described(layer)
                raise ConfigError(f"{path}: its {how} inputs do not split into whole groups across "
                                  f"{layer.group.size()} ranks; train with --parallel data, or on a "
                                  "number of nodes that divides its groups")


def _equal_part(base: nn.Module, lora: LoRALinear | DoRALinear, group: Any) -> tuple[int, int]:
    """The part of a layer the model's own shard() gave this rank: an equal one."""
    total = lora.lora_b.shape[1] if isinstance(base, COLUMN) else lora.lora_a.shape[0]
    return bounds(total, group.size(), group.rank())


def _rewrapped(lora: LoRALinear | DoRALinear, base: nn.Module) -> LoRALinear | DoRALinear:
    """A LoRA layer whose base shard() left whole (replicated on every rank) keeps mlx-lm's layer
    (a DoRA layer keeps its magnitudes: the base is the same weights)."""
    lora.linear = base
    return lora


# --- whole arrays and this rank's shards -----------------------------------------------------------


@dataclass(frozen=True)
class OneRank:
    """A data-parallel group of one: under tensor parallelism every rank computes the whole batch."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


@dataclass(frozen=True)
class Layout:
    """How the trainable parameters lie across the ranks: `cuts` maps each sharded one to the part
    of it this rank holds (empty: every rank holds every parameter whole, as in data parallelism)."""

    parallel: str
    group: Any
    cuts: Mapping[str, Cut] = field(default_factory=dict)
    vocab: vocab_parallel.VocabShard | None = None  # this rank's slice of the vocabulary, if split

    @classmethod
    def of(cls, parallel: str, group: Any, model: nn.Module) -> Layout:
        modules = model.named_modules()
        cuts = {f"{path}.{cut.name}": cut for path, module in modules
                if isinstance(module, ShardedLoRALinear) for cut in module.cuts}
        vocab = [module for _, module in modules if isinstance(module, vocab_parallel.VocabShard)]
        return cls(parallel, group, cuts, vocab[0] if vocab else None)

    @property
    def cross_entropy(self) -> Callable[[mx.array, mx.array], mx.array]:
        """The per-token loss of the model's logits (this rank's slice of them, when split)."""
        return vocab_parallel.sharded_cross_entropy(self.vocab) if self.vocab else nn.losses.cross_entropy

    @property
    def tensor(self) -> bool:
        return self.parallel == "tensor"

    @property
    def split_parameters(self) -> bool:
        """Whether joining the ranks' parameters is a collective (every rank takes part)."""
        return self.tensor

    @property
    def data_group(self) -> Any:
        """The ranks that split each batch and average their gradients."""
        return OneRank() if self.tensor else self.group

    @property
    def counts_tokens(self) -> bool:
        """Whether this rank's tokens count in the run's sums (each batch's once, not once per shard)."""
        return not self.tensor or self.group.rank() == 0

    def cut(self, name: str) -> Cut | None:
        """The part of `name` (a parameter, or an optimizer state of one: `<param>.m`) this rank holds."""
        return self.cuts.get(name) or self.cuts.get(name.rpartition(".")[0])

    def whole(self, arrays: Mapping[str, mx.array]) -> dict[str, mx.array]:
        """Every rank's parts joined into whole arrays, on every rank (a collective when sharded):
        each rank's part in place among zeros, summed across the ranks (parts may differ in size,
        which all_gather does not allow; adding zeros is exact)."""
        out = {}
        for name in sorted(arrays):  # the same order on every rank
            value, cut = arrays[name], self.cut(name)
            if cut is not None:
                pad = [(0, 0)] * value.ndim
                pad[cut.axis] = (cut.start, cut.total - cut.stop)
                value = mx.distributed.all_sum(mx.pad(value, pad), group=self.group, stream=mx.cpu)
            out[name] = value
        mx.eval(out)
        return out

    def shard(self, arrays: Mapping[str, mx.array]) -> dict[str, mx.array]:
        """This rank's part of whole arrays."""
        out = {}
        for name, value in arrays.items():
            if (cut := self.cut(name)) is not None:
                index = [slice(None)] * value.ndim
                index[cut.axis] = slice(cut.start, cut.stop)
                value = value[tuple(index)]
            out[name] = value
        return out

    def replicated(self, model: nn.Module) -> dict[str, mx.array]:
        """The trainable parameters every rank holds whole (and must hold equal)."""
        return {k: v for k, v in tree_flatten(model.trainable_parameters()) if self.cut(k) is None}


def check_collectives(group: Any, environ: Mapping[str, str]) -> None:
    """Stop (DistributedError) when the ranks' backend lacks a collective tensor parallelism needs:
    all_sum in the sharded layers and to gather the adapters, all_max in the loss of a split
    vocabulary."""
    launch = detect_launch(environ)
    backend = launch.backend if launch else "default"
    for name, op in (("all_sum", mx.distributed.all_sum), ("all_max", mx.distributed.all_max)):
        try:
            mx.eval(op(mx.ones((2,)), group=group, stream=mx.cpu))
        except RuntimeError as error:
            raise DistributedError(
                f"the {backend} backend cannot {name} ({error}), which tensor-parallel training needs; "
                "use the ring, jaccl or mpi backend"
            ) from None
