"""A run's adapters fused into its base model, one output file at a time.

Stock `mlx_lm fuse` loads the whole model, fuses and saves: the machine that fuses must hold the
model. Here nothing is read until it is written: the model is loaded lazily, the adapter layers are
fused by mlx-lm's own `fuse()` (still lazy), and the weights are written in files of at most
`max_file_bytes`, each file's tensors evaluated as it is written and freed after it. What is held
at once is one output file's weights (and the adapters), so a model larger than this machine's
memory is fused. The folder written is what stock writes (the same tensors, config.json without
`quantization` when dequantized, the tokenizer and the model's own .py and generation_config.json),
so stock `mlx_lm generate` and `mlx_lm.server` load it; its weights are only cut into more files.

    python -m training.tools.fuse --model DIR --adapter-path RUN --save-path OUT
        [--dequantize] [--gguf-path FILE] [--max-file-mb N]

It prints one JSON line: the files written, their bytes and this process's peak memory.
"""

from __future__ import annotations

import argparse
import glob
import json
import resource
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from training.model import quantization

# What a fused file holds at most (stock writes files of up to 5 GB; a smaller one bounds the memory).
MAX_FILE_BYTES = 1 << 30
# llama.cpp's GGUF writer in mlx-lm takes these architectures only.
GGUF_TYPES = ("llama", "mixtral", "mistral")


@dataclass(frozen=True)
class Fused:
    files: list[str]  # the weight files written, in order
    bytes: int  # their tensors' bytes
    gguf: str | None  # the GGUF file written, if asked
    peak_rss_bytes: int  # this process's peak resident memory


def byte_level(tokenizer_json: Path) -> bool:
    """Whether a tokenizer.json splits text into bytes first (GPT-2's byte-level BPE: Llama 3's,
    Qwen's, SmolLM's), as opposed to sentencepiece's pieces (Llama 2's, Mistral's)."""
    try:
        spec = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    stack = [spec.get("pre_tokenizer"), spec.get("decoder")]
    while stack:
        part = stack.pop()
        if isinstance(part, dict):
            if part.get("type") == "ByteLevel":
                return True
            stack += part.get("pretokenizers", []) + part.get("decoders", [])
    return False


def gguf_refusal(model_dir: Path, config: dict, dequantize: bool) -> str | None:
    """Why a GGUF file cannot be written for this model (None: it can)."""
    if config.get("model_type") not in GGUF_TYPES:
        return (f"a GGUF file is written for {', '.join(GGUF_TYPES)} models only (mlx-lm's writer), "
                f"not {config.get('model_type')!r}: leave out --gguf")
    if quantization.is_quantized(config) and not dequantize:
        return "a quantized model's GGUF file is written dequantized: add --dequantize"
    # mlx-lm's writer stores every vocabulary as sentencepiece's ("llama"): a byte-level one would be
    # read wrongly by llama.cpp, which needs its own converter's "gpt2" vocabulary for it.
    if byte_level(model_dir / "tokenizer.json"):
        return ("this model's tokenizer is byte-level BPE, which mlx-lm's GGUF writer stores as "
                "sentencepiece's and llama.cpp would read wrongly: leave out --gguf, and convert the "
                "fused folder with llama.cpp's convert_hf_to_gguf.py")
    return None


def shards(weights: dict[str, mx.array], max_bytes: int) -> list[dict[str, mx.array]]:
    """The weights in order, cut into groups of at most `max_bytes` (a larger tensor alone)."""
    groups: list[dict[str, mx.array]] = []
    size = 0
    for name, value in weights.items():
        if not groups or size + value.nbytes > max_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = value
        size += value.nbytes
    return groups


def write_weights(model: nn.Module, out: Path, max_bytes: int) -> tuple[list[str], int]:
    """The model's weights in files of at most `max_bytes`, with mlx-lm's index; the model's
    parameters are emptied (each file's tensors are freed once written)."""
    from mlx_lm.utils import get_total_parameters

    weights = dict(tree_flatten(model.parameters()))
    groups = shards(weights, max_bytes)
    total = sum(value.nbytes for value in weights.values())
    parameters = get_total_parameters(model)
    # Nothing but the groups may hold a tensor, or a written file's tensors would stay in memory.
    model.update(tree_map(lambda _: mx.array([]), model.parameters()))
    weights.clear()
    pattern = "model-{:05d}-of-{:05d}.safetensors" if len(groups) > 1 else "model.safetensors"
    names, weight_map = [], {}
    for index in range(len(groups)):
        group, groups[index] = groups[index], {}
        name = pattern.format(index + 1, len(groups))
        mx.save_safetensors(str(out / name), group, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(group, name))
        names.append(name)
        del group
    index_data = {"metadata": {"total_size": total, "total_parameters": parameters},
                  "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_data, indent=4))
    return names, total


def fuse(model_dir: Path, adapters: Path, out: Path, *, dequantize: bool = False,
         gguf_path: Path | None = None, max_file_bytes: int = MAX_FILE_BYTES) -> Fused:
    """`adapters` fused into the model in `model_dir`, written to `out` (made, must not exist)."""
    from mlx_lm.gguf import convert_to_gguf
    from mlx_lm.utils import create_model_card, dequantize_model, load, save_config

    model, tokenizer, config = load(str(model_dir), adapter_path=str(adapters), lazy=True,
                                    return_config=True)
    if gguf_path and (why := gguf_refusal(model_dir, config, dequantize)):
        raise SystemExit(why)
    fused = [(name, module.fuse(dequantize=dequantize)) for name, module in model.named_modules()
             if hasattr(module, "fuse")]
    if fused:
        model.update_modules(tree_unflatten(fused))
    del fused
    if dequantize:
        model = dequantize_model(model)
        config.pop("quantization", None)
        config.pop("quantization_config", None)
    out.mkdir(parents=True)
    keep_vision_config = "vision_tower" in getattr(model, "model", {})
    files, size = write_weights(model, out, max_file_bytes)
    save_config(config, config_path=out / "config.json", keep_vision_config=keep_vision_config)
    tokenizer.save_pretrained(str(out))
    for pattern in ("*.py", "generation_config.json"):
        for file in glob.glob(str(model_dir / pattern)):
            shutil.copy(file, out)
    create_model_card(out, None)
    written_gguf = None
    if gguf_path:
        # llama.cpp's one file is written from memory: this step holds the whole fused model.
        weights = {}
        for file in files:
            weights.update(mx.load(str(out / file)))
        convert_to_gguf(out, weights, config, str(gguf_path))
        written_gguf = str(gguf_path)
    return Fused(files, size, written_gguf, peak_rss())


def peak_rss() -> int:
    """This process's peak resident memory, in bytes. Linux keeps ru_maxrss across exec (a child of a
    large parent would report the parent's), so there it is the process's own high-water mark."""
    if sys.platform == "darwin":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with open("/proc/self/status") as status:
        kib = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
    return int(kib) * 1024


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m training.tools.fuse", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--adapter-path", required=True, type=Path)
    parser.add_argument("--save-path", required=True, type=Path)
    parser.add_argument("--dequantize", action="store_true")
    parser.add_argument("--gguf-path", type=Path)
    parser.add_argument("--max-file-mb", type=float, default=MAX_FILE_BYTES / 2**20)
    args = parser.parse_args(argv)
    result = fuse(args.model, args.adapter_path, args.save_path, dequantize=args.dequantize,
                  gguf_path=args.gguf_path, max_file_bytes=max(1, int(args.max_file_mb * 2**20)))
    print(json.dumps(asdict(result)))


if __name__ == "__main__":
    main()
