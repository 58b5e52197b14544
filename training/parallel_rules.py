"""What tensor and pipeline parallelism can train, checked on the settings alone (config_problems
calls these for every run, on the controller and on each rank), and the pipeline's numbers read
from them. Whether a model's own shape allows a split is training/sharding/'s to say once it is read."""

from __future__ import annotations

from typing import Any

# Each function takes the run's settings, a training.config.FinetuneConfig (which imports this module).
FinetuneConfig = Any


# Optimizers whose update of a matrix depends on the whole matrix at once, which no rank holds
# in tensor parallelism: Muon orthogonalizes it (Newton-Schulz), Adafactor factors its second
# moments into row and column means and scales by its RMS.
WHOLE_MATRIX_OPTIMIZERS = ("muon", "adafactor")


def tensor_problems(config: FinetuneConfig, world_size: int) -> list[str]:
    """What tensor parallelism cannot do exactly, said with the reason (and what to do instead)."""
    problems = []
    if world_size < 2:
        problems.append("parallel tensor needs at least 2 ranks to shard the model across; one process "
                        "trains with parallel data")
    if config.fine_tune_type == "full":
        problems.append("fine_tune_type full with parallel tensor: the trained weights would be the "
                        "model's own, gathered whole on rank 0 to be saved, which a model too big for one "
                        "node cannot be; train lora or dora with parallel tensor, or full with parallel data")
    if config.optimizer in WHOLE_MATRIX_OPTIMIZERS:
        problems.append(f"optimizer {config.optimizer} with parallel tensor: its update of a matrix needs "
                        "the whole matrix, and each rank holds a shard; use adam, adamw or sgd, or "
                        "parallel data")
    return problems


def pipeline_problems(config: FinetuneConfig, world_size: int) -> list[str]:
    """What parallel pipeline is given that it cannot take, said with what to do instead. (Whether the
    stages fit the model's layers is known once its config is read: training/sharding/pipeline.py.)"""
    problems = []
    if config.parallel != "pipeline":
        for key in ("pipeline_layers", "pipeline_stages", "pipeline_micro_batches"):
            if getattr(config, key) not in (None, 0):
                problems.append(f"{key} is for parallel pipeline; this run is parallel {config.parallel}")
        return problems
    if world_size < 2:
        problems.append("parallel pipeline needs at least 2 ranks to hold the stages; one process trains "
                        "with parallel data")
    if config.pipeline_micro_batches < 0:
        problems.append(f"pipeline_micro_batches must be 0 (twice the stages) or more, got "
                        f"{config.pipeline_micro_batches}")
    elif config.pipeline_micro_batches > config.batch_size >= 1:
        problems.append(f"pipeline_micro_batches {config.pipeline_micro_batches} is more than the "
                        f"{config.batch_size} examples of a batch; use at most {config.batch_size}")
    problems += stage_problems(config, world_size)
    if config.max_micro_batch is not None:
        problems.append("max_micro_batch with parallel pipeline: every stage trains on its replica's whole "
                        "share of the batch in pipeline_micro_batches micro-batches; set those for memory")
    return problems


def stage_problems(config: FinetuneConfig, world_size: int) -> list[str]:
    """pipeline_stages and pipeline_layers: whole numbers that agree with each other and the ranks."""
    stages = config.pipeline_stages
    if not isinstance(stages, int) or stages < 0 or stages == 1:
        return [f"pipeline_stages must be 0 (one stage per rank) or at least 2, got {stages}"]
    if stages and world_size % stages:
        fits = [n for n in range(2, world_size + 1) if world_size % n == 0]
        return [f"pipeline_stages {stages} does not divide the {world_size} ranks into replicas of the "
                f"stages: use one of {', '.join(map(str, fits)) or 'none (add ranks)'}"]
    if config.pipeline_layers is None:
        return []
    try:
        counts = pipeline_layer_counts(config) or []
    except ValueError:
        counts = []
    wanted = pipeline_stage_count(config, world_size)
    if len(counts) != wanted or min(counts, default=0) < 1:
        return [f"pipeline_layers {config.pipeline_layers}: give {wanted} whole numbers of at least 1, "
                "the layers of each stage in rank order (e.g. 10,14,6), as many as the stages "
                "(pipeline_stages, or a number that divides the ranks)"]
    return []


def pipeline_stage_count(config: FinetuneConfig, world_size: int) -> int:
    """The stages of a pipeline run on `world_size` ranks: pipeline_stages, else as many as
    pipeline_layers gives when that divides the ranks, else one per rank."""
    if config.pipeline_stages:
        return config.pipeline_stages
    try:
        counts = pipeline_layer_counts(config)
    except ValueError:  # a word: stage_problems says so
        return world_size
    return len(counts) if counts and len(counts) >= 2 and world_size % len(counts) == 0 else world_size


def pipeline_replicas(config: FinetuneConfig, world_size: int) -> int:
    """The replicas of the stages that split each batch of a pipeline run (1: the stages alone)."""
    return max(1, world_size // pipeline_stage_count(config, world_size))


def pipeline_layer_counts(config: FinetuneConfig) -> list[int] | None:
    """pipeline_layers as numbers (`10,14,6`: the layers of each rank); None when not set. A ValueError
    for a word that is not a number (config_problems says so in its words)."""
    if config.pipeline_layers is None:
        return None
    return [int(part) for part in str(config.pipeline_layers).split(",")]


def pipeline_micro_batches(config: FinetuneConfig, stages: int) -> int:
    """The micro-batches a replica's share of a batch goes through the stages in (at most its rows:
    training/sharding/pipeline.py's micro_rows)."""
    return config.pipeline_micro_batches or min(config.batch_size, 2 * stages)
