"""`python -m training.tools.fuse` against stock `mlx_lm fuse`: the same tensors and config for LoRA,
DoRA on a 4-bit model, a full fine-tune and a dequantized fuse, written file by file; a float or
dequantized fused model answers as the base with `--adapter-path` does, token for token; file by
file holds one file of weights, stock the model; the GGUF file holds the fused model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load, stream_generate
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from training.model import gguf, stand_in
from training.tools import fuse

PROMPT = "Who are you?"


def weights_of(folder: Path) -> dict[str, mx.array]:
    found: dict[str, mx.array] = {}
    for file in sorted(folder.glob("*.safetensors")):
        found.update(mx.load(str(file)))
    return found


def assert_same_weights(ours: Path, stock: Path) -> None:
    mine, theirs = weights_of(ours), weights_of(stock)
    assert sorted(mine) == sorted(theirs)
    different = [name for name in mine if mine[name].dtype != theirs[name].dtype
                 or not mx.array_equal(mine[name], theirs[name]).item()]
    assert different == []


def greedy(model_dir: Path, adapter: Path | None = None, tokens: int = 12) -> list[int]:
    model, tokenizer = load(str(model_dir), adapter_path=str(adapter) if adapter else None)
    ids = tokenizer.encode(PROMPT)
    return [step.token for step in stream_generate(model, tokenizer, ids, max_tokens=tokens)]


def run(*args: str | Path, module: str = "training.tools.fuse") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *module.split(), *map(str, args)], capture_output=True,
                          text=True, timeout=300, check=True, stdin=subprocess.DEVNULL)


def fused_by_file(model: Path, adapter: Path, out: Path, *more: str, max_file_mb: str = "0.02") -> dict:
    return json.loads(run("--model", model, "--adapter-path", adapter, "--save-path", out,
                          "--max-file-mb", max_file_mb, *more).stdout.splitlines()[-1])


def fused_by_stock(model: Path, adapter: Path, out: Path, *more: str) -> None:
    run("fuse", "--model", model, "--adapter-path", adapter, "--save-path", out, *more, module="mlx_lm")


def full_fine_tune(model_dir: Path, out: Path) -> None:
    """A full fine-tune's folder as `mlx_lm lora --fine-tune-type full` writes it: every weight changed."""
    model, _ = load(str(model_dir))
    mx.random.seed(5)
    changed = {name: value + 0.05 * mx.random.normal(value.shape)
               for name, value in tree_flatten(model.parameters())}
    out.mkdir()
    mx.save_safetensors(str(out / "adapters.safetensors"), changed)
    (out / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "full", "num_layers": 2}))


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuse")
    stand_in.make(root / "float", seed=1)
    stand_in.make(root / "q4", quantized=True, bits=4, group_size=32, seed=1)
    stand_in.adapter(root / "float", root / "lora", "lora", 4, seed=0)
    stand_in.adapter(root / "q4", root / "dora", "dora", 2, ["self_attn.q_proj", "mlp.down_proj"], seed=1)
    full_fine_tune(root / "float", root / "full")
    return root


@pytest.mark.parametrize(("base", "adapter"), [("float", "lora"), ("q4", "dora"), ("float", "full")])
def test_file_by_file_writes_stocks_tensors_and_answers_as_the_adapters_do(made: Path, tmp_path: Path,
                                                                           base: str, adapter: str) -> None:
    fused_by_stock(made / base, made / adapter, tmp_path / "stock")
    said = fused_by_file(made / base, made / adapter, tmp_path / "ours")

    assert len(said["files"]) > 1
    assert said["files"] == sorted(p.name for p in (tmp_path / "ours").glob("*.safetensors"))
    assert_same_weights(tmp_path / "ours", tmp_path / "stock")
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(said["files"])
    assert json.loads((tmp_path / "ours" / "config.json").read_text()) == \
        json.loads((tmp_path / "stock" / "config.json").read_text())
    # Stock generate loads it. A float base fused answers as the base with the adapters does; a
    # quantized one is quantized again once fused, as stock does it, which moves its answers.
    answer = greedy(tmp_path / "ours")
    assert answer != greedy(made / base)
    if base == "float":
        assert answer == greedy(made / base, made / adapter)


def test_dequantized_fuse_is_stocks_and_float(made: Path, tmp_path: Path) -> None:
    fused_by_stock(made / "q4", made / "dora", tmp_path / "stock", "--dequantize")
    fused_by_file(made / "q4", made / "dora", tmp_path / "ours", "--dequantize")

    assert_same_weights(tmp_path / "ours", tmp_path / "stock")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert "quantization" not in config and "quantization_config" not in config
    assert not [name for name in weights_of(tmp_path / "ours") if name.endswith(".scales")]
    assert greedy(tmp_path / "ours") == greedy(made / "q4", made / "dora")


def test_file_by_file_holds_a_file_of_weights_where_stock_holds_the_model(tmp_path: Path) -> None:
    # ~200 MB of float32 weights in 12 layers; file by file writes 8 MB at a time.
    stand_in.make(tmp_path / "model", hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=8, num_key_value_heads=8)
    stand_in.adapter(tmp_path / "model", tmp_path / "lora", "lora", 8, layers=12)
    size = sum(f.stat().st_size for f in (tmp_path / "model").glob("*.safetensors"))
    stock = subprocess.run(["/usr/bin/time", "-f", "%M", sys.executable, "-m", "mlx_lm", "fuse", "--model",
                            str(tmp_path / "model"), "--adapter-path", str(tmp_path / "lora"), "--save-path",
                            str(tmp_path / "stock")], capture_output=True, text=True, check=True,
                           stdin=subprocess.DEVNULL)
    stock_peak = int(stock.stderr.split()[-1]) * 1024  # GNU time's %M: the command's own peak, in KiB
    ours_peak = fused_by_file(tmp_path / "model", tmp_path / "lora", tmp_path / "ours",
                              max_file_mb="8")["peak_rss_bytes"]

    assert stock_peak - ours_peak > size / 2, (stock_peak, ours_peak, size)
    assert_same_weights(tmp_path / "ours", tmp_path / "stock")


def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama 2-like vocabulary (sentencepiece pieces, byte fallback), the stand-in's size."""
    pieces = ["<unk>", *(f"<0x{b:02X}>" for b in range(256))]
    made = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], byte_fallback=True,
                                unk_token="<unk>"))
    made.pre_tokenizer = pre_tokenizers.Metaspace()
    made.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    made.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<pad>")])
    return PreTrainedTokenizerFast(tokenizer_object=made, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def test_gguf_file_holds_the_fused_model(made: Path, tmp_path: Path) -> None:
    base = tmp_path / "base"
    stand_in.make(base, seed=1, max_position_embeddings=128)  # what a GGUF file must say
    sentencepiece_tokenizer().save_pretrained(str(base))
    fused_by_file(base, made / "lora", tmp_path / "ours", "--gguf-path", str(tmp_path / "model.gguf"))

    tensors, metadata = mx.load(str(tmp_path / "model.gguf"), return_metadata=True)
    config = gguf.gguf_config(metadata, tensors)
    from mlx_lm.models.llama import Model, ModelArgs

    read_back = Model(ModelArgs.from_dict(config))
    read_back.load_weights(list(gguf.gguf_weights(tensors, mx.float32).items()))
    fused, _ = load(str(tmp_path / "ours"))
    ids = mx.array([[1, 70, 80, 90, 100, 110]])
    assert mx.allclose(read_back(ids), fused(ids), atol=1e-4).item()


def test_gguf_refusals(made: Path) -> None:
    q4 = json.loads((made / "q4" / "config.json").read_text())
    assert "add --dequantize" in fuse.gguf_refusal(made / "q4", q4, dequantize=False)
    # The stand-in's vocabulary is byte-level, as SmolLM2's and Llama 3's are.
    assert "convert_hf_to_gguf.py" in fuse.gguf_refusal(made / "q4", q4, dequantize=True)
    assert "not 'qwen2'" in fuse.gguf_refusal(made / "q4", {**q4, "model_type": "qwen2"}, dequantize=True)
