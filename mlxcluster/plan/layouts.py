"""The layouts a cluster allows for a job, each node's memory at its peak under each against what
the node can give, the one to pick and why, and the largest batch and longest sequence each fits.

The layouts: data (with the shares the inventory or a calibration gives), tensor (where the
model's heads shard over the ranks), pipeline with a stage per rank, and pipeline x data (stages
that divide the ranks, replicated). A pipeline's stages are sized as `invoke train` sizes them
(mlxcluster/launch/stages.py, from each node's free memory and the model's bytes by layer).

The pick, of the layouts that fit: data, which sends only gradients and runs mlx-lm's own compiled
step, whenever it fits, unless the cluster's calibration plans another faster by more than the step
times' error (FASTER); where data does not fit, the fastest, or without a calibration the one whose
fullest node is the least full (the most room for the batch to grow); pipeline before tensor on a
tie, since a stage's traffic is one activation per micro-batch where tensor parallelism sums
activations twice per layer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from mlxcluster.describe.cluster import Cluster
from mlxcluster.launch import stages as stage_sizes
from mlxcluster.plan import ranks
from mlxcluster.plan.memory import PROCESS_BYTES, Terms
from mlxcluster.plan.ranks import PAD_TO, Job, Layout
from training.data import shares as share_rules

ORDER = ("data", "pipeline", "tensor")  # the pick's order between layouts as full or fast as each other
# How much faster than data parallelism another layout must be planned to be picked over it: the
# step times' aim (bench.plan holds them within 25 % of measured steps), so that a plan's error
# never trades data's simplicity for a layout that may be no faster.
FASTER = 0.25
LARGEST_BATCH = 4096  # how far the inverse question searches


@dataclass(frozen=True)
class Fit:
    """One layout's plan: each rank's peak, each node's need and what it can give."""

    layout: Layout
    peaks: tuple[Terms, ...]  # per rank
    need: Mapping[str, int]  # node -> bytes its ranks need at their peaks
    free: Mapping[str, int | None]  # node -> bytes it can give (None: not known)
    step_s: float | None = None  # a step's predicted seconds (mlxcluster/plan/speed.py; None: not measured)

    @property
    def fits(self) -> bool:
        return all(free is None or self.need[node] <= free for node, free in self.free.items())

    @property
    def fullest(self) -> float:
        """The largest share of a node's memory the layout takes (0: not known)."""
        return max((self.need[n] / free for n, free in self.free.items() if free), default=0.0)

    def short(self) -> list[str]:
        """The nodes it does not fit, with their need and room."""
        return [f"{node} needs {gb(self.need[node])} of {gb(free)} GB"
                for node, free in self.free.items() if free is not None and self.need[node] > free]


def gb(size: float | None) -> str:
    """Bytes in GB (GiB, as a Mac's memory is sold) to two places; `?` for not known."""
    return "?" if size is None else f"{size / 2**30:.2f}"


def node_need(cluster: Cluster, peaks: Sequence[Terms]) -> dict[str, int]:
    """Each training node's need: the peaks of all of its ranks, and each rank's process."""
    need: dict[str, int] = {}
    for rank, name in enumerate(cluster.rank_nodes()):
        need[name] = need.get(name, 0) + peaks[rank].total + PROCESS_BYTES
    return need


def _data_layout(cluster: Cluster, job: Job, given: Sequence[float] | None) -> Layout | str:
    world = cluster.world_size
    if job.batch_size < world:
        return f"batch_size {job.batch_size} gives {world} ranks less than one example each"
    weights = list(given) if given and len(given) == world else [1.0] * world
    limits = tuple(int(n.max_micro_batch or 0) for n in cluster.training_nodes for _ in range(n.slots))
    return Layout("data", tuple(share_rules.split(job.batch_size, weights)), limits)


def _pipeline_layout(cluster: Cluster, job: Job, count: int, free: Mapping[str, int | None],
                     micro_batches: int) -> Layout | str:
    layers = job.shape.layers
    if count > layers:
        return f"{count} stages of the model's {layers} layers"
    replicas = cluster.world_size // count
    if job.batch_size < replicas:
        return f"batch_size {job.batch_size} gives {replicas} replicas less than one example each"
    sized = stage_sizes.sized(cluster, layers, dict(free), count, job.weights.body)
    split = tuple(share_rules.split(job.batch_size, [1.0] * replicas)) if replicas > 1 else ()
    return Layout("pipeline", split,
                  stages=sized.counts, micro_batches=micro_batches)


def candidates(cluster: Cluster, job: Job, free: Mapping[str, int | None], *,
               tensor_problem: str | None, shares: Sequence[float] | None = None,
               micro_batches: int = 0) -> list[Layout | tuple[str, str]]:
    """Every layout worth planning on this cluster, or (name, why not) for one it cannot run."""
    world = cluster.world_size
    found: list[Layout | tuple[str, str]] = []
    data = _data_layout(cluster, job, shares)
    found.append(data if isinstance(data, Layout) else ("data", data))
    if world < 2:
        return found
    found.append(Layout("tensor") if tensor_problem is None else ("tensor", tensor_problem))
    for count in sorted({world, *(c for c in range(2, world) if world % c == 0)}, reverse=True):
        layout = _pipeline_layout(cluster, job, count, free, micro_batches)
        found.append(layout if isinstance(layout, Layout) else (f"pipeline in {count} stages", layout))
    return found


def fit(cluster: Cluster, job: Job, layout: Layout, free: Mapping[str, int | None]) -> Fit:
    """The plan of one layout: each rank's peak and each node's need."""
    peaks = ranks.peaks(job, layout, cluster.world_size)
    return Fit(layout, tuple(peaks), node_need(cluster, peaks), dict(free))


def pick(fits: Sequence[Fit]) -> tuple[Fit | None, str]:
    """The layout to train with, and why (None: none fits)."""
    fitting = [f for f in fits if f.fits]
    if not fitting:
        return None, "no layout fits every node's memory"
    data = next((f for f in fitting if f.layout.parallel == "data"), None)
    timed = all(f.step_s is not None for f in fitting)
    fastest = min(fitting, key=lambda f: (f.step_s or 0.0, ORDER.index(f.layout.parallel)))
    if data is not None:
        if timed and data.step_s and (fastest.step_s or 0.0) < data.step_s * (1 - FASTER):
            return fastest, (f"{fastest.layout.name} is the fastest that fits: {fastest.step_s:.2f} s a step "
                             f"against data parallelism's {data.step_s:.2f}")
        return data, "data parallelism fits: every rank holds the whole model and only gradients travel"
    if timed:
        return fastest, (f"data parallelism does not fit; {fastest.layout.name} is the fastest that does "
                         f"({fastest.step_s:.2f} s a step)")
    best = min(fitting, key=lambda f: (round(f.fullest, 2), ORDER.index(f.layout.parallel)))
    return best, (f"data parallelism does not fit; {best.layout.name} leaves the fullest node the most "
                  f"room ({best.fullest:.0%} of its memory)")


def largest(fits_with: Callable[[int], bool], low: int, high: int) -> int | None:
    """The largest value in [low, high] for which `fits_with` holds, where it holds for every
    value below one that does (None: not even `low`)."""
    if not fits_with(low):
        return None
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits_with(middle) else (low, middle - 1)
    return low


def limits(cluster: Cluster, job: Job, layout: Layout, free: Mapping[str, int | None],
           longest_allowed: int) -> tuple[int | None, int | None]:
    """(the largest batch_size, the longest sequence in tokens) with which `layout` fits, each with
    the other as the job has it (None: not even the smallest)."""

    def with_batch(batch: int) -> bool:
        changed = replace(job, batch_size=batch)
        again = (replace(layout, shares=tuple(share_rules.split(batch, list(layout.shares))))
                 if layout.shares else layout)
        return batch >= len(layout.shares or [1]) and fit(cluster, changed, again, free).fits

    def with_length(steps: int) -> bool:
        length = steps * PAD_TO  # as max_seq_length: the validation split is cut to it too
        return fit(cluster, replace(job, length=length, valid_length=min(job.valid_length, length)),
                   layout, free).fits

    batch = largest(with_batch, max(len(layout.shares), 1), LARGEST_BATCH)
    steps = largest(with_length, 1, max(longest_allowed // PAD_TO, 1))
    return batch, steps * PAD_TO if steps else None
