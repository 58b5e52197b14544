"""The vocabulary split across tensor-parallel ranks: embedding rows, output logits and the loss.

A model's own `shard()` splits attention and MLP but leaves the token embedding and the output
projection whole on every rank, with the logits of the whole vocabulary: in a small model with a
large vocabulary (SmolLM2-135M: 28 M of its 135 M parameters) that is most of what a rank holds,
and the logits are most of a step's activations. Here each rank keeps a slice of the vocabulary
(Megatron-LM's vocab-parallel layers):

- the embedding looks up the tokens in its rows, zeros for the others, and an all-sum joins them;
- the output projection (the tied embedding, or `lm_head`) gives this rank's slice of the logits,
  its input's gradient summed across ranks on the way back;
- `sharded_cross_entropy` computes one process's cross-entropy from the slices: the log-sum-exp
  from every rank's sum of exponentials (after an all-max for stability), the target's logit from
  the rank that holds it.

Only models built as mlx-lm's llama family are (`model.model.embed_tokens`, an `nn.Embedding` or
`nn.QuantizedEmbedding`, and a tied or linear `lm_head`, float or quantized); others keep the
vocabulary whole. A quantized one is cut by rows, which its packing leaves whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import sum_gradients

from training.sharding import quantized
from training.sharding.parts import bounds


class VocabShard(nn.Module):
    """This rank's rows of an embedding or output projection of the vocabulary (weight: (V, H)),
    float or quantized (then with its scales and biases, and looked up or multiplied packed)."""

    def __init__(self, whole: nn.Module, group: Any):
        super().__init__()
        self.group = group
        self.start, self.stop = bounds(whole.weight.shape[0], group.size(), group.rank())
        # Its own copies: slices would keep the whole matrices' memory alive.
        for name, part in quantized.rows(whole, self.start, self.stop).items():
            setattr(self, name, part)
        self.packed = quantized.is_packed(whole)
        if self.packed:  # plain attributes, as mlx's quantized layers keep them
            self.group_size, self.bits, self.mode = quantized.settings(whole).values()

    def dequantize(self, dtype: mx.Dtype) -> None:
        """Hold this rank's rows as floats of `dtype` from now on."""
        self.weight = quantized.float_weight(self).astype(dtype)
        for name in quantized.PACKED_WITH:
            self.pop(name, None)
        self.packed = False

    def _rows(self, index: mx.array) -> mx.array:
        if not self.packed:
            return self.weight[index]
        biases = self.get("biases")
        biases = None if biases is None else biases[index]  # none in the fp4 and fp8 modes
        return mx.dequantize(self.weight[index], self.scales[index], biases, **quantized.settings(self))

    def __call__(self, tokens: mx.array) -> mx.array:
        """Embedding: the tokens' rows, joined from the ranks that hold them."""
        local = tokens - self.start
        mine = (local >= 0) & (local < self.stop - self.start)
        rows = self._rows(mx.where(mine, local, 0))
        return mx.distributed.all_sum(mx.where(mine[..., None], rows, 0), group=self.group)

    def as_linear(self, x: mx.array) -> mx.array:
        """Output projection: this rank's slice of the logits."""
        x = sum_gradients(self.group)(x)
        if not self.packed:
            return x @ self.weight.T
        return mx.quantized_matmul(x, self.weight, self.scales, self.get("biases"), transpose=True,
                                   **quantized.settings(self))


class VocabHead(nn.Module):
    """An untied `lm_head` as this rank's slice of the logits."""

    def __init__(self, head: nn.Module, group: Any):
        super().__init__()
        self.shard = VocabShard(head, group)

    def __call__(self, x: mx.array) -> mx.array:
        return self.shard.as_linear(x)


EMBEDDINGS = (nn.Embedding, nn.QuantizedEmbedding)
HEADS = (nn.Linear, nn.QuantizedLinear)


def shard_vocab(model: nn.Module, group: Any) -> VocabShard | None:
    """Split the model's vocabulary across `group` in place; its shard (None: left whole, the model
    is not built as this module expects)."""
    inner = getattr(model, "model", None)
    embedding = getattr(inner, "embed_tokens", None)
    head = getattr(model, "lm_head", None) if "lm_head" in model else None
    if type(embedding) not in EMBEDDINGS or (head is not None and type(head) not in HEADS):
        return None
    if head is not None and "bias" in head:
        return None
    shard = VocabShard(embedding, group)
    inner.embed_tokens = shard
    if head is not None:
        model.lm_head = VocabHead(head, group)
    return shard


def sharded_cross_entropy(shard: VocabShard) -> Callable[[mx.array, mx.array], mx.array]:
    """`nn.losses.cross_entropy(logits, targets)` (per token, no reduction) from this rank's slice
    of the logits; every rank gets the whole result."""
    group, start, width = shard.group, shard.start, shard.stop - shard.start

    def cross_entropy(logits: mx.array, targets: mx.array) -> mx.array:
        top = mx.stop_gradient(mx.distributed.all_max(logits.max(axis=-1), group=group))
        total = mx.distributed.all_sum(mx.exp(logits - top[..., None]).sum(axis=-1), group=group)
        local = targets - start
        mine = (local >= 0) & (local < width)
        picked = mx.take_along_axis(logits, mx.where(mine, local, 0)[..., None], axis=-1).squeeze(-1)
        target = mx.distributed.all_sum(mx.where(mine, picked, 0), group=group)
        return top + mx.log(total) - target

    return cross_entropy
