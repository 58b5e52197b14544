"""training.model: fetch a model from a local dir, the hub or a GGUF; manifests; the SmolLM2 default."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import huggingface_hub
import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm import generate, load
from mlx_lm.models.llama import Model, ModelArgs
from mlx_lm.utils import save_model
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from training import model as tm

TINY = {
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
PROMPT = mx.array([[72, 101, 108, 108, 111]])
# The 256 printable stand-ins byte-level BPE uses for bytes, then the special tokens.
BYTES = pre_tokenizers.ByteLevel.alphabet()
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(sorted(BYTES) + SPECIALS)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", chat_template=CHAT_TEMPLATE
    )


def tiny_model(path: Path, *, quantized: bool = False) -> Model:
    """A 2-layer llama saved as an mlx-lm directory (float32, or 4-bit)."""
    mx.random.seed(0)
    model = Model(ModelArgs(**TINY))
    config: dict[str, Any] = dict(TINY)
    if quantized:
        nn.quantize(model, group_size=32, bits=4)
        config["quantization"] = {"group_size": 32, "bits": 4}
    mx.eval(model.parameters())
    save_model(path, model)
    (path / "config.json").write_text(json.dumps(config))
    tiny_tokenizer().save_pretrained(str(path))
    return model


def logits(model: nn.Module) -> mx.array:
    return model(PROMPT)


def safetensors_dtypes(model_dir: Path) -> set[str]:
    return {dtype for p in model_dir.glob("model*.safetensors") for dtype in tm._safetensors_dtypes(p)}


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    path = tmp_path / "tiny"
    tiny_model(path)
    return path


def test_local_dir_is_copied_byte_for_byte_when_dtype_matches(tiny_dir: Path, tmp_path: Path):
    out = tm.fetch(str(tiny_dir), tmp_path / "out", "float32")

    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (out / name).read_bytes() == (tiny_dir / name).read_bytes()
    manifest = json.loads((out / tm.MANIFEST).read_text())
    assert manifest["source"] == str(tiny_dir)
    assert manifest["weights"] == "copied (float32)"
    assert set(manifest["files"]) == {p.name for p in out.iterdir()} - {tm.MANIFEST}
    assert tm.verify(out) == []
    model, tokenizer = load(str(out))
    assert mx.allclose(logits(model), logits(tiny_model(tmp_path / "again"))).item()
    assert tokenizer.decode(tokenizer.encode("héllo wörld")) == "héllo wörld"
    assert leftovers(tmp_path) == []


def test_local_dir_is_cast_to_the_requested_dtype(tiny_dir: Path, tmp_path: Path):
    out = tm.fetch(str(tiny_dir), tmp_path / "out", "float16")

    assert safetensors_dtypes(out) == {"F16"}
    assert json.loads((out / tm.MANIFEST).read_text())["weights"] == "cast to float16"
    model, _ = load(str(out))
    original, _ = load(str(tiny_dir))
    assert mx.allclose(logits(model).astype(mx.float32), logits(original), atol=1e-2).item()


def test_quantized_model_is_dequantized_on_request_and_kept_otherwise(tmp_path: Path):
    source = tmp_path / "tiny-4bit"
    quantized = tiny_model(source, quantized=True)

    out = tm.fetch(str(source), tmp_path / "plain", "float32", dequantize=True)
    config = json.loads((out / "config.json").read_text())
    assert "quantization" not in config and "quantization_config" not in config
    assert safetensors_dtypes(out) == {"F32"}
    assert json.loads((out / tm.MANIFEST).read_text())["weights"] == "dequantized to float32"
    assert tm.verify(out) == []
    model, _ = load(str(out))
    assert mx.allclose(logits(model), logits(quantized), atol=1e-4).item()

    kept = tm.fetch(str(source), tmp_path / "kept", "float32", dequantize=False)
    assert (kept / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()
    assert "quantization" in json.loads((kept / "config.json").read_text())


def test_incomplete_dir_names_what_is_missing_and_writes_nothing(tmp_path: Path):
    source = tmp_path / "half"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(TINY))

    with pytest.raises(tm.FetchError, match=r"missing: model\*\.safetensors \(weights\), a tokenizer"):
        tm.fetch(str(source), tmp_path / "out", "float32")
    assert not (tmp_path / "out").exists()
    assert leftovers(tmp_path) == []
    assert tm.missing_files(source) == [
        "model*.safetensors (weights)",
        f"a tokenizer ({', '.join(tm._TOKENIZER_FILES)})",
    ]


def test_failed_fetch_keeps_the_previous_model(tiny_dir: Path, tmp_path: Path):
    out = tm.fetch(str(tiny_dir), tmp_path / "out", "float32")
    before = tm.digests(out)
    (tiny_dir / "tokenizer.json").unlink()

    with pytest.raises(tm.FetchError, match="missing"):
        tm.fetch(str(tiny_dir), out, "float32")
    assert tm.digests(out) == before
    assert tm.verify(out) == []
    assert leftovers(tmp_path) == []


def test_fetch_replaces_its_own_output_but_not_someone_elses_files(tiny_dir: Path, tmp_path: Path):
    out = tm.fetch(str(tiny_dir), tmp_path / "out", "float32")
    (out / "stale.safetensors").write_text("from an older fetch")
    tm.fetch(str(tiny_dir), out, "float16")
    assert not (out / "stale.safetensors").exists()
    assert safetensors_dtypes(out) == {"F16"}

    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("precious")
    with pytest.raises(tm.FetchError, match="refusing to replace"):
        tm.fetch(str(tiny_dir), home, "float32")
    assert (home / "thesis.tex").read_text() == "precious"


def test_verify_reports_changed_missing_and_unexpected_files(tiny_dir: Path, tmp_path: Path):
    out = tm.fetch(str(tiny_dir), tmp_path / "out", "float32")
    (out / "config.json").write_text(json.dumps({**TINY, "num_hidden_layers": 3}))
    (out / "tokenizer.json").unlink()
    (out / "model-00002-of-00002.safetensors").write_bytes(b"")

    assert tm.verify(out) == [
        "missing: tokenizer.json",
        "unexpected: model-00002-of-00002.safetensors",
        "changed: config.json",
    ]
    (out / tm.MANIFEST).unlink()
    assert tm.verify(out)[0].startswith(f"{tm.MANIFEST}: unreadable")


def test_hub_repo_id_is_downloaded_then_fetched_like_a_local_dir(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    calls = []

    def snapshot_download(repo_id: str, **kwargs: Any) -> str:
        calls.append((repo_id, kwargs))
        return str(tiny_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    out = tm.fetch("mlx-community/tiny-llama", tmp_path / "out", "float32", revision="abc123")

    assert calls == [
        ("mlx-community/tiny-llama", {"revision": "abc123", "allow_patterns": tm.HUB_ALLOW_PATTERNS})
    ]
    assert {"*.json", "model*.safetensors", "tokenizer*", "*.model", "*.txt"} <= set(tm.HUB_ALLOW_PATTERNS)
    assert json.loads((out / tm.MANIFEST).read_text())["source"] == "mlx-community/tiny-llama"
    assert tm.verify(out) == []


@pytest.mark.parametrize("source", ["no-such-dir", "./org/name", "a/b/c", "missing.gguf"])
def test_unrecognised_source_is_an_error(source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(tm.FetchError, match=r"is not 'smollm2', a \.gguf file, a model directory"):
        tm.fetch(source, tmp_path / "out", "float32")


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
    assert tm.gguf_tensor_name(gguf) == mlx


@pytest.mark.parametrize("name", ["rope_freqs.weight", "blk.0.attn_qkv.weight", "blk.0.attn_q.bias"])
def test_unknown_gguf_tensors_are_refused(name: str):
    with pytest.raises(tm.FetchError, match="no counterpart"):
        tm.gguf_tensor_name(name)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_gguf_tensors_are_dequantized(bits: int):
    # mx.load hands Q4_0/Q4_1/Q8_0 GGUF tensors over as MLX affine groups of 32.
    weight = mx.random.normal((8, 96))
    packed, scales, biases = mx.quantize(weight, group_size=32, bits=bits)
    tensors = {"blk.0.ffn_up.weight": packed, "blk.0.ffn_up.scales": scales, "blk.0.ffn_up.biases": biases}

    weights = tm.gguf_weights(tensors, mx.float32)

    assert list(weights) == ["model.layers.0.mlp.up_proj.weight"]
    expected = mx.dequantize(packed, scales, biases, group_size=32, bits=bits)
    assert weights["model.layers.0.mlp.up_proj.weight"].shape == (8, 96)
    assert mx.array_equal(weights["model.layers.0.mlp.up_proj.weight"], expected).item()


def write_tiny_gguf(path: Path, model: Model) -> None:
    to_gguf = {v: k for k, v in tm._GGUF_GLOBAL_TENSORS.items()}
    layer_to_gguf = {v: k for k, v in tm._GGUF_LAYER_TENSORS.items()}
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
    plain = tm.gguf_tokenizer(tiny_gguf_metadata())
    with_bos = tm.gguf_tokenizer({**tiny_gguf_metadata(), "tokenizer.ggml.add_bos_token": mx.array(True)})

    assert plain.encode("hi") == [plain.convert_tokens_to_ids(c) for c in "hi"]
    assert with_bos.encode("hi") == [bos, *plain.encode("hi")]


def test_gguf_of_another_architecture_is_refused(tmp_path: Path):
    gguf = tmp_path / "other.gguf"
    mx.save_gguf(str(gguf), {"token_embd.weight": mx.zeros((4, 4))}, {"general.architecture": "qwen2"})
    with pytest.raises(tm.FetchError, match="architecture 'qwen2' is not supported"):
        tm.fetch(str(gguf), tmp_path / "out", "float32")
    assert leftovers(tmp_path) == []


def test_cli_fetches_and_verifies(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    out = tmp_path / "out"
    assert tm.main(["fetch", "--source", str(tiny_dir), "--output", str(out), "--dtype", "float32"]) == 0
    assert capsys.readouterr().out == f"{out}: copied (float32), 6 files\n"
    assert tm.main(["verify", str(out)]) == 0

    (out / "config.json").write_text("{}")
    assert tm.main(["verify", str(out)]) == 1
    assert capsys.readouterr().err == f"{out}: changed: config.json\n"

    assert tm.main(["fetch", "--source", str(tmp_path / "nothing"), "--output", str(out)]) == 1
    assert capsys.readouterr().err.startswith("error: model source")


SMOLLM2 = tm.cache_dir() / "smollm2" / tm.SMOLLM2_GGUF


@pytest.mark.skipif(
    not SMOLLM2.is_file(), reason=f"no SmolLM2 GGUF at {SMOLLM2} (python -m training.model fetch)"
)
def test_smollm2_converts_and_answers(tmp_path: Path):
    start = time.monotonic()
    out = tm.fetch(None, tmp_path / "smollm2", "float16")
    converted = time.monotonic() - start

    config = json.loads((out / "config.json").read_text())
    assert {
        k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "vocab_size")
    } == {
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
    }
    assert safetensors_dtypes(out) == {"F16"}
    assert converted < 20
    model, tokenizer = load(str(out))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert "Paris" in generate(model, tokenizer, prompt=prompt, max_tokens=12)
