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
from mlx_lm import generate, load

from mlxcluster.launch import shipment
from training.model import folder as tm
from training.model import manifest, stand_in

# The tests' tiny model is the stand-in model (training/model/stand_in.py), under the names
# the tests have always used.
TINY = stand_in.SHAPE
PROMPT = mx.array([[72, 101, 108, 108, 111]])
BYTES, SPECIALS, CHAT_TEMPLATE = stand_in.BYTES, stand_in.SPECIALS, stand_in.CHAT_TEMPLATE
tiny_tokenizer = stand_in.tokenizer


def tiny_model(path: Path, *, quantized: bool = False, **changes: Any) -> nn.Module:
    """A 2-layer llama saved as an mlx-lm directory (float32, or 4-bit); `changes` to its config."""
    return stand_in.make(path, quantized=quantized, **changes)


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


def test_a_quantized_model_is_kept_quantized_by_default_on_any_platform(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]):
    source = tmp_path / "tiny-4bit"
    tiny_model(source, quantized=True)
    by_default = tm.fetch(str(source), tmp_path / "default")
    assert (by_default / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()
    config = json.loads((by_default / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4}
    assert json.loads((by_default / tm.MANIFEST).read_text())["dequantize"] == "false"

    assert tm.main(["fetch", "--source", str(source), "--output", str(tmp_path / "cli")]) == 0
    assert capsys.readouterr().out.startswith(f"{tmp_path / 'cli'}: copied (quantized)")
    assert tm.main(["fetch", "--source", str(source), "--output", str(tmp_path / "asked"), "--dtype",
                    "float32", "--dequantize"]) == 0
    assert capsys.readouterr().out.startswith(f"{tmp_path / 'asked'}: dequantized to float32")


def test_only_model_files_of_a_local_dir_are_fetched(tiny_dir: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]):
    (tiny_dir / "id_ed25519").write_text("-----BEGIN OPENSSH PRIVATE KEY-----")
    (tiny_dir / ".cache" / "huggingface").mkdir(parents=True)
    (tiny_dir / ".cache" / "huggingface" / "token").write_text("hf_secret")
    (tiny_dir / "notes.md").write_text("where I got it")
    out = tmp_path / "out"

    assert tm.main(["fetch", "--source", str(tiny_dir), "--output", str(out), "--dtype", "float32"]) == 0
    assert capsys.readouterr().out == (f"{out}: copied (float32), 6 files; "
                                       "left out: id_ed25519, notes.md (not model files)\n")
    held = {str(p.relative_to(out)) for p in out.rglob("*")}
    assert not held & {"id_ed25519", "notes.md", ".cache", ".cache/huggingface/token"}
    listed = json.loads((out / tm.MANIFEST).read_text())["files"]
    assert not {"id_ed25519", "notes.md", "token"} & set(listed)
    assert all(tm.is_model_file(name) for name in listed)
    assert set(shipment.model(out).files) == {*listed, tm.MANIFEST}
    assert tm.verify(out) == []


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
    before = manifest.digests(out)
    (tiny_dir / "tokenizer.json").unlink()

    with pytest.raises(tm.FetchError, match="missing"):
        tm.fetch(str(tiny_dir), out, "float32")
    assert manifest.digests(out) == before
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
    # The shape a dry run assumes before the default model is fetched is the one it converts to.
    assert {k: config[k] for k in tm.SMOLLM2_SHAPE} == tm.SMOLLM2_SHAPE
    assert safetensors_dtypes(out) == {"F16"}
    assert converted < 20
    model, tokenizer = load(str(out))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert "Paris" in generate(model, tokenizer, prompt=prompt, max_tokens=12)


@pytest.mark.parametrize("ranks", [2, 3, 4, 5, 8])
def test_a_stand_in_model_shaped_for_n_ranks_shards_across_them(ranks: int, tmp_path: Path):
    from training.sharding import head_groups

    shape = stand_in.shape_for(ranks)
    assert shape["num_attention_heads"] % ranks == 0 and shape["num_key_value_heads"] % ranks == 0
    stand_in.make(tmp_path / "m", **shape)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert head_groups.splits(config, ranks)
