"""Data, model and config folders that a run's plan accepts, made on the fly.

A plan checks every folder it would send (mlxcluster/launch/shipment.py), so tests that plan with
names like /d/pirate get such folders under a scratch root of this process, removed at exit:
`dataset("/d/pirate")` is <root>/d/pirate with train.jsonl and valid.jsonl.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

from training.model.manifest import write_manifest

ROOT = Path(tempfile.gettempdir()) / f"mlx-test-inputs-{os.getpid()}"
atexit.register(shutil.rmtree, ROOT, True)


def _under_root(path: str | Path) -> Path:
    return ROOT / str(path).lstrip("/")


def dataset(path: str | Path) -> Path:
    folder = _under_root(path)
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "valid"):
        (folder / f"{split}.jsonl").write_text('{"text": "ahoy"}\n')
    return folder


def model(path: str | Path) -> Path:
    folder = _under_root(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"model_type": "llama"}\n')
    (folder / "model.safetensors").write_bytes(b"\0" * 8)
    (folder / "tokenizer.json").write_text("{}\n")
    write_manifest(folder, source=str(path))
    return folder


def config(path: str | Path, text: str = "iters: 5\n") -> Path:
    file = _under_root(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(text)
    return file
