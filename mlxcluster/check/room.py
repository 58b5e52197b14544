"""What a run's model takes on each node: disk for the whole folder, memory for its ranks' weights.

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

The float size is read from the safetensors headers (no weight is read): a packed weight of a
quantized layer has `group_size` inputs per scale, so its float elements are its scales' count
times `group_size`, at the itemsize of the model's float tensors (what dequantizing makes, as
training/model/quantization.py's float_dtype chooses it).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from mlxcluster.describe.cluster import Cluster
from mlxcluster.launch import quantized
from mlxcluster.launch.stages import Body
from training.data import shares
from training.model import quantization

# A LoRA run holds its weights once per rank, plus activations, adapters and optimizer state.
MEMORY_FACTOR = 1.5
# The nodes keep one copy of the model, and room to save adapters and checkpoints beside it.
DISK_FACTOR = 2.0
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
            "I64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}


@dataclass(frozen=True)
class Tensor:
    dtype: str  # safetensors' name: F32, BF16, U32 ...
    shape: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    @property
    def bytes(self) -> int:
        return self.elements * ITEMSIZE.get(self.dtype, 4)


# A tensor of the model's body: `model.layers.7.mlp...` (gpt2's `h.7`, a few models' `blocks.7`).
LAYER_NAME = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
# The embeddings, which the first stage looks tokens up in.
EMBEDDING_NAME = re.compile(r"(?:^|\.)(?:embed_tokens|wte|wpe|tok_embeddings|word_embeddings)(?:\.|$)")
# A head of its own; without one the head is the embeddings (tied), which the last stage reads too.
HEAD_NAME = re.compile(r"(?:^|\.)(?:lm_head|output)\.")


def body_of(tensors: Mapping[str, Tensor]) -> Body | None:
    """The model's bytes by layer, from its tensors' names (None: no numbered layers 0..N-1)."""
    layers: dict[int, int] = {}
    embeddings = head = 0
    for name, tensor in tensors.items():
        if match := LAYER_NAME.search(name):
            layers[int(match.group(1))] = layers.get(int(match.group(1)), 0) + tensor.bytes
        elif EMBEDDING_NAME.search(name):
            embeddings += tensor.bytes
        else:
            head += tensor.bytes
    if not layers or sorted(layers) != list(range(len(layers))):
        return None
    tied = not any(HEAD_NAME.search(name) for name in tensors)
    return Body(tuple(layers[i] for i in range(len(layers))), embeddings, head, tied)


@dataclass(frozen=True)
class Weights:
    """A model folder's weights: as stored, and as a rank that dequantizes them holds them."""

    stored: int  # bytes of its safetensors files
    dequantized: int  # bytes once every quantized layer is float (== stored for a float model)
    quantized: bool
    body: Body | None = None  # by layer, when asked for (a pipeline run) and readable


@dataclass(frozen=True)
class Need:
    """What a run needs of each node: disk for the model folder, memory for its ranks' weights."""

    disk: int  # bytes of free disk under cluster_root, on every node
    memory: Mapping[str, int]  # node -> bytes of free memory
    held: Mapping[str, str]  # node -> what its ranks hold, in words (`the whole model on 2 ranks`)

    @classmethod
    def whole(cls, cluster: Cluster, stored: int) -> Need:
        """Every rank holding the whole model of `stored` bytes (data parallelism, float)."""
        return need(cluster, Weights(stored, stored, quantized=False))


def headers(files: Iterable[Path]) -> dict[str, Tensor]:
    """Every tensor of these safetensors files by name, from their headers alone."""
    found: dict[str, Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="numpy") as file:
            for name in file.keys():
                part = file.get_slice(name)
                found[name] = Tensor(part.get_dtype(), tuple(part.get_shape()))
    return found


def _float_dtype(tensors: Mapping[str, Tensor], packed: set[str]) -> str:
    """The dtype most float tensors outside the quantized layers have: what dequantizing gives."""
    counts: dict[str, int] = {}
    for name, tensor in tensors.items():
        if name.rpartition(".")[0] not in packed and tensor.dtype.startswith(("F", "BF")):
            counts[tensor.dtype] = counts.get(tensor.dtype, 0) + 1
    return max(counts, key=counts.__getitem__) if counts else "F32"


def dequantized_bytes(tensors: Mapping[str, Tensor], config: Mapping[str, Any]) -> int:
    """The weights' bytes once every quantized layer is dequantized: a packed weight becomes
    (scales x group_size) float elements; its scales and biases go."""
    packed = {name.removesuffix(".scales") for name in tensors if name.endswith(".scales")}
    itemsize = ITEMSIZE[_float_dtype(tensors, packed)]
    total = 0
    for name, tensor in tensors.items():
        layer, _, leaf = name.rpartition(".")
        if layer not in packed:
            total += tensor.bytes
        elif leaf == "weight":
            settings = quantization.of_layer(config, layer) or {"group_size": 64}
            total += tensors[f"{layer}.scales"].elements * settings["group_size"] * itemsize
    return total


def weights(model_dir: Path, *, by_layer: bool = False) -> Weights | None:
    """The folder's weights (None: no folder, or no safetensors in it, e.g. a hub id not fetched).
    The headers are read for a quantized model, or `by_layer` (a pipeline run: each stage's
    bytes); weights that cannot be read count as their size on disk (the ranks say what is wrong
    with them when they load them)."""
    files = sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else []
    if not files:
        return None
    stored = sum(f.stat().st_size for f in files)
    config_file = model_dir / "config.json"
    try:
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    except (OSError, ValueError):
        config = {}
    quantized = isinstance(config, dict) and quantization.is_quantized(config)
    if not quantized and not by_layer:
        return Weights(stored, stored, quantized=False)
    try:
        tensors = headers(files)
    except (OSError, SafetensorError):
        return Weights(stored, stored, quantized=quantized)
    body = body_of(tensors) if by_layer else None
    return Weights(stored, dequantized_bytes(tensors, config) if quantized else stored, quantized, body)


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
        edges = [*(["the embeddings"] if body and stage == 0 else []),
                 *(["the head"] if body and stage == world - 1 else [])]
        run = f"layer {start + 1}" if count == 1 else f"layers {start + 1}-{start + count}"
        words = f"{run} of {layers}" + "".join(f" and {e}" for e in edges)
        result.append((fractions[stage], words))
        start += count
    return result


def need(cluster: Cluster, model: Weights, *, parallel: str = "data",
         dequantize_ranks: Iterable[int] = (), stages: Sequence[int] | None = None,
         stage_count: int | None = None) -> Need:
    """What a run with this model needs of each training node: each rank's weights (the whole
    model, 1/N of it under tensor parallelism, its stage's share under pipeline parallelism:
    `stages`, the layers of each stage, of `stage_count` stages (default: one per rank; fewer:
    rank r holds stage r mod stages, its replicas' ranks alike); float where the rank dequantizes),
    summed over the node's ranks, times MEMORY_FACTOR."""
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
    for name, ranks in ranks_of.items():
        weights_held = sum((model.dequantized if rank in dequantizing else model.stored) * per_rank[rank][0]
                           for rank in ranks)
        memory[name] = round(weights_held * MEMORY_FACTOR)
        # Ranks that hold alike are said once (`the whole model on 2 ranks`), stages one by one.
        said = list(dict.fromkeys(per_rank[rank][1] for rank in ranks))
        held[name] = _words(len(ranks), "; ".join(said), len(dequantizing.intersection(ranks)))
    return Need(int(model.stored * DISK_FACTOR), memory, held)


def for_run(cluster: Cluster, model_dir: Path, *, parallel: str = "data",
            dequantize_ranks: Iterable[int] | None = None,
            stages: Sequence[int] | None = None, stage_count: int | None = None) -> Need | None:
    """`need` for the model in `model_dir` (None: its size is not known here); the ranks that
    dequantize it are the inventory's (model_dequantize) unless the run's settings name them;
    `stages`: a pipeline run's layers per stage (None: as equal as can be, over `stage_count`)."""
    if (found := weights(model_dir, by_layer=parallel == "pipeline")) is None:
        return None
    ranks = quantized.asked_ranks(cluster) if dequantize_ranks is None else dequantize_ranks
    return need(cluster, found, parallel=parallel, dequantize_ranks=ranks, stages=stages,
                stage_count=stage_count)


def free_memory(memory: Mapping[str, int | None]) -> int | None:
    """What a node's memory can give a run, from its probe (mlxcluster/check/probe.py's
    memory_bytes): its available memory, already the control group's room where a limit is
    lower. The preflight compares a node's need with this, and pipeline stages are sized by it
    (mlxcluster/launch/stages.py), so that the two agree."""
    available = memory.get("available")
    return available if isinstance(available, int) and not isinstance(available, bool) else None


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
    return Need(max(n.disk for n in known), memory, held)
