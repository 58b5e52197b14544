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
        for key in ("pipeline_layers", "pipeline_micro_batches"):
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
    if config.pipeline_layers is not None:
        try:
            counts = pipeline_layer_counts(config) or []
        except ValueError:
            counts = []
        if len(counts) != world_size or min(counts, default=0) < 1:
            problems.append(f"pipeline_layers {config.pipeline_layers}: give {world_size} whole numbers of "
                            "at least 1, the layers of each rank in rank order (e.g. 10,14,6)")
    for key in ("batch_shares", "max_micro_batch", "dequantize_ranks"):
        if getattr(config, key) is not None:
            problems.append(f"{key} with parallel pipeline: not yet; every stage trains on the whole batch "
                            "(set pipeline_micro_batches for memory) on the model as loaded")
    return problems


def pipeline_layer_counts(config: FinetuneConfig) -> list[int] | None:
    """pipeline_layers as numbers (`10,14,6`: the layers of each rank); None when not set. A ValueError
    for a word that is not a number (config_problems says so in its words)."""
    if config.pipeline_layers is None:
        return None
    return [int(part) for part in str(config.pipeline_layers).split(",")]


def pipeline_micro_batches(config: FinetuneConfig, world_size: int) -> int:
    """The micro-batches a pipeline batch goes through the stages in."""
    return config.pipeline_micro_batches or min(config.batch_size, 2 * world_size)
