"""The model that provisioning installs on every node: fetched once into the controller's cache.

The Ansible `model` role (roles/model) runs `python -m mlxcluster.provision.model_store ensure ...` on the
controller. It fetches `cluster_model` with training/model/folder.py's fetch (which writes the sha256
manifest) unless the cache already holds it: same source and dtype, its quantization kept, and for a
local directory nothing in it newer than the cached copy. It prints what the role needs as one JSON
object: the copy's path and name, its size and its manifest's digest. A second run fetches nothing.

A quantized model stays quantized here, on every node and into the run: a node whose inventory says
`model_dequantize: true` dequantizes it as it loads (mlxcluster/launch/quantized.py), never the store.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcluster.errors import UserError, shown
from mlxcluster.paths import MODELS, PLAIN_NAME, REPO
from mlxcluster.provision import inputs
from training.model.manifest import MANIFEST, manifest_sha256, model_files, read_manifest

DTYPES = ("auto", "float16", "bfloat16", "float32")


def policy(dtype: str, linux_trains: bool) -> str:
    """The dtype of float weights. `auto`: float16 when only Macs train, float32 as soon as a
    Linux node does (16-bit matmuls are slow on Linux CPUs). Quantized weights are never
    dequantized here: that is the inventory's choice per node (model_dequantize), made at load."""
    if dtype not in DTYPES:
        raise UserError(f"cluster_model_dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if dtype == "auto":
        dtype = inputs.dtype_for(["Debian"] if linux_trains else ["Darwin"])
    return dtype


def normalized_source(source: str) -> str:
    """A local directory as an absolute path (relative ones are the repository's); other sources
    (the embedded default, a Hugging Face repo id) as they are."""
    if source != inputs.DEFAULT_MODEL and (path := REPO / source).is_dir():
        return str(path.resolve())
    return source


def cache_dir(source: str, dtype: str, into: Path = MODELS) -> Path:
    """Where the controller keeps the model: models/smollm2-135m-<dtype> or models/<name>."""
    if source == inputs.DEFAULT_MODEL:
        return into / inputs.default_model_dir(dtype).name
    name = Path(source.rstrip("/")).name
    # The nodes' copy is models/<name>, in rsync remote paths. (Hugging Face repo names are plain
    # already; anything else that is not a folder fails to fetch, with its own message.)
    if Path(source).is_dir() and not PLAIN_NAME.fullmatch(name):
        raise UserError(f"cluster_model {source!r}: its name {name!r} cannot be a folder name on the "
                        "nodes; use a model folder or repo whose name has letters, digits and "
                        ". _ - + @ = , only")
    return into / name


def is_cached(copy: Path, source: str, dtype: str) -> bool:
    """Whether `copy` is the model fetched from `source` in `dtype`, quantization kept."""
    manifest = read_manifest(copy)
    if manifest is None or (manifest.get("source"), manifest.get("dtype")) != (source, dtype):
        return False
    # Fetched when a Linux node dequantized (the older policy): fetched again, kept quantized. A
    # float model fetched so was copied or cast all the same, and is kept.
    if str(manifest.get("weights", "")).startswith("dequantized"):
        return False
    if Path(source).is_dir():  # a local directory edited since: fetch it again
        fetched = (copy / MANIFEST).stat().st_mtime
        return all(p.stat().st_mtime <= fetched for p in Path(source).iterdir() if p.is_file())
    return True


def ensure(source: str, dtype: str = "auto", *, linux_trains: bool, into: Path = MODELS,
           check: bool = False, what: str | None = None) -> dict[str, Any]:
    """The model in the controller's cache, fetched when it is not there (not with `check`)."""
    source = normalized_source(source)
    dtype = policy(dtype, linux_trains)
    copy = cache_dir(source, dtype, Path(into))
    changed = not is_cached(copy, source, dtype)
    if changed and not check:
        from training.model.folder import fetch
        from training.model.gguf import FetchError

        try:
            with contextlib.redirect_stdout(sys.stderr):  # stdout is the JSON answer
                fetch(source, copy, dtype, dequantize=False)
        except FetchError as e:
            raise UserError(f"{what or f'cluster_model {source!r}'}: {e}") from None
    present = copy.is_dir()
    return {"changed": changed, "path": str(copy), "name": copy.name, "source": source,
            "dtype": dtype, "manifest_sha256": manifest_sha256(copy) if present else None,
            "bytes": sum(p.stat().st_size for p in model_files(copy)) if present else 0}


@dataclass(frozen=True)
class RunModel:
    """The model folder a run ships, and how it got there."""

    path: Path
    fetched_from: str | None = None  # a model as mlx-lm takes it, fetched (or to be) into `path`
    pending: bool = False  # a dry run: not fetched yet


def for_run(given: str, *, linux_trains: bool, fetch: bool = True, into: Path = MODELS) -> RunModel:
    """The model folder for invoke train's `--model` (or the config's `model:`), as mlx-lm takes it:
    a folder invoke model.fetch made (it has a manifest) as it is; a stock mlx-lm folder or a
    Hugging Face id fetched once into the cache, as provisioning fetches `cluster_model` (a checked
    copy with a manifest, in the nodes' dtype, a quantized model kept quantized), and that copy reused
    while its source is unchanged."""
    if (Path(given) / MANIFEST).is_file():
        return RunModel(Path(given))
    from training.model.folder import looks_like_repo_id, missing_files  # mlx: only here

    if Path(given).is_dir():
        if missing := missing_files(Path(given)):
            raise UserError(f"--model {shown(given)} is not an mlx-lm model folder: it has no "
                            f"{', '.join(missing)}")
    elif not looks_like_repo_id(given):
        what = "no such folder" if not Path(given).exists() else "not a folder"
        raise UserError(f"--model {shown(given)}: {what}, and not a Hugging Face id (org/name): give an "
                        "mlx-lm model folder or a Hugging Face id")
    source = str(Path(given).resolve()) if Path(given).is_dir() else given
    if not fetch:
        dtype = policy("auto", linux_trains)
        copy = cache_dir(source, dtype, Path(into))
        return RunModel(copy, given, pending=not is_cached(copy, source, dtype))
    found = ensure(source, linux_trains=linux_trains, into=into, check=True)
    if found["changed"]:
        print(f"==> model {shown(given)}: fetching it once into {found['path']} (a checked copy with a "
              "manifest, which every node verifies; later runs reuse it)", flush=True)
        found = ensure(source, linux_trains=linux_trains, into=into, what=f"--model {shown(given)}")
    return RunModel(Path(found["path"]), given)


def shape_of(given: str) -> dict[str, Any] | None:
    """A model folder's config.json, before it is fetched (None: a hub id, or none readable)."""
    with contextlib.suppress(OSError, ValueError):
        config = json.loads((Path(given) / "config.json").read_text(encoding="utf-8"))
        return config if isinstance(config, dict) else None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlxcluster.provision.model_store",
                                     description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    cmd = commands.add_parser("ensure", help="fetch the model into the cache unless it is there")
    cmd.add_argument("--source", default=inputs.DEFAULT_MODEL,
                     help="smollm2 (default), a local model directory or a Hugging Face repo id")
    cmd.add_argument("--dtype", default="auto", help=f"one of {', '.join(DTYPES)}")
    cmd.add_argument("--linux", action=argparse.BooleanOptionalAction, default=False,
                     help="a Linux node trains (dtype auto is then float32; quantized models stay "
                          "quantized)")
    cmd.add_argument("--into", type=Path, default=MODELS, help="the cache directory (models/)")
    cmd.add_argument("--check", action="store_true", help="say whether it would fetch; fetch nothing")
    args = parser.parse_args(argv)
    try:
        found = ensure(args.source, args.dtype, linux_trains=args.linux, into=args.into,
                       check=args.check)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
