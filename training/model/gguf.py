"""A llama GGUF file (llama.cpp's format) as an mlx-lm model directory.

`mx.load` reads GGUF; this module renames the tensors to mlx-lm's llama names (dequantizing
Q4_0/Q4_1/Q8_0 ones to float), writes a llama config.json from the GGUF metadata, and rebuilds the
byte-level BPE tokenizer and chat template as a Hugging Face tokenizer. `training/model/folder.py` uses it
for the embedded SmolLM2 default and for any `.gguf` source.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# llama.cpp's names for the llama tensors, as mlx-lm's llama model names them.
_GGUF_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# GGUF's Q4_0, Q4_1 and Q8_0 quantize blocks of 32 values, which mx.load keeps as MLX
# affine groups of 32 (packed uint32 weights + scales + biases).
_GGUF_GROUP_SIZE = 32
# tokenizer.ggml.pre -> does the pre-tokenizer split digits one by one before the GPT-2 regex?
_GGUF_BYTE_LEVEL_PRE = {"default": False, "gpt-2": False, "smollm": True, "starcoder": True}
_GGUF_CONTROL_TOKEN = 3
_GGUF_USER_DEFINED_TOKEN = 4


# Every source of training/model/folder.py fails with this error; it is defined here, in the lowest module
# that raises it, and training.model exports it.
class FetchError(RuntimeError):
    """A source that cannot become a model directory; the message says why."""


def gguf_tensor_name(name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`, and so on."""
    stem, _, kind = name.rpartition(".")
    if kind == "weight":
        if stem in _GGUF_GLOBAL_TENSORS:
            return f"{_GGUF_GLOBAL_TENSORS[stem]}.weight"
        match = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
        if match and match[2] in _GGUF_LAYER_TENSORS:
            return f"model.layers.{match[1]}.{_GGUF_LAYER_TENSORS[match[2]]}.weight"
    raise FetchError(f"GGUF tensor {name!r} has no counterpart in mlx-lm's llama model")


def gguf_weights(tensors: dict[str, mx.array], dtype: mx.Dtype) -> dict[str, mx.array]:
    """Rename GGUF tensors to mlx-lm's llama names, dequantizing quantized ones to `dtype`.

    mx.load returns a quantized GGUF tensor as MLX affine-quantized parts: `<name>.weight` (packed
    uint32), `<name>.scales` and `<name>.biases`. The q/k projections stay in llama.cpp's row order,
    which matches `rope_traditional: true` (see `gguf_config`).
    """
    weights = {}
    for name, tensor in tensors.items():
        if name.endswith((".scales", ".biases")):
            continue
        stem = name.removesuffix(".weight")
        if (scales := tensors.get(f"{stem}.scales")) is not None:
            # A group of 32 values has one scale and fills `bits` uint32 words.
            bits = tensor.shape[-1] // scales.shape[-1]
            tensor = mx.dequantize(
                tensor, scales, tensors.get(f"{stem}.biases"), group_size=_GGUF_GROUP_SIZE, bits=bits
            )
        weights[gguf_tensor_name(name)] = tensor.astype(dtype)
    return weights


def _scalar(metadata: dict[str, Any], key: str) -> Any:
    if key not in metadata:
        raise FetchError(f"GGUF metadata has no {key!r}")
    value = metadata[key]
    return value.item() if isinstance(value, mx.array) else value


def gguf_config(metadata: dict[str, Any], tensors: dict[str, mx.array]) -> dict[str, Any]:
    """An mlx-lm llama config.json from GGUF metadata.

    llama.cpp's converter permutes the q/k rows so that its rope can rotate adjacent pairs; MLX's
    traditional rope rotates adjacent pairs too, so `rope_traditional: true` runs the GGUF weights
    as they are. The catch: q/k LoRA adapters trained on this conversion do not fit the original
    Hugging Face checkpoint.
    """
    arch = _scalar(metadata, "general.architecture")
    if arch != "llama" or "token_embd.weight" not in tensors:
        raise FetchError(f"GGUF architecture {arch!r} is not supported (only llama)")
    if scaling := [k for k in metadata if k.startswith(f"{arch}.rope.scaling.")]:
        raise FetchError(f"GGUF rope scaling is not supported: {', '.join(sorted(scaling))}")
    hidden = int(_scalar(metadata, "llama.embedding_length"))
    heads = int(_scalar(metadata, "llama.attention.head_count"))
    head_dim = hidden // heads
    rope_dims = int(metadata.get("llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise FetchError(f"GGUF rope covers {rope_dims} of {head_dim} head dimensions: not supported")
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(_scalar(metadata, "llama.block_count")),
        "intermediate_size": int(_scalar(metadata, "llama.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(metadata.get("llama.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        # GGUF stores float32: 1e-5 would come back as 9.999999747378752e-06.
        "rms_norm_eps": float(f"{_scalar(metadata, 'llama.attention.layer_norm_rms_epsilon'):.7g}"),
        "rope_theta": float(metadata.get("llama.rope.freq_base", 10000.0)),
        "rope_traditional": True,
        # The embedding may have more rows than the tokenizer has tokens (padding).
        "vocab_size": tensors["token_embd.weight"].shape[0],
        "max_position_embeddings": int(_scalar(metadata, "llama.context_length")),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": int(_scalar(metadata, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_scalar(metadata, "tokenizer.ggml.eos_token_id")),
    }


def gguf_tokenizer(metadata: dict[str, Any]) -> PreTrainedTokenizerFast:
    """The byte-level BPE tokenizer (vocab, merges, special tokens, chat template) of a GGUF."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    kind = _scalar(metadata, "tokenizer.ggml.model")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre not in _GGUF_BYTE_LEVEL_PRE:
        raise FetchError(
            f"GGUF tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported "
            f"(byte-level BPE 'gpt2' with one of {sorted(_GGUF_BYTE_LEVEL_PRE)})"
        )
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types = metadata["tokenizer.ggml.token_type"].tolist()
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(
        models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges, fuse_unk=False)
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if _GGUF_BYTE_LEVEL_PRE[pre]:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level]
        )
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens(
        [
            AddedToken(text, special=token_type == _GGUF_CONTROL_TOKEN, normalized=False)
            for text, token_type in zip(tokens, types, strict=True)
            if token_type in (_GGUF_CONTROL_TOKEN, _GGUF_USER_DEFINED_TOKEN)
        ]
    )

    def special(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return None if index is None else tokens[int(index.item())]

    bos = special("bos")
    if bos is not None and bool(metadata.get("tokenizer.ggml.add_bos_token", False)):
        bos_id = int(metadata["tokenizer.ggml.bos_token_id"].item())
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=bos,
        eos_token=special("eos"),
        unk_token=special("unknown"),
        pad_token=special("padding"),
        chat_template=metadata.get("tokenizer.chat_template"),
        model_max_length=int(_scalar(metadata, "llama.context_length")),
        clean_up_tokenization_spaces=False,
    )


def convert_gguf(gguf: Path, output: Path, dtype: str) -> None:
    """Write config.json, model.safetensors and the tokenizer of a llama GGUF into `output`."""
    tensors, metadata = mx.load(str(gguf), return_metadata=True)
    assert isinstance(tensors, dict)
    config = gguf_config(metadata, tensors)
    tokenizer = gguf_tokenizer(metadata)
    weights = gguf_weights(tensors, getattr(mx, dtype))
    mx.save_safetensors(str(output / "model.safetensors"), weights, metadata={"format": "mlx"})
    (output / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(str(output))
