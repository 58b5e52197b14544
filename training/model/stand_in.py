"""A stand-in model: a small llama of random weights in mlx-lm's layout, with a byte-level
tokenizer and a chat template, of any shape.

It rehearses a cluster without a download (tensor parallelism across N ranks needs a model with
N key-value heads, which the default SmolLM2's 3 do not give past 3), and it is the tests' tiny
model. It learns nothing worth keeping: what it shows is that a run goes through, and that N
ranks compute what one process does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.llama import Model, ModelArgs
from mlx_lm.utils import load, save_model
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SHAPE = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 260,
    "tie_word_embeddings": True,
}
# The 256 printable stand-ins byte-level BPE uses for bytes, then the special tokens.
BYTES = pre_tokenizers.ByteLevel.alphabet()
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenizer() -> PreTrainedTokenizerFast:
    """Every byte a token (no merges), and the chat's special tokens."""
    vocab = {token: i for i, token in enumerate(sorted(BYTES) + SPECIALS)}
    made = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    made.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    made.decoder = decoders.ByteLevel()
    made.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=made, eos_token="<|im_end|>", chat_template=CHAT_TEMPLATE)


def shape_for(ranks: int) -> dict[str, Any]:
    """The smallest change to SHAPE that shards across `ranks` (heads and key-value heads both
    multiples of it)."""
    heads = max(SHAPE["num_attention_heads"], ranks)
    heads += -heads % ranks
    return {"num_attention_heads": heads, "num_key_value_heads": heads, "hidden_size": 16 * heads}


def make(path: Path, *, quantized: bool = False, bits: int = 4, group_size: int = 32,
         per_layer: Mapping[str, Any] | None = None, seed: int = 0, **changes: Any) -> nn.Module:
    """Save a stand-in model to `path` (float32, or quantized as `mlx_lm convert -q` does, with
    `bits` and `group_size`, and `per_layer` its mixed quantization: a layer's path to its own
    settings, or False to leave it float), `changes` made to SHAPE; the model."""
    mx.random.seed(seed)
    config: dict[str, Any] = SHAPE | changes
    model = Model(ModelArgs.from_dict(config))
    if quantized:
        own = dict(per_layer or {})
        nn.quantize(model, group_size=group_size, bits=bits,
                    class_predicate=lambda p, m: own.get(p, True) if hasattr(m, "to_quantized") else False)
        config["quantization"] = {"group_size": group_size, "bits": bits, **own}
    mx.eval(model.parameters())
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    (path / "config.json").write_text(json.dumps(config))
    tokenizer().save_pretrained(str(path))
    return model


def adapter(model_dir: Path, out: Path, kind: str = "lora", rank: int = 4, keys: list[str] | None = None,
            seed: int = 0, layers: int = 2) -> None:
    """An adapter folder as `mlx_lm lora` writes it for the model in `model_dir` (`kind` lora or
    dora, on its last `layers` layers), with weights far enough from zero to change the answers."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _ = load(str(model_dir))
    model.freeze()
    parameters = {"rank": rank, "scale": 10.0, "dropout": 0.0, **({"keys": keys} if keys else {})}
    linear_to_lora_layers(model, layers, parameters, use_dora=kind == "dora")
    mx.random.seed(seed)
    weights = {name: mx.random.normal(value.shape) * (0.5 if name.endswith("lora_b") else 1.0)
               for name, value in tree_flatten(model.trainable_parameters())}
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    (out / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": kind, "num_layers": layers, "lora_parameters": parameters}))
