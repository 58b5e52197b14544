"""One batch, several adapters: each row of mlx-lm's continuous batch answered with the adapter its
request picked, as multi-LoRA GPU servers (vLLM, SGLang) batch them.

mlx-lm's BatchGenerator keeps its rows' order through every insert, merge, split and filter of its
batches, and keeps each row's KV cache in step with it. So the adapter of each row rides in the
cache too: one more cache entry, `RowPicks`, that merges, filters and extracts as its rows do. The
model mlx-lm is given (`Mixing`) reads it on every call and, when the rows all picked one adapter,
answers with that adapter's own layers, exactly as a batch for that adapter alone is answered; when
they differ, each adapted layer is a `ByRow`, which sends each group of rows through its adapter's
layer (the base's for rows of the base or of an adapter that leaves the layer alone) and puts the
rows back in order. Everything else (attention, the caches, sampling) is the one batch's. Where every
adapter of a layer is a plain LoRA over it (one process), the base runs once over every row and each
LoRA's term is added where its rows are: per row, the same sum in the same order as LoRALinear's.

A row is thus computed by the same layers, whole or sharded, LoRA or DoRA, float or quantized, as
when its adapter is served alone; under tensor parallelism every rank holds the same rows in the same
order (mlx-lm shares each request with every rank), so the ranks take the same collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
from mlx_lm.tuner.lora import LoRALinear

MIXED = "mixed"  # the served model's state while a batch mixes adapters


class RowPicks:
    """The cache entry that carries each row's pick (an index into the served names) through mlx-lm's
    batch operations; it holds no tensors and is never shown to the model's layers."""

    def __init__(self, rows: Sequence[int]):
        self.rows = list(rows)

    @classmethod
    def merge(cls, caches: Sequence[RowPicks]) -> RowPicks:
        return cls([row for cache in caches for row in cache.rows])

    def extend(self, other: RowPicks) -> None:
        self.rows.extend(other.rows)

    def filter(self, keep: Sequence[int]) -> None:
        self.rows = [self.rows[i] for i in keep]

    def extract(self, index: int) -> RowPicks:
        return RowPicks([self.rows[index]])

    def prepare(self, **_: Any) -> None:
        pass

    def finalize(self) -> None:
        pass

    @property
    def state(self) -> list:
        return []

    @property
    def nbytes(self) -> int:
        return 0

    def empty(self) -> bool:
        return False

    def size(self) -> int:
        return 0

    def is_trimmable(self) -> bool:
        return True  # tokens trimmed off a cached prompt leave its pick as it was

    def trim(self, n: int) -> int:
        return n


@dataclass(frozen=True)
class Grouping:
    """A batch's rows grouped by the layer that answers them: (layer, rows) pairs in the order their
    outputs are joined, and the permutation that puts the joined rows back (None: one group)."""

    parts: tuple[tuple[int, mx.array | None], ...]
    inverse: mx.array | None


class Picks:
    """What the served model's layers need to know of the batch: the pick of the request being
    admitted now (its cache is made or fetched next) and the pick of each row of the current call."""

    def __init__(self) -> None:
        self.admitting = 0
        self.rows: list[int] = []
        self._groupings: dict[tuple[int, ...], Grouping] = {}
        self._masks: dict[tuple[int, ...], tuple[tuple[int, mx.array], ...]] = {}

    def grouping(self, owner: tuple[int, ...]) -> Grouping:
        """The current rows grouped by layer, for a layer whose `owner[pick]` says which of its
        choices answers a pick."""
        key = tuple(owner[pick] for pick in self.rows)
        found = self._groupings.get(key)
        if found is None:
            groups: dict[int, list[int]] = {}
            for row, choice in enumerate(key):
                groups.setdefault(choice, []).append(row)
            if len(groups) == 1:
                found = Grouping(((key[0], None),), None)
            else:
                order = [row for rows in groups.values() for row in rows]
                inverse = sorted(range(len(order)), key=order.__getitem__)
                found = Grouping(tuple((choice, mx.array(rows)) for choice, rows in groups.items()),
                                 mx.array(inverse))
            if len(self._groupings) > 4096:  # a long-running server sees many batch shapes
                self._groupings.clear()
            self._groupings[key] = found
        return found


    def masks(self, owner: tuple[int, ...]) -> tuple[tuple[int, mx.array], ...]:
        """For each of a layer's choices but the base that some current row takes: which rows,
        as a (rows, 1, 1) mask."""
        key = tuple(owner[pick] for pick in self.rows)
        found = self._masks.get(key)
        if found is None:
            found = tuple((choice, mx.array([k == choice for k in key])[:, None, None])
                          for choice in sorted(set(key) - {0}))
            if len(self._masks) > 4096:
                self._masks.clear()
            self._masks[key] = found
        return found


class ByRow(nn.Module):
    """One adapted layer of a batch that mixes adapters: each row through the layer of its pick."""

    def __init__(self, choices: Sequence[nn.Module], owner: Sequence[int], picks: Picks):
        super().__init__()
        self.choices = list(choices)  # the base layer first, then each adapter's layer here
        # Callables, not tuples: mlx's Module would keep a tuple among its parameters.
        self._grouping = partial(picks.grouping, tuple(owner))
        self._masks = partial(picks.masks, tuple(owner))
        self._loras_over_base = all(type(c) is LoRALinear and c.linear is choices[0] for c in choices[1:])

    def __call__(self, x: mx.array) -> mx.array:
        grouping = self._grouping()
        if grouping.inverse is None:
            return self.choices[grouping.parts[0][0]](x)
        if self._loras_over_base:
            # LoRALinear's own sum, y + (scale * z).astype(dtype), on its rows; 0 added on the others.
            y = self.choices[0](x)
            for choice, rows in self._masks():
                lora = self.choices[choice]
                z = (lora.dropout(x) @ lora.lora_a) @ lora.lora_b
                y = y + mx.where(rows, (lora.scale * z).astype(x.dtype), 0)
            return y
        joined = mx.concatenate([self.choices[choice](x[rows]) for choice, rows in grouping.parts], axis=0)
        return mx.take(joined, grouping.inverse, axis=0)


def by_row_layers(bare: dict[str, nn.Module], sets: dict[str, dict[str, nn.Module]],
                  picks: Picks) -> dict[str, ByRow]:
    """A ByRow for every adapted path; picks are indices into [base, *sets]."""
    layers = {}
    for path, base in bare.items():
        choices, owner = [base], [0]
        for layer_set in sets.values():
            if path in layer_set:
                owner.append(len(choices))
                choices.append(layer_set[path])
            else:
                owner.append(0)
        layers[path] = ByRow(choices, owner, picks)
    return layers


class Mixing:
    """The model mlx-lm's server and BatchGenerator call: the served model, each call answering every
    row with the adapter it picked. `served` is training/serve/model.py's Served."""

    def __init__(self, served: Any, picks: Picks):
        self.served, self.picks = served, picks
        self.by_row = by_row_layers(served.bare, served.sets, picks)

    @property
    def layers(self) -> list[nn.Module]:
        return self.served.model.layers

    def make_cache(self) -> list[Any]:
        """The model's own cache, then the admitted request's pick."""
        return [*make_prompt_cache(self.served.model), RowPicks([self.picks.admitting])]

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None, **kwargs: Any) -> mx.array:
        if cache and isinstance(cache[-1], RowPicks):
            rows, cache = cache[-1].rows, cache[:-1]
        else:
            rows = [self.picks.admitting] * inputs.shape[0]
        if len(rows) != inputs.shape[0]:
            raise RuntimeError(f"{inputs.shape[0]} rows in the batch, {len(rows)} picks: out of step")
        if len(set(rows)) == 1:
            self.served.use(self.served.names[rows[0]])
        else:
            self.picks.rows = rows
            self.served.use_layers(MIXED, self.by_row)
        return self.served.model(inputs, cache=cache, **kwargs)


class PromptCaches(LRUPromptCache):
    """mlx-lm's prompt cache, kept apart per adapter: a prefix computed with one adapter is never
    reused for another's request."""

    def __init__(self, picks: Picks, max_size: int):
        super().__init__(max_size)
        self.picks = picks

    def fetch_nearest_cache(self, model: Any, tokens: list[int]):
        return super().fetch_nearest_cache((model, self.picks.admitting), tokens)

    def insert_cache(self, model: Any, tokens: list[Any], prompt_cache: list[Any], *args: Any, **kwargs: Any):
        return super().insert_cache((model, prompt_cache[-1].rows[0]), tokens, prompt_cache, *args, **kwargs)
