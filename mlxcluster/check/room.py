"""What a run's model takes on each node: disk for the whole folder, memory for its ranks' peaks.

Every node keeps the whole model folder on disk, whatever the run. What a node holds in memory
depends on the run:

- a data-parallel rank holds the whole model, a tensor-parallel rank about 1/N of it (its heads,
  its MLP units and its part of the vocabulary; the norms it shares are small), a pipeline stage
  its run of whole layers (their bytes, read from the headers: a stage's share as
  mlxcluster/launch/stages.py sized it, or as the settings give it), with the embeddings on the
  first stage and the final norm and head on the last (the embeddings too where the head is tied
  to them);
- a rank that dequantizes a quantized model (`model_dequantize: true`, `dequantize_ranks`) holds
  its weights in float: several times their size on disk;
- a node holds what all of its ranks (its slots) hold.

A run that is planned (mlxcluster/plan/: its settings, data and the model's files) needs each rank's
planned peak and its process; without a plan, its weights times MEMORY_FACTOR. The weights are
read from the safetensors headers (mlxcluster/plan/model.py: no weight is read).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from mlxcluster.describe.cluster import Cluster
from mlxcluster.launch import quantized
from mlxcluster.launch import settings as run_settings
from mlxcluster.plan import of_run, serving
from mlxcluster.plan.memory import PROCESS_BYTES
from mlxcluster.plan.model import Weights, weights
from training.data import shares

# A LoRA run holds its weights once per rank, plus activations, adapters and optimizer state.
MEMORY_FACTOR = 1.5
# The nodes keep one copy of the model, and room to save adapters and checkpoints beside it.
DISK_FACTOR = 2.0


TRAINING_FIX = ("close other programs, or train a smaller or quantized model "
                "(or --parallel tensor, which splits it across the nodes)")


@dataclass(frozen=True)
class Need:
    """What a run needs of each node: disk for the model folder, memory for its ranks' weights."""

    disk: int  # bytes of free disk under cluster_root, on every node
    memory: Mapping[str, int]  # node -> bytes of free memory
    held: Mapping[str, str]  # node -> what its ranks hold, in words (`the whole model on 2 ranks`)
    fix: str = TRAINING_FIX  # what to do where a node's memory cannot give it

    @classmethod
    def whole(cls, cluster: Cluster, stored: int) -> Need:
        """Every rank holding the whole model of `stored` bytes (data parallelism, float)."""
        return need(cluster, Weights(stored, stored, quantized=False))


def _words(ranks: int, share: str, dequantized: int) -> str:
    """What a node's ranks hold: `the whole model on 2 ranks`, `1/3 of the model on 1 rank, dequantized`."""
    held = f"{share} on {ranks} rank{'s' if ranks > 1 else ''}"
    if dequantized == ranks:
        return f"{held}, dequantized"
    return f"{held}, dequantized on {dequantized} of them" if dequantized else held


def stage_shares(model: Weights, world: int, stages: Sequence[int] | None) -> list[tuple[float, str]]:
    """Each pipeline stage's fraction of the model's bytes and what it holds in words, in rank
    order: `stages` layers each (None: as equal as can be, as the ranks split them by default),
    weighed by the layers' bytes and the edges' where the headers were read, else by the layer
    count; about 1/N each when neither the stages nor the layers are known."""
    body = model.body
    layers = sum(stages) if stages else len(body.layers) if body else 0
    if layers < world:  # not known (or refused before anything runs: more stages than layers)
        return [(1 / world, f"a stage of about 1/{world} of the layers")] * world
    counts = list(stages) if stages else shares.split(layers, [1.0] * world)
    if body and len(body.layers) == layers:
        held = body.stage_bytes(counts)
        whole = sum(body.layers) + body.embeddings + body.head
        fractions = [part / whole if whole else count / layers
                     for part, count in zip(held, counts, strict=True)]
    else:
        body, fractions = None, [count / layers for count in counts]
    result, start = [], 0
    for stage, count in enumerate(counts):
        # A tied head is the embeddings read as the head: the last stage's words say the head.
        edges = [*(["the embeddings"] if body and stage < world - 1 else []),
                 *(["the head"] if body and stage == world - 1 else [])]
        run = f"layer {start + 1}" if count == 1 else f"layers {start + 1}-{start + count}"
        words = f"{run} of {layers}" + "".join(f" and {e}" for e in edges)
        result.append((fractions[stage], words))
        start += count
    return result


def need(cluster: Cluster, model: Weights, *, parallel: str = "data",
         dequantize_ranks: Iterable[int] = (), stages: Sequence[int] | None = None,
         stage_count: int | None = None, peaks: Sequence[int] | None = None) -> Need:
    """What a run with this model needs of each training node, summed over the node's ranks: each
    rank's planned peak (`peaks`, bytes in rank order: mlxcluster/plan/memory.py's accounting of
    the run's settings and data) and its process (PROCESS_BYTES), or without one its weights
    times MEMORY_FACTOR (the whole model, 1/N of it under tensor parallelism, its stage's share
    under pipeline parallelism: `stages`, the layers of each stage, of `stage_count` stages
    (default: one per rank; fewer: rank r holds stage r mod stages, its replicas' ranks alike);
    float where the rank dequantizes)."""
    world = max(cluster.world_size, 1)
    if parallel == "pipeline" and world > 1:
        count = len(stages) if stages else stage_count or world
        per_stage = stage_shares(model, count, stages)
        per_rank = [per_stage[rank % count] for rank in range(world)]
    elif parallel == "tensor" and world > 1:
        per_rank = [(1 / world, f"1/{world} of the model")] * world
    else:
        per_rank = [(1.0, "the whole model")] * world
    dequantizing = set(dequantize_ranks) if model.quantized else set()
    ranks_of: dict[str, list[int]] = {}
    for rank, name in enumerate(cluster.rank_nodes()):
        ranks_of.setdefault(name, []).append(rank)
    memory, held = {}, {}
    planned = peaks is not None and len(peaks) == world
    for name, ranks in ranks_of.items():
        weights_held = sum((model.dequantized if rank in dequantizing else model.stored) * per_rank[rank][0]
                           for rank in ranks)
        memory[name] = (sum(peaks[rank] + PROCESS_BYTES for rank in ranks) if planned
                        else round(weights_held * MEMORY_FACTOR))
        # Ranks that hold alike are said once (`the whole model on 2 ranks`), stages one by one.
        said = list(dict.fromkeys(per_rank[rank][1] for rank in ranks))
        held[name] = _words(len(ranks), "; ".join(said), len(dequantizing.intersection(ranks)))
    return Need(int(model.stored * DISK_FACTOR), memory, held)


def for_run(cluster: Cluster, model_dir: Path, *, parallel: str = "data",
            dequantize_ranks: Iterable[int] | None = None, stages: Sequence[int] | None = None,
            stage_count: int | None = None, peaks: Sequence[int] | None = None) -> Need | None:
    """`need` for the model in `model_dir` (None: its size is not known here); the ranks that
    dequantize it are the inventory's (model_dequantize) unless the run's settings name them;
    `stages`: a pipeline run's layers per stage (None: as equal as can be, over `stage_count`)."""
    if (found := weights(model_dir, by_layer=parallel == "pipeline")) is None:
        return None
    ranks = quantized.asked_ranks(cluster) if dequantize_ranks is None else dequantize_ranks
    return need(cluster, found, parallel=parallel, dequantize_ranks=ranks, stages=stages,
                stage_count=stage_count, peaks=peaks)


def free_memory(memory: Mapping[str, int | None]) -> int | None:
    """What a node's memory can give a run, from its probe (mlxcluster/check/probe.py's
    memory_bytes): its available memory, already the control group's room where a limit is
    lower, and at most what Metal lets MLX's GPU hold on a Mac (its recommended working set: macOS
    wires about 75 % of the RAM by default, iogpu.wired_limit_mb more). The preflight compares a
    node's need with this, and pipeline stages are sized by it (mlxcluster/launch/stages.py), so
    that the two agree."""
    known = [value for value in (memory.get("available"), memory.get("gpu_limit"))
             if isinstance(value, int) and not isinstance(value, bool)]
    return min(known) if isinstance(memory.get("available"), int) and known else None


def largest(needs: Iterable[Need | None]) -> Need | None:
    """What several runs on one cluster need of each node, one after the other: each node's largest
    (a benchmark's one-process baseline and its runs on more nodes; None: not known)."""
    known = [n for n in needs if n is not None]
    if not known:
        return None
    memory: dict[str, int] = {}
    held: dict[str, str] = {}
    for one in known:
        for node, want in one.memory.items():
            if want > memory.get(node, -1):
                memory[node], held[node] = want, one.held[node]
    return Need(max(n.disk for n in known), memory, held, known[0].fix)


def for_planned_run(cluster: Cluster, model: Path, data: Path | None, overrides: Sequence[str], *,
                    parallel: str = "data", config: Path | None = None) -> Need | None:
    """What a run of the default settings (or `config`'s) with `overrides`, in `parallel` mode, needs
    of each node, planned as `invoke train` plans it: a benchmark's preflight (None: the model's
    size is not known here)."""
    settings = run_settings.read(config, [*overrides, "--parallel", parallel])
    peaks = of_run.planned_peaks(cluster, settings, model, data)
    return for_run(cluster, model, parallel=parallel, peaks=[t.total for t in peaks] if peaks else None)


def for_server(cluster: Cluster, model_dir: Path, mode: str, *, context: int | None,
               adapters: Sequence[Path] = (), stages: Sequence[int] | None = None) -> Need | None:
    """What each node of a server (mlxcluster/plan/serving.py) must hold: its ranks' peaks and
    processes, said with the context served, and the fix where a node cannot (None: the model's
    size is not known here)."""
    server = serving.for_server(model_dir, mode, world=cluster.world_size, context=context,
                                adapters=adapters, stages=stages)
    held = mode if mode in ("tensor", "pipeline") else "data"
    found = for_run(cluster, model_dir, parallel=held, dequantize_ranks=(), stages=stages,
                    peaks=[t.total for t in server.ranks] if server else None)
    if found is None or server is None:
        return found
    words = {node: f"{what}, a request of {server.context:,} tokens" for node, what in found.held.items()}
    return dataclasses.replace(found, held=words, fix=serving.fix(server))
