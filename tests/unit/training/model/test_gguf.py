"""training.model.gguf: llama GGUF files (tensors, config, tokenizer) as mlx-lm model directories."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.models.llama import Model, ModelArgs

from tests.unit.training.model.test_folder import BYTES, CHAT_TEMPLATE, SPECIALS, TINY, leftovers, logits
from training.model import folder as tm
from training.model import gguf as tg


@pytest.mark.parametrize(
    ("gguf", "mlx"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("blk.1.attn_k.weight", "model.layers.1.self_attn.k_proj.weight"),
        ("blk.2.attn_v.weight", "model.layers.2.self_attn.v_proj.weight"),
        ("blk.3.attn_output.weight", "model.layers.3.self_attn.o_proj.weight"),
        ("blk.4.ffn_gate.weight", "model.layers.4.mlp.gate_proj.weight"),
        ("blk.5.ffn_up.weight", "model.layers.5.mlp.up_proj.weight"),
        ("blk.6.ffn_down.weight", "model.layers.6.mlp.down_proj.weight"),
        ("blk.7.attn_norm.weight", "model.layers.7.input_layernorm.weight"),
        ("blk.29.ffn_norm.weight", "model.layers.29.post_attention_layernorm.weight"),
    ],
)
def test_gguf_tensor_names_map_to_mlx_lm_llama_names(gguf: str, mlx: str):
    assert tg.gguf_tensor_name(gguf) == mlx


@pytest.mark.parametrize("name", ["rope_freqs.weight", "blk.0.attn_qkv.weight", "blk.0.attn_q.bias"])
def test_unknown_gguf_tensors_are_refused(name: str):
    with pytest.raises(tm.FetchError, match="no counterpart"):
        tg.gguf_tensor_name(name)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_gguf_tensors_are_dequantized(bits: int):
    # mx.load hands Q4_0/Q4_1/Q8_0 GGUF tensors over as MLX affine groups of 32.
    weight = mx.random.normal((8, 96))
    packed, scales, biases = mx.quantize(weight, group_size=32, bits=bits)
    tensors = {"blk.0.ffn_up.weight": packed, "blk.0.ffn_up.scales": scales, "blk.0.ffn_up.biases": biases}

    weights = tg.gguf_weights(tensors, mx.float32)

    assert list(weights) == ["model.layers.0.mlp.up_proj.weight"]
    expected = mx.dequantize(packed, scales, biases, group_size=32, bits=bits)
    assert weights["model.layers.0.mlp.up_proj.weight"].shape == (8, 96)
    assert mx.array_equal(weights["model.layers.0.mlp.up_proj.weight"], expected).item()


def write_tiny_gguf(path: Path, model: Model) -> None:
    to_gguf = {v: k for k, v in tg._GGUF_GLOBAL_TENSORS.items()}
    layer_to_gguf = {v: k for k, v in tg._GGUF_LAYER_TENSORS.items()}
    tensors = {}
    for name, value in tree_flatten(model.parameters()):
        stem = name.removesuffix(".weight")
        if stem in to_gguf:
            tensors[f"{to_gguf[stem]}.weight"] = value
        else:
            _, _, layer, rest = stem.split(".", 3)
            tensors[f"blk.{layer}.{layer_to_gguf[rest]}.weight"] = value
    mx.save_gguf(str(path), tensors, tiny_gguf_metadata())


def uint(n: int) -> mx.array:
    return mx.array(n, dtype=mx.uint32)


def tiny_gguf_metadata() -> dict[str, Any]:
    vocab = sorted(BYTES) + SPECIALS
    return {
        "general.architecture": "llama",
        "llama.embedding_length": uint(TINY["hidden_size"]),
        "llama.block_count": uint(TINY["num_hidden_layers"]),
        "llama.feed_forward_length": uint(TINY["intermediate_size"]),
        "llama.attention.head_count": uint(TINY["num_attention_heads"]),
        "llama.attention.head_count_kv": uint(TINY["num_key_value_heads"]),
        "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5, dtype=mx.float32),
        "llama.rope.freq_base": mx.array(10000.0, dtype=mx.float32),
        "llama.context_length": uint(128),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": vocab,
        "tokenizer.ggml.token_type": mx.array([1] * len(BYTES) + [3] * len(SPECIALS), dtype=mx.int32),
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": uint(vocab.index("<|im_start|>")),
        "tokenizer.ggml.eos_token_id": uint(vocab.index("<|im_end|>")),
        "tokenizer.ggml.padding_token_id": uint(vocab.index("<|endoftext|>")),
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


def test_gguf_file_converts_to_a_model_that_computes_the_same(tmp_path: Path):
    mx.random.seed(0)
    # GGUF q/k rows are laid out for traditional rope, so the reference model uses it too.
    reference = Model(ModelArgs(**TINY, rope_traditional=True))
    mx.eval(reference.parameters())
    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, reference)

    out = tm.fetch(str(gguf), tmp_path / "out", "float32")

    config = json.loads((out / "config.json").read_text())
    assert config["rope_traditional"] is True
    assert config["tie_word_embeddings"] is True
    assert config["rms_norm_eps"] == 1e-5
    assert config["vocab_size"] == TINY["vocab_size"]  # the embedding's rows, one more than tokens
    assert tm.verify(out) == []
    model, tokenizer = load(str(out))
    assert mx.allclose(logits(model), logits(reference), atol=1e-5).item()
    # Digits are split one by one, as llama.cpp's 'smollm' pre-tokenizer does.
    assert tokenizer.encode("a 123") == [
        tokenizer.convert_tokens_to_ids(c) for c in ["a", "Ġ", "1", "2", "3"]
    ]
    assert tokenizer.decode(tokenizer.encode("héllo <|im_end|>")) == "héllo <|im_end|>"
    assert tokenizer.eos_token_ids == {len(BYTES) + 2}
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert tokenizer.decode(prompt) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_gguf_tokenizer_prepends_bos_when_the_gguf_says_so():
    bos = len(BYTES) + SPECIALS.index("<|im_start|>")
    plain = tg.gguf_tokenizer(tiny_gguf_metadata())
    with_bos = tg.gguf_tokenizer({**tiny_gguf_metadata(), "tokenizer.ggml.add_bos_token": mx.array(True)})

    assert plain.encode("hi") == [plain.convert_tokens_to_ids(c) for c in "hi"]
    assert with_bos.encode("hi") == [bos, *plain.encode("hi")]


def test_gguf_of_another_architecture_is_refused(tmp_path: Path):
    gguf = tmp_path / "other.gguf"
    mx.save_gguf(str(gguf), {"token_embd.weight": mx.zeros((4, 4))}, {"general.architecture": "qwen2"})
    with pytest.raises(tm.FetchError, match="architecture 'qwen2' is not supported"):
        tm.fetch(str(gguf), tmp_path / "out", "float32")
    assert leftovers(tmp_path) == []
