"""How a run splits its work across the ranks: `--parallel data` (the default) or `--parallel tensor`.

Data parallelism keeps a whole model on every rank and splits each batch; the largest model a
cluster can fine-tune is then the largest its smallest Mac holds. Tensor parallelism splits the
model instead (training/sharding/tensor_parallel.py): every rank holds a shard of each layer and all ranks
train on the whole batch together. Here the controller refuses, before anything is synced, the
runs the nodes would refuse after loading: one rank, a model mlx-lm cannot shard, more ranks than
key-value head groups when the ranks do not divide the model's attention heads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlxcluster.describe.cluster import Cluster
from mlxcluster.errors import UserError, reason

MODES = ("data", "tensor")


def flags(parallel: str | None) -> list[str]:
    """The training flag for invoke train's --parallel (none: the config file's, data by default)."""
    if parallel is None:
        return []
    if parallel not in MODES:
        raise UserError(f"--parallel must be {' or '.join(MODES)}, not {parallel!r}")
    return ["--parallel", parallel]


def problems(cluster: Cluster, model: Path, mode: str, shape: Mapping[str, Any] | None = None) -> list[str]:
    """Why this cluster cannot train `model` with parallelism `mode` (empty when it can). `shape`:
    the config a model not fetched yet will have (the embedded default's, in a dry run); another
    model not on the controller yet (a hub id) is checked by the nodes."""
    if mode != "tensor":
        return []
    # The sharding rules are mlx-lm's (each model's shard()): mlx, mlx-lm and transformers, seconds
    # to import, only for a tensor-parallel run, not for every invoke command that imports this.
    from training.sharding.tensor_parallel import shard_problems

    ranks = cluster.world_size
    if ranks < 2:
        return ["--parallel tensor splits the model across ranks, and this cluster trains on 1: add "
                "nodes to the inventory's training group, or train with --parallel data"]
    config_file = model / "config.json"
    if not config_file.is_file():
        return shard_problems(shape, ranks, str(model)) if shape else []
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:
        return [f"{config_file} cannot be read ({reason(error)}): fetch the model again with "
                "invoke model.fetch"]
    if not isinstance(config, dict):
        return [f"{config_file} holds no model configuration: fetch the model again with invoke model.fetch"]
    return shard_problems(config, ranks, str(model))


def check(cluster: Cluster, model: Path, mode: str, shape: Mapping[str, Any] | None = None) -> None:
    if found := problems(cluster, model, mode, shape):
        raise UserError("cannot train with --parallel tensor:\n  " + "\n  ".join(found))


def line(cluster: Cluster, mode: str) -> str | None:
    """What `invoke train` says of a tensor-parallel run before it starts (None: data parallel)."""
    if mode != "tensor":
        return None
    ranks = cluster.world_size
    return (f"tensor parallel: each of the {ranks} ranks holds 1/{ranks} of every layer's attention "
            "and MLP (and their LoRA); all train on the whole batch together")
