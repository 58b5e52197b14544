"""A step's time under a layout, from what this project measured of the cluster: each node's pace at
this fine-tune (`invoke bench.calibrate`: one rank training the whole model alone, at two batch
sizes), and the cluster link's bandwidth and latency (`invoke bench.links`: its slowest pair).

A node's pace is a line through its two calibrated steps: seconds per pass over the model that do not
grow with its tokens (launching kernels, the optimizer's update, a GPU not yet full), then tokens/s
past them. A small share, a tensor shard's whole batch and each pipeline micro-batch pay the fixed
part in full (a pipeline micro-batch its stage's share of the layers), which one figure of tokens/s
taken at one batch size cannot say (on the lab's CPUs the fixed part is within the noise; a Mac's
GPU, which a small batch does not fill, is where it counts).

- data: the slowest rank's share at its speed, then the gradients' all-reduce;
- tensor: 1/N of the batch's compute on each rank, the slowest setting the pace, and four all-sums
  of the hidden state per layer (two forward, two backward) over the link;
- pipeline: (micro-batches + stages - 1) slots of the slowest stage's micro-batch (its share of
  the layers, its forward recomputed in the backward pass: 4 units of a layer where a data rank
  spends 3, but the last stage's), an activation and its gradient sent per micro-batch and stage
  boundary, and the replicas' all-reduce of each stage's gradients.

An all-reduce of B bytes over N ranks moves 2 (N - 1) / N B over the slowest pair, in 2 (N - 1)
latencies, as a ring does. A row's tokens are the data's mean length (what tokens/s counted); the
activations sent are padded to the batch's longest.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxcluster.describe.cluster import Cluster
from mlxcluster.paths import BENCH_RESULTS
from mlxcluster.plan.memory import Terms
from mlxcluster.plan.ranks import Job, Layout
from training.data import shares as share_rules

RECOMPUTE = 4 / 3  # a pipeline stage's forward, again in the backward pass, and the backward


@dataclass(frozen=True)
class Pace:
    """A rank's compute: the seconds of a pass over the whole model that do not grow with its tokens,
    then its tokens/s."""

    speed: float
    overhead: float = 0.0

    def seconds(self, tokens: float, part: float = 1.0) -> float:
        """Seconds for `tokens` through `part` of the model's layers."""
        return part * (self.overhead + tokens / self.speed)


def fitted(few: tuple[float, float], more: tuple[float, float]) -> Pace:
    """The line through two calibrated steps, (tokens, seconds) each. Noise that makes the larger
    step cost no more, or less than its share, leaves no fixed part: the mean pace of the two."""
    (tokens_few, seconds_few), (tokens_more, seconds_more) = sorted((few, more))
    if tokens_more > tokens_few and seconds_more > seconds_few:
        per_token = (seconds_more - seconds_few) / (tokens_more - tokens_few)
        if (overhead := seconds_few - tokens_few * per_token) > 0:
            return Pace(1 / per_token, overhead)
    return Pace((tokens_few + tokens_more) / (seconds_few + seconds_more))


@dataclass(frozen=True)
class Measures:
    """What was measured of the cluster, for this fine-tune."""

    speeds: Mapping[str, float]  # node -> tokens/s of one rank training alone, past its fixed part
    bandwidth: float | None = None  # bytes/s of the slowest pair (None: not measured: no transfer time)
    latency: float = 0.0  # seconds per message
    source: str = ""  # where the figures come from, in words
    grad_checkpoint: bool = False  # whether the calibration recomputed each layer's forward
    overheads: Mapping[str, float] = field(default_factory=dict)  # node -> seconds a pass costs at any size

    def pace(self, job: Job) -> float:
        """How much slower `job` computes than the calibration did: a layer's forward recomputed in
        the backward pass where the calibration had none (and faster the other way)."""
        if job.grad_checkpoint == self.grad_checkpoint:
            return 1.0
        return RECOMPUTE if job.grad_checkpoint else 1 / RECOMPUTE

    def rank_paces(self, cluster: Cluster, job: Job) -> list[Pace] | None:
        """Each rank's pace at `job` (a node's ranks share its speed, each paying the fixed part of its
        own pass); None: a node not calibrated."""
        found = []
        factor = self.pace(job)
        for node in cluster.training_nodes:
            speed = self.speeds.get(node.name)
            if not speed:
                return None
            overhead = self.overheads.get(node.name, 0.0)
            found += [Pace(speed / node.slots / factor, overhead * factor)] * node.slots
        return found


def all_reduce(size: float, ranks: int, measures: Measures) -> float:
    """Seconds to all-reduce `size` bytes over `ranks` ranks, as a ring does."""
    if ranks < 2 or measures.bandwidth is None:
        return 0.0
    moved = 2 * (ranks - 1) / ranks * size
    return moved / measures.bandwidth + 2 * (ranks - 1) * measures.latency


def send(size: float, measures: Measures) -> float:
    return 0.0 if measures.bandwidth is None else size / measures.bandwidth + measures.latency


def step_seconds(job: Job, layout: Layout, cluster: Cluster, peaks: Sequence[Terms],
                 measures: Measures) -> float | None:
    """A step's seconds under `layout` (None: a node's speed was not measured)."""
    paces = measures.rank_paces(cluster, job)
    mean_length = job.mean_length or job.length
    if paces is None:
        return None
    world = len(paces)
    hidden = job.length * job.shape.hidden * job.itemsize  # a row's activation, as sent
    gradients = max(t.gradients + t.trainable for t in peaks)  # LoRA's trained bytes (full: weights')
    if layout.parallel == "tensor" and world > 1:
        compute = max(p.seconds(job.batch_size * mean_length / world) for p in paces)
        return compute + 4 * job.shape.layers * all_reduce(job.batch_size * hidden, world, measures)
    if layout.parallel == "pipeline" and world > 1:
        return _pipeline(job, layout, paces, measures, mean_length, hidden, gradients)
    shares = layout.shares or tuple(share_rules.split(job.batch_size, [1.0] * world))
    compute = max(p.seconds(share * mean_length) for share, p in zip(shares, paces, strict=True) if share)
    return compute + all_reduce(gradients, world, measures)


def _pipeline(job: Job, layout: Layout, paces: Sequence[Pace], measures: Measures, mean_length: float,
              hidden: float, gradients: float) -> float:
    stages, layers = len(layout.stages), sum(layout.stages)
    shares = layout.shares or (job.batch_size,)
    slowest = 0.0
    for replica, share in enumerate(shares):
        micro = min(layout.micro_batches or min(job.batch_size, 2 * stages), share)
        rows = math.ceil(share / micro)
        slot = 0.0
        for stage, count in enumerate(layout.stages):
            factor = 1.0 if stage == stages - 1 else RECOMPUTE
            pace = paces[replica * stages + stage]
            slot = max(slot, pace.seconds(rows * mean_length, count / layers) * factor)
        boundaries = 2 * (stages - 1) * send(rows * hidden, measures)  # forward and back, per slot
        slowest = max(slowest, (micro + stages - 1) * slot + micro * boundaries)
    return slowest + all_reduce(gradients, len(shares), measures)


def measured(cluster: Cluster, calibration: Mapping[str, Any] | None, links: Path = BENCH_RESULTS,
             inventory: str | None = None) -> Measures | None:
    """The measures of this cluster: the calibration's speeds (None: no calibration of this
    model and sequence length), and the newest bench.links result of this inventory, if any."""
    if not calibration:
        return None
    nodes = calibration.get("nodes", {})
    # A calibration of one batch size (before two were taken) has its tokens/s and no fixed part.
    speeds = {name: float(node.get("marginal_tokens_per_second") or node.get("tokens_per_second") or 0)
              for name, node in nodes.items()}
    overheads = {name: float(node.get("overhead_seconds") or 0) for name, node in nodes.items()}
    source = f"the calibration of {calibration.get('date')}"
    checkpointed = bool(calibration.get("grad_checkpoint"))
    newest = None
    for path in sorted(links.glob("links-*.json")) if links.is_dir() else []:
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if inventory is None or result.get("inventory") == inventory:
            newest = result
    if newest is None:
        return Measures(speeds, source=source + "; no bench.links of this cluster: no transfer time",
                        grad_checkpoint=checkpointed, overheads=overheads)
    pairs = [p for doc in newest.get("backends", {}).values() for p in doc.get("pairs", [])]
    if not pairs:
        return Measures(speeds, source=source, grad_checkpoint=checkpointed, overheads=overheads)
    bandwidth = min(p["bandwidth_gb_per_s"] for p in pairs) * 1e9
    latency = max(p["latency_us"] for p in pairs) / 1e6
    return Measures(speeds, bandwidth, latency, f"{source} and bench.links of {newest.get('date')}",
                    checkpointed, overheads)
