"""A quantized base model (training/model/quantization.py): its quantization said from config.json,
dequantized at load on the ranks asked (exactly up to float rounding, in the dtype of the model's
other weights), and `full` refused on it unless every rank dequantizes."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.utils import quantize_model, save_config, save_model

from tests.unit.training.model.test_folder import logits, tiny_model
from training.model import quantization as q

PACKED = (nn.QuantizedLinear, nn.QuantizedEmbedding)


def packed_layers(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, PACKED)]


def float_dtypes(model: nn.Module) -> set[mx.Dtype]:
    return {a.dtype for _, a in tree_flatten(model.parameters()) if mx.issubdtype(a.dtype, mx.floating)}


@pytest.mark.parametrize(
    ("config", "said"),
    [
        ({"model_type": "llama"}, "float"),
        ({"quantization": {"group_size": 64, "bits": 4}}, "4-bit affine, group 64"),
        ({"quantization_config": {"group_size": 32, "bits": 4, "mode": "mxfp4"}}, "4-bit mxfp4, group 32"),
        (
            {
                "quantization": {
                    "group_size": 64,
                    "bits": 4,
                    "model.layers.0.mlp.down_proj": {"group_size": 64, "bits": 8},
                }
            },
            "mixed 4/8-bit affine, group 64",
        ),
        (
            {"quantization": {"group_size": 64, "bits": 4, "lm_head": False}},
            "4-bit affine, group 64, some layers float",
        ),
    ],
)
def test_config_json_s_quantization_is_said_in_a_few_words(config, said):
    assert q.describe(config) == said
    assert q.is_quantized(config) == (said != "float")


def test_dequantize_ranks_are_rank_numbers_within_the_run():
    assert q.parse_ranks(None) == [] and q.parse_ranks("2, 0,2") == [0, 2]
    assert q.rank_problems("0,1", 2) == []
    assert q.rank_problems("0,2", 2) == [
        "dequantize_ranks 0,2: rank 2 is beyond the 2 ranks of this run (ranks 0 to 1)"
    ]
    assert q.rank_problems("one", 2) == [
        "dequantize_ranks 'one' must be rank numbers separated by commas, e.g. 0,2"
    ]
    assert q.rank_problems("-1", 2)[0].startswith("dequantize_ranks '-1' must be rank numbers")


def test_a_rank_asked_dequantizes_exactly_and_the_others_keep_the_packed_weights(tmp_path: Path):
    tiny_model(tmp_path / "tiny-4bit", quantized=True)
    model, _, config = load(str(tmp_path / "tiny-4bit"), return_config=True)
    expected = logits(model)
    kept, said = q.dequantized_if_asked(model, config, rank=0, dequantize_ranks=[1])
    assert said == "4-bit affine, group 32" and kept is model and packed_layers(kept)

    plain, said = q.dequantized_if_asked(model, config, rank=1, dequantize_ranks=[1])
    assert said == "dequantized from 4-bit affine, group 32, to float32"
    assert packed_layers(plain) == [] and float_dtypes(plain) == {mx.float32}
    assert mx.allclose(logits(plain), expected, atol=1e-4).item()


def test_a_mixed_bfloat16_model_dequantizes_to_its_other_weights_dtype(tmp_path: Path):
    tiny_model(tmp_path / "tiny")
    model, config = load(str(tmp_path / "tiny"), return_config=True)[::2]
    model.set_dtype(mx.bfloat16)
    eight_bit_mlp = {"group_size": 32, "bits": 8}
    model, config = quantize_model(
        model, config, 32, 4, quant_predicate=lambda path, _: eight_bit_mlp if "down_proj" in path else True
    )
    save_model(tmp_path / "mixed", model)
    save_config(config, tmp_path / "mixed" / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "mixed" / name).write_bytes((tmp_path / "tiny" / name).read_bytes())
    stored = json.loads((tmp_path / "mixed" / "config.json").read_text())
    assert q.describe(stored) == "mixed 4/8-bit affine, group 32"

    model, _, config = load(str(tmp_path / "mixed"), return_config=True)
    assert {m.bits for _, m in model.named_modules() if isinstance(m, PACKED)} == {4, 8}
    expected = logits(model)
    plain, said = q.dequantized_if_asked(model, config, rank=0, dequantize_ranks=[0])
    assert said == "dequantized from mixed 4/8-bit affine, group 32, to bfloat16"
    assert packed_layers(plain) == [] and float_dtypes(plain) == {mx.bfloat16}
    # The same model up to bfloat16's rounding (8 bits of mantissa, through two layers).
    assert mx.abs(logits(plain) - expected).max().item() < 0.1


def test_a_float_model_is_left_as_it_is(tmp_path: Path):
    tiny_model(tmp_path / "tiny")
    model, _, config = load(str(tmp_path / "tiny"), return_config=True)
    assert q.dequantized_if_asked(model, config, rank=0, dequantize_ranks=[0]) == (model, "float")


def test_full_is_refused_on_a_quantized_base_unless_every_rank_dequantizes():
    quantized = {"quantization": {"group_size": 64, "bits": 4}}
    problem = q.full_problem(quantized, "full", 2, [1])
    assert problem and problem.startswith("fine_tune_type full on a quantized model (4-bit affine, group 64)")
    assert "train lora or dora" in problem and "model_dequantize: true for every training node" in problem
    assert q.full_problem(quantized, "full", 2, [0, 1]) is None
    assert (
        q.full_problem(quantized, "lora", 2, []) is None and q.full_problem(quantized, "dora", 2, []) is None
    )
    assert q.full_problem({"model_type": "llama"}, "full", 2, []) is None
