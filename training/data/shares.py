"""Each rank's share of a global batch, and how many micro-batches it runs them in.

A mixed cluster (an M1 Pro beside an M2 Max) trains fastest when each rank gets examples in
proportion to its speed: then every rank finishes its part of a step at about the same time. A
step lasts as long as its slowest rank, whose time is its share over its weight; the shares are
the whole examples, every rank at least one, summing to the global batch, that make that slowest
rank as fast as can be: exactly proportional whenever the weights allow it (5,1,1,1 of 8 gives
5,1,1,1; 3,1,1,1 of 12 gives 6,2,2,2). They are dealt one example at a time to the rank that
would finish soonest with it, ties to the lower rank, which is optimal for the slowest rank and
gives the same shares for the same weights on the controller and on every rank.

A rank whose memory cannot hold its share at once runs it as micro-batches of at most
`max_micro_batch` examples, with the gradients accumulated. Every rank must take part in each
gradient exchange, so all ranks run the same number of micro-batches per step: the most any rank
needs. (training/data/batches.py cuts the batches; the mathematics that keeps an update equal to one
process's on the whole batch is there.)

The standard library only: the controller imports this module too.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence


class ShareError(ValueError):
    """Shares that cannot split a global batch; the message says what to change."""


def split(batch_size: int, weights: Sequence[float]) -> list[int]:
    """`batch_size` examples split in proportion to `weights` (one per rank): whole numbers that
    sum to `batch_size`, each at least 1."""
    if not weights:
        raise ShareError("no ranks to share the batch between")
    if any(not (isinstance(w, int | float) and math.isfinite(w) and w > 0) for w in weights):
        raise ShareError(f"batch shares must be positive numbers, got {list(weights)}")
    if batch_size < len(weights):
        raise ShareError(f"a global batch of {batch_size} cannot give each of {len(weights)} ranks an "
                         f"example: use a batch_size of at least {len(weights)}")
    # Every rank's one example first; then each next example to the rank whose time (share over
    # weight) would be the least with it. Giving the example to any other rank could only make
    # that rank's time, and so the slowest's, longer: the greedy deal is optimal.
    shares = [1] * len(weights)
    queue = [((1 + 1) / w, rank) for rank, w in enumerate(weights)]
    heapq.heapify(queue)
    for _ in range(batch_size - len(weights)):
        _, rank = heapq.heappop(queue)
        shares[rank] += 1
        heapq.heappush(queue, ((shares[rank] + 1) / weights[rank], rank))
    return shares


def step_times(shares: Sequence[int], weights: Sequence[float]) -> list[float]:
    """Each rank's expected time for its part of a step, relative to the fastest rank's (1.0)."""
    times = [s / w for s, w in zip(shares, weights, strict=True)]
    fastest = min(times)
    return [t / fastest for t in times]


def parse(text: str, world_size: int, what: str, unit: str = "rank") -> list[int]:
    """A comma-separated list of whole numbers, one per rank (a single one: the same for all);
    `unit`: what splits the batch ("replica": a pipeline's replicas of its stages)."""
    words = [w.strip() for w in text.split(",")]
    if not all(w.isdigit() for w in words):
        raise ShareError(f"{what} must be whole numbers separated by commas, one per {unit}, got {text!r}")
    values = [int(w) for w in words]
    if len(values) == 1:
        values *= world_size
    if len(values) != world_size:
        raise ShareError(f"{what} {text!r} gives {len(values)} {unit}s a value, but the run has "
                         f"{world_size}: give one per {unit}, in {unit} order")
    return values


def micro_batches(shares: Sequence[int], limits: Sequence[int]) -> int:
    """How many micro-batches every rank runs per step: enough for the rank that needs the most
    (a limit of 0: none, its share at once)."""
    return max((math.ceil(s / m) if m else 1) for s, m in zip(shares, limits, strict=True))


def cut(count: int, parts: int) -> list[int]:
    """`count` examples as `parts` micro-batches, as even as possible, the larger first (some may be
    empty when a rank has fewer examples than the others need micro-batches)."""
    return [count // parts + (1 if i < count % parts else 0) for i in range(parts)]


def deal(shares: Sequence[int]) -> list[int]:
    """Which rank takes each example of a global batch (sorted by length, as mlx-lm sorts it): each
    rank's examples spread evenly over the batch, so that every rank gets short and long ones in
    its proportion. Equal shares give mlx-lm's own order: rank 0, 1, ..., 0, 1, ..."""
    # Rank r's k-th example sits at (k + 1/2) / share_r along the batch; ties go to the lower rank.
    slots = sorted(((k + 0.5) / share, rank) for rank, share in enumerate(shares) for k in range(share))
    return [rank for _, rank in slots]
