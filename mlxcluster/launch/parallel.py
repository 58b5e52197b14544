"""How a run splits its work across the ranks: `--parallel data` (the default), `tensor` or `pipeline`.

Data parallelism keeps a whole model on every rank and splits each batch; the largest model a
cluster can fine-tune is then the largest its smallest Mac holds. Tensor parallelism splits the
model instead (training/sharding/tensor_parallel.py): every rank holds a shard of each layer and all ranks
train on the whole batch together. Pipeline parallelism (training/sharding/pipeline.py) gives each
rank a run of whole layers, in rank order (so each stage's neighbours are its ring neighbours), and
sends the batch through them in micro-batches. Here the controller refuses, before anything is
synced, the runs the nodes would refuse after loading: one rank, a model mlx-lm cannot shard, more
ranks than key-value head groups when the ranks do not divide the model's attention heads, more
stages than layers, a backend whose point-to-point a pipeline cannot trust.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlxcluster.describe.backends import Choice
from mlxcluster.describe.cluster import Cluster
from mlxcluster.errors import UserError, reason
from mlxcluster.launch.stages import layer_count

MODES = ("data", "tensor", "pipeline")
# What each mode that splits the model does with it, as its refusal on one rank says.
SPLITS = {"tensor": "splits the model across ranks",
          "pipeline": "gives each rank a stage of the model's layers"}


def flags(parallel: str | None) -> list[str]:
    """The training flag for invoke train's --parallel (none: the config file's, data by default)."""
    if parallel is None:
        return []
    if parallel not in MODES:
        raise UserError(f"--parallel must be {', '.join(MODES[:-1])} or {MODES[-1]}, not {parallel!r}")
    return ["--parallel", parallel]


def problems(cluster: Cluster, model: Path, mode: str, shape: Mapping[str, Any] | None = None,
             stages: int | None = None) -> list[str]:
    """Why this cluster cannot train `model` with parallelism `mode` (empty when it can). `shape`:
    the config a model not fetched yet will have (the embedded default's, in a dry run); another
    model not on the controller yet (a hub id) is checked by the nodes. `stages`: a pipeline's
    (default: one per rank)."""
    if mode not in SPLITS:
        return []
    ranks = cluster.world_size
    if ranks < 2:
        return [f"--parallel {mode} {SPLITS[mode]}, and this cluster trains on 1: add nodes to the "
                "inventory's training group, or train with --parallel data"]
    config = _model_config(model, shape)
    if isinstance(config, str):
        return [config]
    if not config:
        return []
    if mode == "pipeline":
        layers = layer_count(config)
        count = stages or ranks
        if layers is not None and count > layers:
            return [f"--parallel pipeline in {count} stages: {model} has {layers} layers, and each stage "
                    f"holds at least one; use at most {layers} stages (pipeline_stages)"]
        return []
    # The sharding rules are mlx-lm's (each model's shard()): mlx, mlx-lm and transformers, seconds
    # to import, only for a tensor-parallel run, not for every invoke command that imports this.
    from training.sharding.tensor_parallel import shard_problems

    return shard_problems(config, ranks, str(model))


def _model_config(model: Path, shape: Mapping[str, Any] | None) -> Mapping[str, Any] | str | None:
    """The model's config.json (`shape` for one not fetched yet; None: not on the controller), or
    what is wrong with it."""
    config_file = model / "config.json"
    if not config_file.is_file():
        return shape
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:
        return (f"{config_file} cannot be read ({reason(error)}): fetch the model again with "
                "invoke model.fetch")
    if not isinstance(config, dict):
        return f"{config_file} holds no model configuration: fetch the model again with invoke model.fetch"
    return config


def pipeline_backend(choice: Choice, requested: str | None) -> Choice:
    """The backend a pipeline run sends point to point over. JACCL's mesh delivers wrong data when
    sends of different shapes follow each other without a barrier between them (mlx #3149), and a
    pipeline's do (the wires' header, micro-batches, a shorter last one): on a full mesh of cables
    `auto` takes jaccl-ring instead (a full mesh holds a ring, and a stage talks to its ring
    neighbours only); asked for by name (--backend jaccl), it is refused, saying what would work."""
    if choice.backend != "jaccl":
        return choice
    if requested == "jaccl":
        raise UserError("--backend jaccl with --parallel pipeline: JACCL's mesh gives wrong data when "
                        "sends of different shapes follow each other (mlx #3149), as a pipeline's do; "
                        "use --backend jaccl-ring (the mesh's cables hold a ring, which is all a pipeline "
                        "uses), or --backend auto, which takes it")
    return Choice("jaccl-ring", f"{choice.why}; a pipeline sends point to point, which JACCL's mesh "
                                "gets wrong for sends of different shapes (mlx #3149): jaccl-ring, over "
                                "a ring of the mesh's cables")


def check(cluster: Cluster, model: Path, mode: str, shape: Mapping[str, Any] | None = None,
          stages: int | None = None) -> None:
    if found := problems(cluster, model, mode, shape, stages):
        raise UserError(f"cannot train with --parallel {mode}:\n  " + "\n  ".join(found))


def line(cluster: Cluster, mode: str, stages: int | None = None) -> str | None:
    """What `invoke train` says of a tensor- or pipeline-parallel run before it starts (None: data).
    `stages`: a pipeline's (default: one per rank)."""
    ranks = cluster.world_size
    if mode == "tensor":
        return (f"tensor parallel: each of the {ranks} ranks holds 1/{ranks} of every layer's attention "
                "and MLP (and their LoRA); all train on the whole batch together")
    if mode == "pipeline" and stages and stages < ranks:
        runs = ", ".join(f"{first}-{first + stages - 1}" for first in range(0, ranks, stages))
        return (f"pipeline and data parallel: {ranks // stages} replicas of {stages} stages of whole layers "
                f"(ranks {runs}); each replica's share of a batch goes through its stages in micro-batches, "
                "and a stage's replicas average its gradients (pipeline_stages, pipeline_layers, "
                "batch_shares)")
    if mode == "pipeline":
        return (f"pipeline parallel: each of the {ranks} ranks holds a stage of whole layers, in rank "
                "order; each batch goes through the stages in micro-batches (pipeline_layers, "
                "pipeline_micro_batches)")
    return None
