"""How the trainable parameters lie across a pipeline's ranks (the `Layout` of
training/sharding/tensor_parallel.py): each stage holds its own layers whole, under names that number
them from 0 (training/sharding/pipeline.py), and with pipeline and data together several replicas of
the stages split each batch.

Ranks: rank = replica x stages + stage. A replica's ranks run its share of the batch through the
stages; a stage's replicas then hold the same parameters and each its own share's gradients, which
are averaged among them only (the stages hold different parameters). Averaging takes one `all_sum`
among the stage's replicas where the backend can split its group (MPI); the ring and JACCL backends
cannot, and there each stage's gradients in turn are summed over every rank, the other stages adding
zeros: the same sums, stages times the traffic, at most one stage's gradients held at once.
"""

from __future__ import annotations

import atexit
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from training.sharding.pipeline import StageModel
from training.sharding.tensor_parallel import OneRank


@dataclass(frozen=True)
class Replicas:
    """The ranks that split each batch (the trainer's data group): one per replica of the stages."""

    index: int
    count: int

    def rank(self) -> int:
        return self.index

    def size(self) -> int:
        return self.count


class SplitGroup:
    """A group split off the run's, let go of as Python exits: MLX finalizes MPI at exit, and a split
    communicator freed after that aborts the process ("MPI_Comm_free() ... after MPI_FINALIZE"),
    turning a finished run's exit code into a failure."""

    def __init__(self, group: Any):
        self.group = group
        atexit.register(self.release)  # Python's exit handlers run before MPI is finalized

    def release(self) -> None:
        self.group = None


def stage_group(group: Any, stage: int, stages: int) -> SplitGroup | None:
    """A group of this stage's replicas (every rank calls this, as MPI's split wants), or None where
    the backend splits no group (ring, JACCL) or there is one replica."""
    if group.size() == stages:
        return None
    try:
        return SplitGroup(group.split(stage, group.rank() // stages))
    except RuntimeError:  # "[ring] Group split not supported."
        return None


@dataclass(frozen=True)
class PipelineLayout:
    """The stages' `Layout`: their files as one process's, and a stage's replicas averaging."""

    group: Any
    stage: StageModel
    replicas_group: SplitGroup | None = None  # this stage's replicas (stage_group); None: see the docstring
    parallel: str = "pipeline"
    _sizes: list[int] = field(default_factory=list)  # each stage's gradients' elements, once known

    @property
    def replicas(self) -> int:
        return self.group.size() // self.stage.stages

    @property
    def replica(self) -> int:
        return self.group.rank() // self.stage.stages

    @property
    def cross_entropy(self) -> Callable[[mx.array, mx.array], mx.array]:
        return nn.losses.cross_entropy

    @property
    def tensor(self) -> bool:
        return False

    @property
    def split_parameters(self) -> bool:
        """Whether joining the ranks' parameters is a collective (every rank takes part)."""
        return True

    @property
    def data_group(self) -> Any:
        """The ranks that split each batch: the replicas (one: every stage sees the whole batch)."""
        return Replicas(self.replica, self.replicas) if self.replicas > 1 else OneRank()

    @property
    def counts_tokens(self) -> bool:
        return self.stage.last

    def cut(self, name: str) -> None:
        return None

    def average(self, gradients: Any) -> Any:
        """This stage's gradients averaged among its replicas (mlx-lm's `average_gradients`, which
        would average over every rank): one flat float32 sum, cut back into the tree."""
        if self.replicas == 1:
            return gradients
        named = tree_flatten(gradients)
        flat = mx.concatenate([g.reshape(-1).astype(mx.float32) for _, g in named])
        if self.replicas_group is not None:
            summed = mx.distributed.all_sum(flat, group=self.replicas_group.group, stream=mx.cpu)
        else:
            summed = self._summed_stage_by_stage(flat)
        out, start = [], 0
        for name, g in named:
            mean = summed[start:start + g.size] / self.replicas
            out.append((name, mean.reshape(g.shape).astype(g.dtype)))
            start += g.size
        return tree_unflatten(out)

    def sync_seconds(self, model: nn.Module, repeats: int = 5) -> float:
        """Seconds one averaging of this stage's gradients among its replicas takes, timed alone (every
        rank calls it; 0.0 with one replica), as training/distributed.py times data parallelism's."""
        if self.replicas == 1:
            return 0.0
        zeros = tree_unflatten([(name, mx.zeros(p.shape, dtype=p.dtype))
                                for name, p in tree_flatten(model.trainable_parameters())])
        times = []
        for _ in range(repeats + 1):  # the first one warms the connections up
            tic = time.perf_counter()
            mx.eval(self.average(zeros))
            times.append(time.perf_counter() - tic)
        return sorted(times[1:])[repeats // 2]

    def _summed_stage_by_stage(self, flat: mx.array) -> mx.array:
        """`flat` summed among this stage's replicas on a backend without subgroups (see the docstring)."""
        if not self._sizes:
            sizes = mx.distributed.all_gather(mx.array([flat.size]), group=self.group, stream=mx.cpu)
            self._sizes.extend(sizes.tolist()[:self.stage.stages])
        summed = flat
        for stage, size in enumerate(self._sizes):
            part = flat if stage == self.stage.stage else mx.zeros((size,), dtype=mx.float32)
            total = mx.distributed.all_sum(part, group=self.group, stream=mx.cpu)
            mx.eval(total)
            if stage == self.stage.stage:
                summed = total
        return summed

    def whole(self, arrays: Mapping[str, mx.array]) -> dict[str, mx.array]:
        """Every stage's arrays joined under one process's names, on every rank: first the names, shapes
        and holders of all of them (one gather), then each array a stage holds summed among zeros
        on the others (its first replica's: the replicas hold the same); what every rank holds alike
        (an optimizer's step) passes as it is."""
        mine = {self.stage.global_name(name): value for name, value in arrays.items()}
        catalogue = self._catalogue(mine)
        out = {}
        for name in sorted(catalogue):
            shape, dtype, holders = catalogue[name]
            if holders == self.group.size():
                out[name] = mine[name]
                continue
            value = mine.get(name) if self.replica == 0 else None
            part = value if value is not None else mx.zeros(shape, dtype=dtype)
            out[name] = mx.distributed.all_sum(part, group=self.group, stream=mx.cpu)
            mx.eval(out[name])
        return out

    def _catalogue(self, mine: Mapping[str, mx.array]) -> dict[str, tuple[tuple[int, ...], Any, int]]:
        """Every rank's names with their shape, dtype and how many ranks hold them."""
        listed = json.dumps({name: [list(value.shape), str(value.dtype).rpartition(".")[2]]
                             for name, value in mine.items()}).encode()
        sizes = mx.distributed.all_gather(mx.array([len(listed)]), group=self.group, stream=mx.cpu).tolist()
        padded = mx.array(list(listed.ljust(max(sizes))), dtype=mx.uint8)[None]
        gathered = mx.distributed.all_gather(padded, group=self.group, stream=mx.cpu)
        catalogue: dict[str, tuple[tuple[int, ...], Any, int]] = {}
        for row, size in zip(gathered.tolist(), sizes, strict=True):
            for name, (shape, dtype) in json.loads(bytes(row[:size])).items():
                held = catalogue.get(name)
                catalogue[name] = (tuple(shape), getattr(mx, dtype), (held[2] if held else 0) + 1)
        return catalogue

    def shard(self, arrays: Mapping[str, mx.array]) -> dict[str, mx.array]:
        """This stage's part of one process's arrays, under this stage's names."""
        out = {}
        for name, value in arrays.items():
            local = self.stage.local_name(name)
            if local is not None:
                out[local] = value
        return out

    def replicated(self, model: nn.Module) -> dict[str, mx.array]:
        """The trainable parameters held alike on every rank: none, each stage holds its own."""
        return {}
