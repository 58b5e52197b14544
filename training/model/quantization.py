"""A quantized base model: what its config.json says of it, and the ranks that dequantize it as they load.

A model `mlx_lm convert -q` wrote keeps its quantization in config.json's `quantization` block (mirrored
as `quantization_config`): `bits`, `group_size`, an optional `mode` (affine by default), and per
layer either its own settings or false (kept float). Fetching keeps it so from the controller's
store to every node; whether a rank trains on the packed weights (QLoRA: LoRA or DoRA layers over
mlx's QuantizedLinear) or on float weights it dequantizes at load is the inventory's choice per
node (`model_dequantize`), which the controller hands the ranks as `dequantize_ranks`. Dequantizing
is exact up to float rounding: both ranks compute the same model.

`full` cannot train a quantized layer (mlx keeps QuantizedLinear's packed weights frozen), so it is
refused on a quantized base unless every rank dequantizes (`full_problem`, on the controller and
on every rank alike).

The controller imports this module too: mlx is imported only where a model is changed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import mlx.core as mx
    import mlx.nn as nn

FLOAT = "float"


def quantization_of(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """config.json's quantization block (mlx-lm's `quantization`, else `quantization_config`)."""
    for key in ("quantization", "quantization_config"):
        if isinstance(block := config.get(key), Mapping):
            return block
    return None


def is_quantized(config: Mapping[str, Any]) -> bool:
    return "quantization" in config or "quantization_config" in config


def _joined(values: Iterable[Any]) -> str:
    return "/".join(str(v) for v in sorted(set(values), key=str))


def describe(config: Mapping[str, Any]) -> str:
    """The base weights in a few words, from config.json: `4-bit affine, group 64`, `mixed 4/8-bit
    affine, group 64` (per-layer bits), `float`."""
    block = quantization_of(config)
    if block is None:
        return FLOAT
    mode = block.get("mode") or block.get("quant_method") or "affine"
    layers = [v for v in block.values() if isinstance(v, Mapping)]
    bits = [b for b in (block.get("bits"), *(layer.get("bits") for layer in layers)) if b is not None]
    groups = [
        g for g in (block.get("group_size"), *(layer.get("group_size") for layer in layers)) if g is not None
    ]
    modes = [mode, *(layer.get("mode", mode) for layer in layers)]
    width = f"{_joined(bits)}-bit" if bits else "quantized"
    words = f"{'mixed ' if len(set(bits)) > 1 else ''}{width} {_joined(modes)}"
    if groups:
        words += f", group {_joined(groups)}"
    if any(v is False for v in block.values()):
        words += ", some layers float"
    return words


def of_layer(config: Mapping[str, Any], path: str) -> dict[str, Any] | None:
    """The quantization of the layer at `path` (e.g. `model.layers.0.mlp.down_proj`) as mlx-lm
    reads config.json: its own entry when mixed (False: left float), else the model's. None: float."""
    block = config.get("quantization")
    if not isinstance(block, Mapping):
        return None
    own = block.get(path)
    if own is False:
        return None
    chosen = {**{k: v for k, v in block.items() if k in ("group_size", "bits", "mode")},
              **(own if isinstance(own, Mapping) else {})}
    mode = chosen.get("mode", "affine")
    defaults = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}.get(mode, (64, 4))
    return {"group_size": chosen.get("group_size") or defaults[0], "bits": chosen.get("bits") or defaults[1],
            "mode": mode}


def parse_ranks(text: str | None) -> list[int]:
    """dequantize_ranks as training takes it: `0,2` (or none) as rank numbers; a ValueError says why not."""
    if not text or not str(text).strip():
        return []
    words = [word.strip() for word in str(text).split(",")]
    if not all(word.isdigit() and word.isascii() for word in words):
        raise ValueError(f"dequantize_ranks {text!r} must be rank numbers separated by commas, e.g. 0,2")
    return sorted({int(word) for word in words})


def rank_problems(text: str | None, world_size: int) -> list[str]:
    """What is wrong with dequantize_ranks for a run on `world_size` ranks (empty when fine)."""
    try:
        ranks = parse_ranks(text)
    except ValueError as error:
        return [str(error)]
    beyond = [rank for rank in ranks if rank >= world_size]
    if beyond:
        return [
            f"dequantize_ranks {text}: rank {beyond[0]} is beyond the {world_size} ranks of this run "
            f"(ranks 0 to {world_size - 1})"
        ]
    return []


def full_problem(
    config: Mapping[str, Any], fine_tune_type: str, world_size: int, dequantize_ranks: Iterable[int]
) -> str | None:
    """Why `full` cannot train this model on these ranks (None: it can, or the type is another)."""
    if fine_tune_type != "full" or not is_quantized(config):
        return None
    if set(range(world_size)) <= set(dequantize_ranks):
        return None
    return (
        f"fine_tune_type full on a quantized model ({describe(config)}): mlx keeps a quantized "
        "layer's packed weights frozen, so full would train almost nothing; train lora or dora "
        "(QLoRA, on the quantized weights), or set model_dequantize: true for every training node in "
        "the inventory (every rank then trains full on float weights)"
    )


def float_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype of the model's float weights outside its quantized layers (norms and the like):
    what its dequantized layers become, as a float model of it would hold them."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    quantized = packed_layers(model)
    found = Counter(
        array.dtype
        for name, array in tree_flatten(model.parameters())
        if name.rpartition(".")[0] not in quantized and mx.issubdtype(array.dtype, mx.floating)
    )
    return found.most_common(1)[0][0] if found else mx.float32


def packed_layers(model: nn.Module) -> set[str]:
    """The paths of the model's quantized layers."""
    return {name for name, module in model.named_modules() if "scales" in module}


def base_weights(config: Mapping[str, Any], dequantized_to: mx.Dtype | None = None) -> str:
    """A rank's base weights in a few words: the model's quantization (or float), or what it was
    dequantized from and to."""
    if dequantized_to is None or not is_quantized(config):
        return describe(config)
    return f"dequantized from {describe(config)}, to {str(dequantized_to).removeprefix('mlx.core.')}"


def dequantizes(config: Mapping[str, Any], rank: int, dequantize_ranks: Iterable[int]) -> bool:
    """Whether this rank trains on the model dequantized: it is quantized, and the rank is asked to."""
    return is_quantized(config) and rank in set(dequantize_ranks)


def dequantized_if_asked(
    model: nn.Module, config: Mapping[str, Any], rank: int, dequantize_ranks: Iterable[int]
) -> tuple[nn.Module, str]:
    """The model this rank trains on, before any LoRA layer is added: dequantized when this rank is
    one of `dequantize_ranks` and the model is quantized, else as loaded; and its base weights in
    a few words (summary.json's `base_weights_per_rank`). The dequantized weights are left lazy, for
    the caller to evaluate (after sharding, in tensor parallelism)."""
    if not dequantizes(config, rank, dequantize_ranks):
        return model, base_weights(config)
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import dequantize_model

    quantized = packed_layers(model)
    dtype = float_dtype(model)
    model = dequantize_model(model)
    # mx.dequantize gives the scales' dtype: the dequantized layers take the rest of the model's.
    cast = [
        (name, array.astype(dtype))
        for name, array in tree_flatten(model.parameters())
        if name.rpartition(".")[0] in quantized and mx.issubdtype(array.dtype, mx.floating)
    ]
    model.update(tree_unflatten(cast))  # still lazy
    return model, base_weights(config, dtype)
