"""The model as its files describe it (mlxcluster/plan/model.py): config.json's widths under the
names mlx-lm's architectures give them, and every linear of the body from the safetensors headers,
packed or not, as the model mlx-lm loads has it."""

from __future__ import annotations

from pathlib import Path

import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from mlxcluster.plan import model as model_files
from mlxcluster.plan.model import Shape
from training.model import stand_in


@pytest.mark.parametrize(("config", "shape"), [
    ({"hidden_size": 576, "num_hidden_layers": 30, "intermediate_size": 1536, "num_attention_heads": 9,
      "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "max_position_embeddings": 8192},
     Shape(576, 30, 1536, 9, 3, 64, 49152, 8192)),
    ({"n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024},  # gpt2: 4x MLP
     Shape(768, 12, 3072, 12, 12, 64, 50257, 1024)),
    ({"hidden_size": 2048, "num_hidden_layers": 24, "intermediate_size": 6144, "moe_intermediate_size": 768,
      "num_experts_per_tok": 8, "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 151936},
     Shape(2048, 24, 6144, 32, 4, 64, 151936)),  # a token goes through its 8 experts' MLPs
    ({"model_type": "gemma3", "text_config": {
        "hidden_size": 640, "num_hidden_layers": 18, "intermediate_size": 2048, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144}},
     Shape(640, 18, 2048, 4, 1, 256, 262144)),
])
def test_the_widths_are_read_under_each_architecture_s_names(config, shape):
    assert Shape.of(config) == shape


def test_a_config_without_its_widths_has_no_shape():
    assert Shape.of({"model_type": "llama", "num_hidden_layers": 2}) is None


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "4-bit"])
def test_every_linear_of_the_body_is_read_from_the_headers_as_mlx_lm_loads_it(tmp_path: Path, quantized):
    model = stand_in.make(tmp_path / "m", quantized=quantized, hidden_size=64, intermediate_size=96)
    found = model_files.weights(tmp_path / "m", linears=True)
    assert found is not None and found.quantized == quantized and found.float_itemsize == 4
    loaded = {(int(path.split(".")[2]), ".".join(path.split(".")[3:])): module
              for path, module in model.named_modules()
              if isinstance(module, (nn.Linear, nn.QuantizedLinear)) and path.startswith("model.layers.")}
    assert {(linear.layer, linear.path) for linear in found.linears} == set(loaded)
    for linear in found.linears:
        module = loaded[(linear.layer, linear.path)]
        outputs, inputs = (module.weight.shape if not quantized
                           else (module.weight.shape[0], module.scales.shape[1] * module.group_size))
        assert (linear.inputs, linear.outputs) == (inputs, outputs)
    tensors = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    assert tensors == found.stored - _header_bytes(tmp_path / "m")


def _header_bytes(model_dir: Path) -> int:
    """The safetensors files' bytes beyond their tensors: the JSON header and its length."""
    total = 0
    for path in model_dir.glob("*.safetensors"):
        with path.open("rb") as file:
            total += 8 + int.from_bytes(file.read(8), "little")
    return total
