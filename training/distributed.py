"""How the ranks of a run come together, and what they check with each other.

At the start: which launcher started this process (mpirun, or a launcher of MLX's ring: the
cluster's mlx-cluster-launch, or mlx.launch; told apart by the environment they set),
`mx.distributed.init(strict=True)` with that launcher's backend, and a check that MLX joined as many
ranks as expected, so that a node that cannot load the MPI library stops the run instead of
training alone. At the end: collectives every rank calls in the same order, comparing the ranks'
LoRA weights, counting the ranks that run on OpenBLAS, and timing one gradient all-reduce.

Functions take the group (`Group`: rank() and size()) so that tests can pass a stand-in.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten


class DistributedError(RuntimeError):
    """The ranks did not come together as expected; the message says how many and why."""

    def __init__(self, message: str, group: Group | None = None):
        super().__init__(message)
        self.group = group  # the ranks that did join, if any


class Group(Protocol):
    """What this module needs of `mx.distributed.Group` (tests pass a stand-in)."""

    def rank(self) -> int: ...

    def size(self) -> int: ...


@dataclass(frozen=True)
class Launch:
    backend: str  # "mpi" or "ring": the MLX backend that talks to the launcher's other ranks
    size: int  # the ranks the launcher started


def detect_launch(environ: Mapping[str, str]) -> Launch | None:
    """The launcher that started this process, from the environment it set; None: started by hand.

    mpirun (Open MPI) sets OMPI_COMM_WORLD_SIZE; `mlx-cluster-launch --backend ring` (or
    `mlx.launch`'s) sets MLX_RANK and MLX_HOSTFILE, a file listing the ranks' addresses (empty with
    one host).
    """
    if "OMPI_COMM_WORLD_SIZE" in environ:
        return Launch("mpi", int(environ["OMPI_COMM_WORLD_SIZE"]))
    if "MLX_RANK" in environ and "MLX_HOSTFILE" in environ:
        text = Path(environ["MLX_HOSTFILE"]).read_text().strip()
        return Launch("ring", len(json.loads(text)) if text else 1)
    return None


def world_size_problem(
    group: Group, expected: int | None, expected_from: str = "the hostfile's slots"
) -> str | None:
    """Why the joined ranks are not the expected ones (None when they are, or nothing is expected)."""
    size = group.size()
    if expected is None or size == expected:
        return None
    message = (
        f"rank {group.rank()}: MLX joined {size} process(es) but {expected} were expected ({expected_from}). "
    )
    if size == 1:
        return message + (
            "Each process would train alone. Likely causes: MLX could not load the MPI library "
            "(on Linux set MLX_MPI_LIBNAME=libmpi.so.40, on macOS DYLD_LIBRARY_PATH=/opt/homebrew/lib, "
            "and pass them with mpirun -x), or the script was not started by mpirun / mlx-cluster-launch "
            "(or mlx.launch)."
        )
    return message + (
        "Likely cause: the launcher was given another hostfile or number of ranks (mpirun -np) than "
        "the one counted."
    )


def check_world_size(group: Group, expected: int | None, expected_from: str = "the hostfile's slots") -> None:
    if problem := world_size_problem(group, expected, expected_from):
        raise DistributedError(problem, group)


def init_distributed(
    environ: Mapping[str, str], expected_world_size: int | None, init: Callable[..., Any] | None = None
) -> Any:
    """The distributed group of this run, checked against the expected number of ranks.

    Under a launcher of several ranks MLX must join them (strict: a missing MPI library is an error,
    not a silent group of one); started by hand, it is a group of one.
    """
    init = init or mx.distributed.init
    launch = detect_launch(environ)
    if launch is not None and launch.size > 1:
        try:
            group = init(strict=True, backend=launch.backend)
        except RuntimeError as error:
            hint = ""
            if launch.backend == "mpi":
                hint = (
                    " Is libmpi loadable (MLX_MPI_LIBNAME=libmpi.so.40 on Linux, "
                    "DYLD_LIBRARY_PATH=/opt/homebrew/lib on macOS)?"
                )
            raise DistributedError(
                f"MLX could not join the {launch.size} ranks {launch.backend} started: {error}.{hint}"
            ) from None
    else:
        group = init()
    if expected_world_size is not None:
        check_world_size(group, expected_world_size)
    elif launch is not None:
        check_world_size(group, launch.size, f"the ranks {launch.backend} started")
    return group


def rank_prefix(group: Group) -> str:
    """The `rank N: ` that starts a rank's messages when there are several ranks (mlxcluster/launch/builder.py
    reads it to name the rank that failed); "" alone."""
    return f"rank {group.rank()}: " if group.size() > 1 else ""


def wait_for_every_rank(group: Group) -> None:
    """Return once every rank of `group` has called this too.

    Launchers kill every rank once one exits with an error: a rank about to fail waits here until
    all have said why.
    """
    mx.eval(mx.distributed.all_sum(mx.array(0), group=group, stream=mx.cpu))


# --- at the end of a run ---------------------------------------------------------------------------


def weight_spread_across_ranks(weights: Mapping[str, mx.array], group: Any) -> float:
    """Largest difference between any rank's `weights` and rank 0's (0.0 alone)."""
    if group.size() == 1 or not weights:
        return 0.0
    flat = mx.concatenate([weights[name].flatten() for name in sorted(weights)])
    gathered = mx.distributed.all_gather(flat[None].astype(mx.float32), group=group, stream=mx.cpu)
    return float(mx.max(mx.abs(gathered - gathered[:1])).item())


def openblas_loaded(maps: Path = Path("/proc/self/maps")) -> bool:
    """Whether this process runs with OpenBLAS mapped in (Linux: env.sh preloads it; without it
    mlx[cpu] falls back to its bundled reference BLAS, tens of times slower)."""
    try:
        return "libopenblas" in maps.read_text()
    except OSError:  # no /proc: macOS, where MLX uses Accelerate and Metal
        return False


def ranks_with_openblas(group: Any) -> int:
    """How many ranks have OpenBLAS loaded, so a run shows that no node fell back to slow BLAS."""
    mine = mx.array([1.0 if openblas_loaded() else 0.0])
    if group.size() == 1:
        return int(mine.item())
    return int(mx.distributed.all_sum(mine, group=group, stream=mx.cpu).item())


def gradient_sync_seconds(model: nn.Module, group: Any, repeats: int = 5) -> float:
    """Seconds one all-reduce of the gradients takes, timed alone: the all_sum of an array as big
    as the trainable parameters (mlx-lm's step fuses it with the compute, so it cannot be timed
    within). 0.0 on one rank."""
    if group.size() == 1:
        return 0.0
    count = sum(p.size for _, p in tree_flatten(model.trainable_parameters()))
    grads = mx.zeros((count,), dtype=mx.float32)
    times = []
    for _ in range(repeats + 1):  # the first one warms the connections up
        tic = time.perf_counter()
        mx.eval(mx.distributed.all_sum(grads, group=group, stream=mx.cpu))
        times.append(time.perf_counter() - tic)
    return sorted(times[1:])[repeats // 2]


@dataclass(frozen=True)
class RankChecks:
    """What the ranks found out together at the end of a run."""

    weight_spread: float  # largest difference of any rank's LoRA weights from rank 0's
    ranks_with_openblas: int
    gradient_sync_seconds: float  # one all-reduce of the gradients, timed alone
    rank_tokens: list[int]  # tokens each rank trained on, in rank order
    peak_memory_gb: list[float]  # each rank's peak memory, in rank order
    base_weights: list[str] = field(default_factory=list)  # each rank's, in rank order (quantized or not)
    pipeline: list[dict[str, Any]] | None = None  # each stage's PipelineStep.counters, in rank order


def per_rank(value: float, group: Any) -> list[float]:
    """Every rank's `value`, in rank order (a collective)."""
    mine = mx.array([float(value)], dtype=mx.float32)
    if group.size() == 1:
        return [float(value)]
    return [float(v) for v in mx.distributed.all_gather(mine, group=group, stream=mx.cpu).tolist()]


def per_rank_text(text: str, group: Any) -> list[str]:
    """Every rank's `text`, in rank order (collectives): its UTF-8 bytes, padded to the longest."""
    if group.size() == 1:
        return [text]
    mine = text.encode()
    longest = max(1, round(max(per_rank(len(mine), group))))
    padded = mx.array(list(mine.ljust(longest, b"\0")), dtype=mx.uint8)
    gathered = mx.distributed.all_gather(padded[None], group=group, stream=mx.cpu)
    return [bytes(row).rstrip(b"\0").decode() for row in gathered.tolist()]


def check_ranks(
    model: nn.Module, group: Any, trained_tokens: int, layout: Any, base_weights: str = "float",
    pipeline_counters: Mapping[str, Any] | None = None,
) -> RankChecks:
    """Compare the ranks after training: collectives, called by every rank in the same order.
    `trained_tokens`: the tokens this rank trained on. `layout` (training/sharding/tensor_parallel.py): which
    weights every rank holds whole, and the ranks that average gradients. `base_weights`: this rank's
    (training/model/quantization.py), gathered for the summary, as `pipeline_counters` are (a
    pipeline's: every rank has them, or none)."""
    # Every rank must end with the same replicated LoRA weights (mlx-lm averages the gradients in
    # data parallelism; in tensor parallelism they get equal gradients): check it.
    spread = weight_spread_across_ranks(layout.replicated(model), group)
    openblas = ranks_with_openblas(group)
    tokens = [round(t) for t in per_rank(trained_tokens, group)]
    peaks = per_rank(mx.get_peak_memory() / 1e9, group)
    return RankChecks(
        spread,
        openblas,
        # A pipeline's replicas time their own averaging (training/sharding/stage_layout.py).
        layout.sync_seconds(model) if hasattr(layout, "sync_seconds") else gradient_sync_seconds(
            model, layout.data_group),
        tokens,
        peaks,
        per_rank_text(base_weights, group),
        # As JSON text, so that byte counts arrive exact (per_rank gathers float32).
        None if pipeline_counters is None else [
            json.loads(text) for text in per_rank_text(json.dumps(pipeline_counters), group)],
    )
