"""What a run trains, for its plan: the model's files read (config.json and the safetensors headers,
no weight), its settings, and the longest example of its data in tokens, tokenized as the ranks
tokenize it (mlx-lm's datasets, with the model's tokenizer), since the batch holding it is the
step whose memory peaks.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from mlxcluster.describe.cluster import Cluster
from mlxcluster.errors import UserError
from mlxcluster.paths import REPO
from mlxcluster.plan import model as model_files
from mlxcluster.plan.ranks import Job, padded
from training.config import FinetuneConfig
from training.model import quantization

# The longest examples of each data folder, tokenizer and prompt setting measured so far: a data set
# is tokenized once, not at every run's start.
LENGTHS = REPO / "build" / "plan-lengths.json"
# The settings that change which examples there are and their tokens.
TOKENIZING = ("mask_prompt", "hf_dataset", "val_batches", "trust_remote_code", "prompt_feature",
              "completion_feature", "text_feature", "chat_feature")


def _stamp(folder: Path) -> list[tuple[str, int, int]]:
    """What changes when a folder's files do: each file's name, size and modification time."""
    return sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in folder.iterdir() if f.is_file())


def cached_longest(settings: FinetuneConfig, model_dir: Path, data_dir: Path) -> tuple[int, int, float]:
    """longest_examples, kept in LENGTHS under what they depend on (the data's files, the model's
    tokenizer files, the settings that change the tokens)."""
    key = hashlib.sha256(json.dumps([_stamp(data_dir), str(model_dir.resolve()),
                                     [s for s in _stamp(model_dir) if not s[0].endswith(".safetensors")],
                                     [getattr(settings, name, None) for name in TOKENIZING]],
                                    sort_keys=True, default=str).encode()).hexdigest()
    try:
        known = json.loads(LENGTHS.read_text())
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(found := known.get(key), list) and len(found) == 3:
        return found[0], found[1], found[2]
    longest = longest_examples(settings, model_dir, data_dir)
    LENGTHS.parent.mkdir(parents=True, exist_ok=True)
    partial = LENGTHS.with_name(f".{LENGTHS.name}.{os.getpid()}")
    partial.write_text(json.dumps({**(known if isinstance(known, dict) else {}), key: list(longest)}))
    partial.replace(LENGTHS)
    return longest


def longest_examples(settings: FinetuneConfig, model_dir: Path, data_dir: Path) -> tuple[int, int, float]:
    """The tokens of the longest training and validation examples (0: no validation split), and
    the training examples' mean (what a step's speed counts), as the ranks tokenize them (with
    the end of sequence mlx-lm adds); a UserError when the data cannot be read as mlx_lm lora
    reads it."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer  # seconds to import: only for a plan

    from training import loading
    from training.config import ConfigError

    tokenizer = load_tokenizer(model_dir, {"trust_remote_code": settings.trust_remote_code})
    try:
        train, valid, _ = loading.load_data(replace(settings, data=str(data_dir)), tokenizer)
    except ConfigError as error:
        raise UserError(str(error)) from None
    except (OSError, ValueError) as error:  # mlx-lm's and the datasets package's words for no data
        raise UserError(f"data {data_dir}: {' '.join(str(error).split())}") from None

    def lengths(split: Any) -> list[int]:
        return [len(split.process(split[i])[0]) for i in range(len(split))]

    trained = lengths(train) or [1]
    return (max(trained), max(lengths(valid), default=0) if settings.val_batches else 0,
            round(sum(trained) / len(trained), 2))


def compiled_on(cluster: Cluster) -> bool:
    """Whether the ranks compile their step: the nodes do; a cluster of this machine's own
    processes (the embedded default, the unit tests' rings) as this process's environment says."""
    local = all(node.connection.get("type") == "local" for node in cluster.training_nodes)
    return not (local and os.environ.get("MLX_DISABLE_COMPILE"))


def job_for(settings: FinetuneConfig, model_dir: Path, data_dir: Path | None,
            longest: tuple[int, int, float] | None = None, *, compiled: bool = True) -> Job | None:
    """The job these settings train on this model and data (None: the model's files are not on
    the controller, or its config.json does not say its widths). `longest`: the longest example's
    training and validation examples' tokens and the training mean when known (else read from the data, or
    max_seq_length without data); `compiled`: as compiled_on says of the cluster."""
    found = model_files.weights(model_dir, by_layer=True, linears=True)
    shape = model_files.Shape.of(model_files.read_config(model_dir))
    if found is None or shape is None:
        return None
    if longest is None:
        longest = (cached_longest(settings, model_dir, data_dir) if data_dir and data_dir.is_dir()
                   else (settings.max_seq_length, settings.max_seq_length, settings.max_seq_length))
    lora = settings.lora_parameters or {}
    dequantizing = quantization.parse_ranks(settings.dequantize_ranks) if found.quantized else []
    valid = padded(longest[1], settings.max_seq_length) if longest[1] else 0
    return Job(found, shape, padded(longest[0], settings.max_seq_length), settings.batch_size, valid,
               settings.fine_tune_type, int(lora.get("rank", 8)), settings.num_layers, settings.optimizer,
               settings.grad_checkpoint, frozenset(dequantizing),
               compiled=compiled, lora_keys=tuple(lora["keys"]) if lora.get("keys") else None,
               mean_length=min(longest[2], settings.max_seq_length))
