"""What a rank trains, loaded as `mlx_lm lora` loads it: the model with its trainable layers, and the data.

The model (this rank's shard of it in tensor parallelism, training/sharding/tensor_parallel.py), a
quantized one dequantized first on the ranks `dequantize_ranks` names (training/model/quantization.py),
gets the layers `fine_tune_type` trains: LoRA or DoRA layers on its last `num_layers` layers, or those
layers' own weights (full), with the same seeds on every rank; then the weights of
`resume_adapter_file`, if given. The data is read by mlx-lm's own loader: a folder in any of its
formats, or `hf_dataset` (with the `datasets` package, which a node's venv may lack).
"""

from __future__ import annotations

import hashlib
import importlib.util
import time
import types
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm import load
from mlx_lm.tuner import trainer
from mlx_lm.tuner.datasets import CacheDataset
from mlx_lm.tuner.datasets import load_dataset as mlx_lm_load_dataset
from mlx_lm.tuner.utils import linear_to_lora_layers, print_trainable_parameters

from training.config import ConfigError, FinetuneConfig
from training.loop import checkpoint
from training.loop.resume import resume_from
from training.model import quantization
from training.parallel_rules import pipeline_layer_counts, pipeline_stage_count
from training.sharding import pipeline, tensor_parallel
from training.sharding.stage_layout import PipelineLayout, stage_group


@dataclass(frozen=True)
class Loaded:
    """What this rank trains: the model with its trainable layers, and the data."""

    model: nn.Module
    train_set: Any
    valid: CacheDataset | None  # None: the data has no validation examples
    test: Any  # the test split (empty unless config.test)
    seconds: float  # how long loading took
    layout: tensor_parallel.Layout | PipelineLayout  # how the trainable parameters lie across ranks
    base_weights: str = quantization.FLOAT  # what this rank's base weights are: quantization.describe


def load_data(config: FinetuneConfig, tokenizer: Any) -> tuple[Any, Any, Any]:
    """The train, valid and test sets, read as mlx_lm lora reads them (a data folder in any of its
    formats, or hf_dataset), each that is used sized for the global batch."""
    settings = types.SimpleNamespace(**asdict(config))  # a copy: mlx-lm writes into hf_dataset's mappings
    try:
        train_set, valid_set, test_set = mlx_lm_load_dataset(settings, tokenizer)
    except ValueError as error:  # mlx-lm's words for a data set it cannot take
        raise ConfigError(f"data: {' '.join(str(error).split())}") from None
    # mlx-lm's batching needs a whole global batch of each set.
    for name, dataset in (("train", train_set), ("valid", valid_set), ("test", test_set)):
        if 0 < len(dataset) < config.batch_size:
            raise ConfigError(
                f"data: the {name} split has {len(dataset)} examples, fewer than batch_size "
                f"{config.batch_size}"
            )
    return train_set, valid_set, test_set


def data_sha256(config: FinetuneConfig) -> str:
    """What a checkpoint remembers of the data, so that a resume on other data is refused: train.jsonl's
    digest, or (hf_dataset) the digest of every file of its folders, in order."""
    if not config.hf_dataset:
        return checkpoint.file_digest(Path(config.data) / "train.jsonl")
    entries = [config.hf_dataset] if isinstance(config.hf_dataset, dict) else config.hf_dataset
    files = [f for entry in entries for f in sorted(Path(entry["path"]).rglob("*")) if f.is_file()]
    return hashlib.sha256("".join(checkpoint.file_digest(f) for f in files).encode()).hexdigest()


def check_datasets_package(config: FinetuneConfig) -> None:
    """hf_dataset is read with the datasets package, which the nodes' venv may lack."""
    if config.hf_dataset and importlib.util.find_spec("datasets") is None:
        raise ConfigError("hf_dataset is read with the datasets package, which this venv lacks: add "
                          "python_env_extra_packages: ['datasets==5.2.0'] to the inventory's vars and run "
                          "invoke provision (or pip install datasets==5.2.0)")


def add_trainable_layers(model: nn.Module, config: FinetuneConfig) -> None:
    """What fine_tune_type trains, as mlx_lm lora sets it up on a frozen model: LoRA or DoRA layers
    on the last num_layers layers, or those layers' own weights (full)."""
    if config.fine_tune_type == "full":
        for layer in model.layers[-max(config.num_layers, 0):]:
            layer.unfreeze()
    else:
        linear_to_lora_layers(model, config.num_layers, config.lora_parameters,
                              use_dora=config.fine_tune_type == "dora")


def load_base(config: FinetuneConfig, group: Any) -> tuple[nn.Module, Any, str]:
    """The whole model as mlx-lm loads it, dequantized if this rank is one of dequantize_ranks; its
    tokenizer; and its base weights in a few words. A quantized model that full cannot train here
    (mlx keeps its packed weights frozen) is refused."""
    trusted = config.trust_remote_code
    model, tokenizer, model_config = load(config.model, tokenizer_config={"trust_remote_code": trusted},
                                          trust_remote_code=trusted, return_config=True)
    ranks = quantization.parse_ranks(config.dequantize_ranks)
    if problem := quantization.full_problem(model_config, config.fine_tune_type, group.size(), ranks):
        raise ConfigError(problem)
    model, base_weights = quantization.dequantized_if_asked(model, model_config, group.rank(), ranks)
    mx.eval(model.parameters())  # dequantized now, as the rest was loaded
    return model, tokenizer, base_weights


def load_stage(config: FinetuneConfig, group: Any) -> tuple[nn.Module, Any, str, PipelineLayout]:
    """This rank's stage of the model (parallel pipeline: training/sharding/pipeline.py): read lazily,
    its trainable layers put on the whole model as one process does, then this rank's run of layers
    kept and read, nothing else; its tokenizer, base weights in a few words, and layout."""
    trusted = config.trust_remote_code
    model, tokenizer, model_config = load(config.model, tokenizer_config={"trust_remote_code": trusted},
                                          trust_remote_code=trusted, return_config=True, lazy=True)
    ranks = quantization.parse_ranks(config.dequantize_ranks)
    if problem := quantization.full_problem(model_config, config.fine_tune_type, group.size(), ranks):
        raise ConfigError(problem)
    # Still lazy: only this stage's layers (and edges) are dequantized when they are read below.
    model, base_weights = quantization.dequantized_if_asked(model, model_config, group.rank(), ranks)
    tensor_parallel.check_num_layers(model, config.num_layers)
    mx.random.seed(config.seed)
    model.freeze()
    add_trainable_layers(model, config)
    owner, _ = pipeline.layers_owner(model)
    if config.grad_checkpoint:  # every layer of the class, before the stage's edge layers get theirs
        trainer.grad_checkpoint(owner["layers"][0])
    stages = pipeline_stage_count(config, group.size())
    runs = pipeline.stage_layers(len(owner["layers"]), stages, counts=pipeline_layer_counts(config))
    # rank = replica x stages + stage (training/sharding/stage_layout.py)
    stage = pipeline.make_stage(model, group.rank() % stages, runs)
    mx.eval([layer.parameters() for layer in owner["layers"]])  # this stage's layers, read now
    layout = PipelineLayout(group, stage, stage_group(group, stage.stage, stages))
    return model, tokenizer, base_weights, layout


def load_model_and_data(config: FinetuneConfig, group: Any) -> Loaded:
    """The model with its trainable layers (from resume_adapter_file's weights if given), and the
    data. In tensor parallelism, this rank's shard of the model (training/sharding/tensor_parallel.py)."""
    started = time.monotonic()
    # Same seeds on every rank, after the model is built: the LoRA matrices start equal everywhere
    # (mlx), and equal to one process's in tensor parallelism. The batch order has its own RNG from
    # the same seed (training/data/batches.py); numpy's global one is seeded for anything else.
    if config.parallel == "tensor":
        dequantize_ranks = quantization.parse_ranks(config.dequantize_ranks)
        model, tokenizer, base_weights = tensor_parallel.load(
            config.model, group, config.num_layers, config.lora_parameters, seed=config.seed,
            dora=config.fine_tune_type == "dora", dequantize_ranks=dequantize_ranks)
    elif config.parallel == "pipeline":
        model, tokenizer, base_weights, layout = load_stage(config, group)
    else:
        model, tokenizer, base_weights = load_base(config, group)
        tensor_parallel.check_num_layers(model, config.num_layers)
        mx.random.seed(config.seed)
        model.freeze()
        add_trainable_layers(model, config)
    np.random.seed(config.seed)
    train_set, valid_set, test_set = load_data(config, tokenizer)
    # Tokenized once, on first use, for the training loop and the last validation alike.
    valid = CacheDataset(valid_set) if len(valid_set) else None
    if config.parallel != "pipeline":
        layout = tensor_parallel.Layout.of(config.parallel, group, model)
    if config.resume_adapter_file:
        resume_from(model, config.resume_adapter_file, layout)
    print_trainable_parameters(model)
    return Loaded(model, train_set, valid, test_set, time.monotonic() - started, layout, base_weights)
