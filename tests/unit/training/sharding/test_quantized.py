"""Tensor-parallel QLoRA in real training (a tiny quantized llama, local processes on MLX's ring
backend): ranks holding shards of the packed layers train one process's adapters, on parts that
the heads and the quantization groups do not make equal; stock mlx-lm generates and fuses with
them; the quantizations a split cannot take are refused from config.json alone."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm import load

from mlxcluster.errors import UserError
from mlxcluster.launch import parallel
from tests.unit import rings
from tests.unit.training.sharding.test_tensor_parallel import single_run
from tests.unit.training.test_finetune import run_launcher, training_args
from tests.unit.training.test_shares_training import adapters, losses, max_difference, uneven_inputs
from training.sharding import quantized
from training.sharding.tensor_parallel import shard_problems

# 6 query heads in 3 key-value groups of 32-wide heads; 160 MLP units, 5 groups of 32: on 2 ranks
# the attention splits 2 groups and 1, the MLP 3 quantization groups and 2 (96 and 64 units).
SHAPE = {"hidden_size": 192, "num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 160}
SETTINGS = ("--lora-dropout", "0.3")


def ranks_run(root: Path, out: str, ranks: int, *extra: str, parallel: str = "tensor") -> None:
    args = training_args(root / "model", root / "data", root / out, "--expected-world-size", str(ranks),
                         "--parallel", parallel, *extra)
    launch = rings.launch(ranks)
    result = run_launcher([*launch, sys.executable, "-m", "training.finetune", *args], timeout=240)
    assert (root / out / "adapters.safetensors").is_file(), result.stdout + result.stderr


def quantized_root(parent: Path, **quantization: object) -> Path:
    return uneven_inputs(parent, quantized=True, **quantization, **SHAPE)


def assert_one_process(root: Path, single: str, tensor: str, loss_rel: float | None = None) -> float:
    diff = max_difference(root / single, root / tensor)
    assert diff < 1e-4, diff
    for key in ("train_loss", "val_loss"):
        assert losses(root / tensor, key) == pytest.approx(losses(root / single, key), abs=1e-4, rel=loss_rel)
    return diff


@pytest.fixture(scope="module")
def four_bit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-bit model (group 32), one process's LoRA on it, and two tensor-parallel ranks'."""
    root = quantized_root(tmp_path_factory.mktemp("qlora"))
    single_run(root, "single", *SETTINGS)
    ranks_run(root, "tensor", 2, *SETTINGS)
    return root


def test_two_ranks_holding_shards_of_a_4_bit_model_train_one_process_s_adapters(four_bit: Path):
    diff = assert_one_process(four_bit, "single", "tensor")
    assert max(mx.abs(w).max().item() for w in adapters(four_bit / "single").values()) > 1e-2  # they moved
    summary = json.loads((four_bit / "tensor" / "summary.json").read_text())
    assert summary["parallel"] == "tensor" and summary["max_weight_difference_across_ranks"] == 0.0
    print(f"4-bit LoRA, max abs difference, 1 process against 2 tensor-parallel ranks: {diff:.3g}")


def test_dora_on_a_quantized_base_splits_as_on_a_float_one_and_resumes(four_bit: Path):
    settings = (*SETTINGS, "--fine-tune-type", "dora", "--optimizer", "adamw")
    single_run(four_bit, "dora-single", *settings)
    ranks_run(four_bit, "dora-tensor", 2, *settings)
    assert_one_process(four_bit, "dora-single", "dora-tensor")
    shutil.copytree(four_bit / "dora-tensor", four_bit / "dora-resumed")
    shutil.rmtree(four_bit / "dora-resumed" / "checkpoints" / "0000010")
    ranks_run(four_bit, "dora-resumed", 2, *settings, "--resume")
    assert max_difference(four_bit / "dora-tensor", four_bit / "dora-resumed") < 1e-6


def test_three_ranks_split_a_mixed_8_and_4_bit_model_with_a_float_layer_one_rank_dequantizing(
        tmp_path: Path):
    # As `mlx_lm convert --quant-predicate` writes it: per-layer settings beside the model's, and
    # a layer left float. Three ranks: one key-value group each, the MLP's 5 groups as 2, 2 and 1;
    # rank 1 dequantizes its shards (as a node with model_dequantize does), the others keep them packed.
    per_layer = {"model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 4},
                 "model.layers.1.self_attn.o_proj": False}
    root = quantized_root(tmp_path, bits=8, group_size=32, per_layer=per_layer)
    model, _ = load(str(root / "model"))
    assert model.layers[0].mlp.down_proj.bits == 4 and "scales" not in model.layers[1].self_attn.o_proj
    single_run(root, "single", *SETTINGS)
    ranks_run(root, "tensor", 3, *SETTINGS, "--dequantize-ranks", "1")
    # The dequantizing rank multiplies its shards in float (BLAS) where one process runs the packed
    # kernels: the sums round otherwise, and a loss near 2.75 came 1.0004e-4 apart with OpenBLAS
    # (3.6e-5 of it). The losses within 1e-4 of their value; the adapters as tight as ever.
    assert_one_process(root, "single", "tensor", loss_rel=1e-4)
    held = json.loads((root / "tensor" / "summary.json").read_text())["base_weights_per_rank"]
    assert held[0] == held[2] != held[1] and held[1].startswith("dequantized from mixed 4/8-bit affine"), held


def stock(*args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "mlx_lm", *args], capture_output=True, text=True,
                            timeout=240, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_stock_mlx_lm_generates_and_fuses_with_the_adapters_of_every_mode(four_bit: Path):
    # Data-parallel ranks draw their own dropout masks: both runs without dropout.
    single_run(four_bit, "single-plain")
    ranks_run(four_bit, "data", 2, parallel="data")
    model, adapters_dir = str(four_bit / "model"), str(four_bit / "tensor")
    asked = ("--prompt", "count 001", "--max-tokens", "6", "--temp", "0", "--verbose", "False")
    # What one process's adapters answer, data- and tensor-parallel ones answer.
    answers = {run: stock("generate", "--model", model, "--adapter-path", str(four_bit / run), *asked)
               for run in ("single", "tensor", "single-plain", "data")}
    assert answers["tensor"] == answers["single"] and answers["data"] == answers["single-plain"], answers
    fused, dequantized = four_bit / "fused", four_bit / "fused-float"
    stock("fuse", "--model", model, "--adapter-path", adapters_dir, "--save-path", str(fused))
    stock("fuse", "--model", model, "--adapter-path", adapters_dir, "--save-path", str(dequantized),
          "--dequantize")
    assert "quantization" in json.loads((fused / "config.json").read_text())
    assert "quantization" not in json.loads((dequantized / "config.json").read_text())
    tokens = mx.array([[5, 17, 99, 3, 42]])
    adapted, _ = load(model, adapter_path=adapters_dir)
    expected = adapted(tokens)
    # De-quantized, the fused model is the model with its adapters; kept quantized, it is that
    # model's adapted layers quantized again as the base was (the sums rounded to 4 bits), beside
    # the base's own embedding.
    float_model = load(str(dequantized))[0]
    assert mx.abs(float_model(tokens) - expected).max().item() < 1e-3
    nn.quantize(float_model, group_size=32, bits=4, class_predicate=lambda _, m: isinstance(m, nn.Linear))
    float_model.model.embed_tokens = load(model)[0].model.embed_tokens
    assert mx.abs(load(str(fused))[0](tokens) - float_model(tokens)).max().item() < 1e-4


# --- refused from config.json, before anything is sent ---------------------------------------------


SMOLLM2 = {"model_type": "llama", "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
           "intermediate_size": 1536, "num_hidden_layers": 30, "vocab_size": 49152}


def test_the_cut_of_a_packed_row_ends_with_a_group_and_a_word():
    assert quantized.unit(64, 4) == 64 and quantized.unit(32, 3) == 32 and quantized.unit(16, 3) == 32
    assert quantized.unit(16, 4) == 16 and quantized.unit(32, 6) == 32


@pytest.mark.parametrize(("quantization", "ranks", "refused"), [
    ({"group_size": 64, "bits": 4}, 2, None),  # o_proj cut at 384 = 6 x 64
    ({"group_size": 64, "bits": 4}, 3, None),  # cut at 192 and 384
    ({"group_size": 128, "bits": 4}, 2, None),  # 384 = 3 x 128
    ({"group_size": 128, "bits": 4}, 3, "self_attn.o_proj (4-bit affine, group 128): a rank's part of its "
                                        "inputs would begin at input 192"),
    ({"group_size": 64, "bits": 4, "model.layers.7.self_attn.o_proj": {"group_size": 128, "bits": 8}}, 3,
     "self_attn.o_proj (8-bit affine, group 128)"),
    ({"group_size": 64, "bits": 4, "model.layers.7.self_attn.o_proj": False}, 3, None),
])
def test_a_quantization_the_split_cannot_take_is_refused_naming_the_layer_and_the_cut(
        quantization: dict[str, object], ranks: int, refused: str | None):
    found = shard_problems({**SMOLLM2, "quantization": quantization}, ranks, "smol-4bit", shardable=True)
    if refused is None:
        assert found == []
    else:
        assert len(found) == 1 and refused in found[0], found
        assert "--parallel data" in found[0]


def test_an_mlp_with_fewer_quantization_groups_than_ranks_is_refused():
    config = {**SMOLLM2, "num_attention_heads": 8, "num_key_value_heads": 8, "hidden_size": 512,
              "intermediate_size": 256, "quantization": {"group_size": 64, "bits": 4}}
    assert shard_problems(config, 4, "m", shardable=True) == []
    (found,) = shard_problems(config, 8, "m", shardable=True)
    assert "its 256 inputs are 4 groups of 64, fewer than the 8 ranks" in found and "layers 0-29" in found


def test_the_controller_refuses_a_quantization_the_nodes_cannot_split_before_sending_it(tmp_path: Path):
    config = {**SMOLLM2, "quantization": {"group_size": 128, "bits": 4}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    refused = r"(?s)cannot train with --parallel tensor:.*group 128.*begin at input 192"
    with pytest.raises(UserError, match=refused):
        parallel.check(SimpleNamespace(world_size=3), tmp_path, "tensor")  # type: ignore[arg-type]
    assert parallel.problems(SimpleNamespace(world_size=2), tmp_path, "tensor") == []  # type: ignore[arg-type]
    assert parallel.problems(SimpleNamespace(world_size=3), tmp_path, "data") == []  # type: ignore[arg-type]
