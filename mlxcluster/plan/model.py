"""The model as its files describe it, no weight read: its shape from config.json and its tensors
from the safetensors headers (their names, dtypes and shapes).

What a rank holds is read from the headers: the bytes stored, the float bytes a rank that
dequantizes a quantized model holds (a packed weight of a quantized layer has `group_size` inputs
per scale, so its float elements are its scales' count times `group_size`, at the itemsize of the
model's float tensors, what dequantizing makes as training/model/quantization.py's float_dtype
chooses it), the bytes of each layer of the body (a pipeline stage's), and every linear layer of
the body with its inputs and outputs (what LoRA adapts). What a rank computes is read from
config.json: the hidden width, the MLP's, the attention heads, the vocabulary, under the names the
mlx-lm architectures give them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from mlxcluster.launch.stages import LAYER_KEYS, NESTED_CONFIGS, Body
from training.model import quantization

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
class Linear:
    """A linear layer of the body, as LoRA sees it: its layer, path in the layer, and sizes."""

    layer: int
    path: str  # `self_attn.q_proj`
    inputs: int
    outputs: int
    experts: int = 1  # a mixture of experts' SwitchLinear: one matrix per expert


def linears_of(tensors: Mapping[str, Tensor], config: Mapping[str, Any]) -> tuple[Linear, ...]:
    """Every linear layer of the body: a 2-D (or, for experts, 3-D) `weight` of a numbered layer,
    its inputs read from its scales where it is packed."""
    found = []
    for name, tensor in tensors.items():
        match = LAYER_NAME.search(name)
        if not match or not name.endswith(".weight") or len(tensor.shape) not in (2, 3):
            continue
        layer = name.removesuffix(".weight")
        inputs = tensor.shape[-1]
        if (scales := tensors.get(f"{layer}.scales")) is not None:
            settings = quantization.of_layer(config, layer) or {"group_size": 64}
            inputs = scales.shape[-1] * settings["group_size"]
        experts = tensor.shape[0] if len(tensor.shape) == 3 else 1
        path = layer[match.end():]
        found.append(Linear(int(match.group(1)), path, inputs, tensor.shape[-2], experts))
    return tuple(sorted(found, key=lambda linear: (linear.layer, linear.path)))


@dataclass(frozen=True)
class Weights:
    """A model folder's weights: as stored, and as a rank that dequantizes them holds them."""

    stored: int  # bytes of its safetensors files
    dequantized: int  # bytes once every quantized layer is float (== stored for a float model)
    quantized: bool
    body: Body | None = None  # by layer, when asked for (a pipeline run) and readable
    # Every linear of the body (what LoRA adapts), and the itemsize of its float tensors, when the
    # headers were read (a plan).
    linears: tuple[Linear, ...] = field(default=(), compare=False)
    float_itemsize: int = 4


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


def _packed(tensors: Mapping[str, Tensor]) -> set[str]:
    return {name.removesuffix(".scales") for name in tensors if name.endswith(".scales")}


def dequantized_bytes(tensors: Mapping[str, Tensor], config: Mapping[str, Any]) -> int:
    """The weights' bytes once every quantized layer is dequantized: a packed weight becomes
    (scales x group_size) float elements; its scales and biases go."""
    packed = _packed(tensors)
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


def read_config(model_dir: Path) -> dict[str, Any]:
    """The folder's config.json ({}: none, or not a mapping)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def weights(model_dir: Path, *, by_layer: bool = False, linears: bool = False) -> Weights | None:
    """The folder's weights (None: no folder, or no safetensors in it, e.g. a hub id not fetched).
    The headers are read for a quantized model, `by_layer` (a pipeline run: each stage's bytes)
    or `linears` (a plan: what LoRA adapts); weights that cannot be read count as their size on
    disk (the ranks say what is wrong with them when they load them)."""
    files = sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else []
    if not files:
        return None
    stored = sum(f.stat().st_size for f in files)
    config = read_config(model_dir)
    quantized = quantization.is_quantized(config)
    if not quantized and not by_layer and not linears:
        return Weights(stored, stored, quantized=False)
    try:
        tensors = headers(files)
    except (OSError, SafetensorError):
        return Weights(stored, stored, quantized=quantized)
    body = body_of(tensors) if by_layer or linears else None
    dequantized = dequantized_bytes(tensors, config) if quantized else stored
    return Weights(stored, dequantized, quantized, body,
                   linears_of(tensors, config) if linears else (),
                   ITEMSIZE[_float_dtype(tensors, _packed(tensors))])


def _first(config: Mapping[str, Any], keys: Iterable[str]) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


# Where config.json says the longest sequence a model takes, under the names mlx-lm's models use
# (training/serve/server.py's context_length reads the same, and refuses a longer request).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "max_seq_len", "seq_length")


@dataclass(frozen=True)
class Shape:
    """What a rank computes per token, from config.json: the widths its activations have."""

    hidden: int
    layers: int
    mlp: int  # the MLP's inner width a token goes through (a mixture of experts': its active experts')
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    positions: int | None = None  # the longest sequence it was trained for, where config.json says

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> Shape | None:
        """The shape config.json gives, under any mlx-lm architecture's names (a multimodal
        model's language model's); None: a width it does not say."""
        for key in NESTED_CONFIGS:
            if isinstance(nested := config.get(key), Mapping) and (found := cls.of(nested)):
                return found
        hidden = _first(config, ("hidden_size", "n_embd", "d_model", "dim", "model_dim"))
        layers = _first(config, LAYER_KEYS)
        heads = _first(config, ("num_attention_heads", "n_head", "n_heads", "num_heads"))
        vocab = _first(config, ("vocab_size", "padded_vocab_size", "n_vocab"))
        if not (hidden and layers and heads and vocab):
            return None
        mlp = _first(config, ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size")) or 4 * hidden
        if (expert := _first(config, ("moe_intermediate_size",))) and (
                active := _first(config, ("num_experts_per_tok", "top_k", "moe_top_k"))):
            mlp = expert * active + (_first(config, ("shared_expert_intermediate_size",)) or 0)
        kv_heads = _first(config, ("num_key_value_heads", "n_kv_heads", "num_kv_heads",
                                   "multi_query_group_num"))
        head_dim = _first(config, ("head_dim", "kv_channels")) or hidden // heads
        positions = _first(config, CONTEXT_KEYS)
        return cls(hidden, layers, mlp, heads, kv_heads or heads, head_dim, vocab, positions)
