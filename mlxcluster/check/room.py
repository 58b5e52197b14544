"""What a run's model takes on each node: disk for the whole folder, memory for its ranks' weights.

Every node keeps the whole model folder on disk, whatever the run. What a node holds in memory
depends on the run:

- a data-parallel rank holds the whole model, a tensor-parallel rank about 1/N of it (its heads,
  its MLP units and its part of the vocabulary; the norms it shares are small), a pipeline stage
  about 1/N too (its run of whole layers);
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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from mlxcluster.describe.cluster import Cluster
from mlxcluster.launch import quantized
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


@dataclass(frozen=True)
class Weights:
    """A model folder's weights: as stored, and as a rank that dequantizes them holds them."""

    stored: int  # bytes of its safetensors files
    dequantized: int  # bytes once every quantized layer is float (== stored for a float model)
    quantized: bool


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


def weights(model_dir: Path) -> Weights | None:
    """The folder's weights (None: no folder, or no safetensors in it, e.g. a hub id not fetched).
    Only a quantized model's headers are read; one that cannot be read counts as its size on disk
    (the ranks say what is wrong with it when they load it)."""
    files = sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else []
    if not files:
        return None
    stored = sum(f.stat().st_size for f in files)
    config_file = model_dir / "config.json"
    try:
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    except (OSError, ValueError):
        config = {}
    if not isinstance(config, dict) or not quantization.is_quantized(config):
        return Weights(stored, stored, quantized=False)
    try:
        tensors = headers(files)
    except (OSError, SafetensorError):
        return Weights(stored, stored, quantized=True)
    return Weights(stored, dequantized_bytes(tensors, config), quantized=True)


def _words(ranks: int, share: str, dequantized: int) -> str:
    """What a node's ranks hold: `the whole model on 2 ranks`, `1/3 of the model on 1 rank, dequantized`."""
    held = f"{share} on {ranks} rank{'s' if ranks > 1 else ''}"
    if dequantized == ranks:
        return f"{held}, dequantized"
    return f"{held}, dequantized on {dequantized} of them" if dequantized else held


def need(cluster: Cluster, model: Weights, *, parallel: str = "data",
         dequantize_ranks: Iterable[int] = ()) -> Need:
    """What a run with this model needs of each training node: each rank's weights (the whole
    model, or 1/N of it under tensor parallelism; float where the rank dequantizes), summed over
    the node's ranks, times MEMORY_FACTOR."""
    world = max(cluster.world_size, 1)
    # A tensor rank holds 1/N of every layer; a pipeline stage about 1/N of the layers (as equal as
    # can be by default; its edges also hold the embeddings or the head).
    split = parallel in ("tensor", "pipeline") and world > 1
    share = ("the whole model" if not split else f"1/{world} of the model" if parallel == "tensor"
             else f"a stage of about 1/{world} of the layers")
    dequantizing = set(dequantize_ranks) if model.quantized else set()
    ranks_of: dict[str, list[int]] = {}
    for rank, name in enumerate(cluster.rank_nodes()):
        ranks_of.setdefault(name, []).append(rank)
    memory, held = {}, {}
    for name, ranks in ranks_of.items():
        weights_held = sum(model.dequantized if rank in dequantizing else model.stored for rank in ranks)
        memory[name] = int((weights_held / world if split else weights_held) * MEMORY_FACTOR)
        held[name] = _words(len(ranks), share, len(dequantizing.intersection(ranks)))
    return Need(int(model.stored * DISK_FACTOR), memory, held)


def for_run(cluster: Cluster, model_dir: Path, *, parallel: str = "data",
            dequantize_ranks: Iterable[int] | None = None) -> Need | None:
    """`need` for the model in `model_dir` (None: its size is not known here); the ranks that
    dequantize it are the inventory's (model_dequantize) unless the run's settings name them."""
    if (found := weights(model_dir)) is None:
        return None
    ranks = quantized.asked_ranks(cluster) if dequantize_ranks is None else dequantize_ranks
    return need(cluster, found, parallel=parallel, dequantize_ranks=ranks)


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
