"""Whether a checkpoint on disk is whole, with the standard library only.

Rank 0 (training/loop/checkpoint.py) and the controller (`mlxcluster.launch.runs`, which names the step a
resume starts from) both decide with `newest_whole`, so they agree on it. A checkpoint's state.json
holds the sha256 of its two array files: a truncated or overwritten file, or a state.json without
its keys, makes the checkpoint damaged, and the one before it is used.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

# The repo's one chunked sha256 (model manifests use it too).
from training.model.manifest import sha256 as file_digest

DIRECTORY = "checkpoints"
ADAPTERS = "adapters.safetensors"
OPTIMIZER = "optimizer.safetensors"
STATE = "state.json"
ARRAYS = (ADAPTERS, OPTIMIZER)
NAME = re.compile(r"\d{7}")
# What resuming cannot do without in state.json (settings and data_sha256, when missing, only
# make the checkpoint another run's, which resuming says).
REQUIRED = ("step", "random_key")


def safetensors_short(path: Path) -> str | None:
    """What is missing from a safetensors file that its own header says it holds (None: nothing):
    a file written short, as MLX's writer leaves one on a full disk without an error."""
    try:
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
    except (OSError, ValueError) as error:
        return f"its header cannot be read ({error})"
    end = max((value["data_offsets"][1] for key, value in header.items() if key != "__metadata__"),
              default=0)
    want, have = 8 + size + end, path.stat().st_size
    return None if have >= want else f"{have} of its {want} bytes"


def damage(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(state, None) for a whole checkpoint directory, else (None, what is wrong with it)."""
    try:
        state = json.loads((path / STATE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, f"no {STATE}"
    except (OSError, ValueError) as error:
        return None, f"{STATE} is unreadable ({error})"
    if not isinstance(state, dict) or (missing := [key for key in REQUIRED if key not in state]):
        return None, f"{STATE} lacks {', '.join(missing) if isinstance(state, dict) else 'everything'}"
    digests = state.get("files")
    for name in ARRAYS:
        if not (path / name).is_file():
            return None, f"no {name}"
        # Checkpoints written before digests were recorded are trusted as they are.
        if isinstance(digests, dict) and file_digest(path / name) != digests.get(name):
            return None, f"{name} is not the file that was saved (truncated or overwritten)"
    return state, None


def newest_whole(adapter_path: Path) -> tuple[Path | None, dict[str, Any] | None, list[str]]:
    """(path, state) of the newest whole checkpoint under adapter_path (None, None: there is none),
    and a line for each newer one passed over because it is damaged."""
    root = Path(adapter_path) / DIRECTORY
    steps = sorted(p for p in root.iterdir() if NAME.fullmatch(p.name)) if root.is_dir() else []
    passed: list[str] = []
    for path in reversed(steps):
        state, problem = damage(path)
        if state is not None:
            return path, state, passed
        passed.append(f"checkpoint {path.name} is damaged ({problem}): not used")
    return None, None, passed
