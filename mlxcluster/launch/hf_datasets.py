"""mlx-lm's `hf_dataset` on the cluster: a Hugging Face dataset folder on the controller, sent to
every node like the prepared data, and the setting rewritten to where it lands.

`mlx_lm lora` reads `hf_dataset` (one mapping, or a list of them) with the `datasets` package:
`load_dataset(path, split=train_split, ...)` for each, with the features it names. Here each entry's
`path` must be a folder on the controller: the nodes train offline, so a hub
dataset's name is refused with the way to download it. Of a folder only what `load_dataset` reads
goes (the data files by their extensions, and the README.md whose YAML may name its splits), each
checked as every shipment is (mlxcluster/launch/shipment.py). The ranks get the same entries with
the nodes' paths, as a `--hf-dataset` flag after the user's settings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mlxcluster.errors import UserError, shown
from mlxcluster.launch import shipment
from mlxcluster.paths import PLAIN_NAME

# What datasets' packaged builders read from a local folder, by extension (and the dataset card).
DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".tsv", ".txt", ".arrow")
CARD = "README.md"


@dataclass(frozen=True)
class HfFolder:
    """One hf_dataset entry's files, and the folder name they get on the nodes."""

    index: int
    shipment: shipment.Shipment
    name: str


def entries(hf_dataset: Any) -> list[Mapping[str, Any]]:
    """hf_dataset as mlx-lm reads it: one mapping, or a list of them."""
    if hf_dataset is None:
        return []
    return [hf_dataset] if isinstance(hf_dataset, Mapping) else list(hf_dataset)


def _files_of(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.suffix.lower() in DATA_FILE_SUFFIXES or p.relative_to(root).as_posix() == CARD
                  if not any(part.startswith(".") for part in p.relative_to(root).parts))


def folder(index: int, entry: Mapping[str, Any]) -> HfFolder:
    """The files of one entry's local `path`, checked; a UserError naming what to do otherwise."""
    given = entry.get("path")
    what = f"hf_dataset{'' if index == 0 else f' entry {index + 1}'} path {shown(given)}"
    if not isinstance(given, str) or not given:
        raise UserError(f"hf_dataset: every entry needs a path (a dataset folder), got {shown(given)}")
    path = Path(given).expanduser()
    if not path.is_dir():
        raise UserError(f"{what} is not a folder here, and the nodes train offline: download the dataset "
                        f"into a folder first (e.g. huggingface-cli download --repo-type dataset {given} "
                        f"--local-dir data/{Path(given).name}) and give that folder")
    files = _files_of(path.resolve())
    if not any(Path(name).suffix.lower() in DATA_FILE_SUFFIXES for name in files):
        raise UserError(f"{what} holds no data file datasets reads ({', '.join(DATA_FILE_SUFFIXES)})")
    return HfFolder(index, shipment.select(path, files, what), _node_name(index, path))


def _node_name(index: int, path: Path) -> str:
    name = path.resolve().name
    return f"{index}-{name if PLAIN_NAME.fullmatch(name) else 'dataset'}"


def folders(hf_dataset: Any) -> list[HfFolder]:
    return [folder(i, entry) for i, entry in enumerate(entries(hf_dataset))]


def on_controller(hf_dataset: Any) -> list[dict[str, Any]]:
    """The entries with each path absolute, as run.json records them for a resume."""
    return [{**entry, "path": str(Path(entry["path"]).expanduser().resolve())}
            for entry in entries(hf_dataset)]


def placed(hf_dataset: Any, found: Sequence[HfFolder], data_dir: str) -> list[dict[str, Any]]:
    """The entries with each path where its files land on the nodes: <data_dir>/hf/<name>."""
    out = []
    for entry, hf in zip(entries(hf_dataset), found, strict=True):
        out.append({**entry, "path": f"{data_dir}/hf/{hf.name}"})
    return out


def flag(entries_on_nodes: list[dict[str, Any]]) -> list[str]:
    """The training flag that gives the ranks the entries with the nodes' paths (YAML, one line)."""
    return ["--hf-dataset", yaml.safe_dump(entries_on_nodes, default_flow_style=True, width=10**9).strip()]
