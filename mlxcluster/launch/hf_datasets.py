"""mlx-lm's `hf_dataset` on the cluster: a Hugging Face dataset folder on the controller, sent to
every node like the prepared data, and the setting rewritten to where it lands.

`mlx_lm lora` reads `hf_dataset` (one mapping, or a list of them) with the `datasets` package:
`load_dataset(path, split=..., **config)` for each, with the features it names. Here each entry's
`path` must be a folder on the controller: the nodes train offline, so a hub dataset's name is
refused with the way to download it, and so is a folder as broad as / or a home folder.

Of a folder only what `load_dataset` reads goes, never every file that looks like data (a
service-account key in a subfolder once went with the splits): the data files that `datasets`
itself resolves for the entry (`load_dataset_builder` with the entry's config, offline, which goes
by the files' names and reads no data), the dataset card README.md whose YAML may name the splits,
and the dataset_infos.json older datasets wrote. A data file the config names outside the folder,
or one named as credentials are, is refused, as is every file the shipment's checks refuse
(mlxcluster/launch/shipment.py). The ranks get the same entries with the nodes' paths, as a
`--hf-dataset` flag after the user's settings.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from mlxcluster.errors import UserError, shown
from mlxcluster.launch import shipment
from mlxcluster.paths import PLAIN_NAME

# The usual data files of a dataset folder, for the message when it holds none of them.
DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".tsv", ".txt", ".arrow")
# Beside the data files, what load_dataset reads of a local folder: the dataset card (its YAML
# header may name configs and their data files) and the split sizes older datasets wrote.
CARD = "README.md"
LEGACY_INFOS = "dataset_infos.json"
# Read as the card's YAML too, but hidden, so never sent: the nodes would read the folder otherwise.
HIDDEN_CARD_YAML = ".huggingface.yaml"
# What save_to_disk writes, which load_dataset refuses (load_from_disk reads it).
SAVED_STATE = "state.json"
# Arguments of load_dataset that mlx-lm would pass through `config` too but that do not change the
# files read: the builder takes none of them but cache_dir, for which it gets a throwaway one here.
LOAD_ONLY_ARGUMENTS = ("split", "verification_mode", "keep_in_memory", "save_infos", "streaming",
                       "num_proc", "trust_remote_code", "cache_dir")


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


@contextmanager
def _offline() -> Iterator[None]:
    """datasets and huggingface_hub read HF_HUB_OFFLINE / HF_DATASETS_OFFLINE once, when imported:
    their copies are set too, so that no resolving ever tries the hub, and all are put back after
    (a later download in this process must still reach it). Their warnings are held back meanwhile:
    a card without YAML is no fault here, and the nodes' load_dataset says the same again."""
    import datasets.config
    import huggingface_hub.constants

    saved_env = {name: os.environ.get(name) for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    copies = [(datasets.config, "HF_HUB_OFFLINE"), (datasets.config, "HF_DATASETS_OFFLINE"),
              (huggingface_hub.constants, "HF_HUB_OFFLINE")]
    saved = [getattr(module, name) for module, name in copies]
    loggers = [logging.getLogger(name) for name in ("datasets", "huggingface_hub")]
    levels = [logger.level for logger in loggers]
    os.environ.update(dict.fromkeys(saved_env, "1"))
    for module, name in copies:
        setattr(module, name, True)
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
        for (module, name), value in zip(copies, saved, strict=True):
            setattr(module, name, value)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _one_line(error: BaseException) -> str:
    """An exception from datasets as a message shows it: one line, and short (some list every
    extension datasets knows)."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 240 else f"{text[:240]}..."


def _patterns_named(config: Mapping[str, Any]) -> list[str]:
    """The paths the entry's config names itself: its data_files (one, a list, or a list per
    split) and data_dir."""
    given = config.get("data_files")
    per_split = given.values() if isinstance(given, Mapping) else [given]
    named = [item for value in per_split
             for item in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(item, str)]
    return [*named, *([config["data_dir"]] if isinstance(config.get("data_dir"), str) else [])]


def _refuse_outside(what: str, named: str) -> None:
    raise UserError(f"{what}: the data file {shown(named)} is not inside the folder, and the nodes get only "
                    "the folder's files: put the file inside the folder and name it relative to it, in the "
                    "entry's config (e.g. config: {data_files: {train: data/train.jsonl}}) or in the "
                    f"configs of its {CARD}")


def _data_files(root: Path, entry: Mapping[str, Any], what: str) -> list[str]:
    """The files datasets resolves for the entry, as load_dataset on the nodes will, relative to
    `root` (resolved); a UserError naming the entry and the fix when it cannot."""
    config = entry.get("config") or {}
    if not isinstance(config, Mapping):
        raise UserError(f"{what}: its config must be a mapping of load_dataset's arguments (e.g. "
                        f"{{name: default}}), got {shown(config)}")
    for named in _patterns_named(config):
        if Path(named).is_absolute() or named.startswith("~") or "://" in named or ".." in Path(named).parts:
            _refuse_outside(what, named)
    if (root / HIDDEN_CARD_YAML).exists():
        raise UserError(f"{what}: its {HIDDEN_CARD_YAML} shapes what datasets reads, but a hidden file is "
                        f"never sent: move its YAML into the header of {CARD} and delete it")
    if (root / SAVED_STATE).exists():
        raise UserError(f"{what} holds a dataset saved by save_to_disk ({SAVED_STATE}), which load_dataset "
                        "refuses: save it with to_json or to_parquet into a folder and give that folder")
    import datasets  # slow to import: only when an hf_dataset is given
    from datasets.data_files import EmptyDatasetError
    from datasets.exceptions import DataFilesNotFoundError

    arguments = {key: value for key, value in config.items() if key not in LOAD_ONLY_ARGUMENTS}
    try:
        # The builder as load_dataset makes it, which resolves the config's data files by their
        # names: no data is read, and the cache it opens is a throwaway one, not the user's.
        with _offline(), tempfile.TemporaryDirectory(prefix="hf-dataset-files-") as cache:
            builder = datasets.load_dataset_builder(str(root), cache_dir=cache, **arguments)
    except (DataFilesNotFoundError, EmptyDatasetError):
        raise UserError(f"{what} holds no data file datasets reads ({', '.join(DATA_FILE_SUFFIXES)}, "
                        f"or those its {CARD}'s configs name): put the dataset's files in it") from None
    except yaml.YAMLError as error:
        raise UserError(f"{what}: the YAML header of its {CARD} cannot be read ({_one_line(error)}): "
                        "fix it, or delete the header") from None
    except Exception as error:  # whatever else datasets raises: shown in one line, with the fix
        raise UserError(f"{what}: datasets cannot load it as the nodes would ({type(error).__name__}: "
                        f"{_one_line(error)}): fix the entry's config or the folder's {CARD}") from None
    found = builder.config.data_files or {}
    names = []
    for path in dict.fromkeys(str(file) for files in found.values() for file in files):
        relative = PurePosixPath(path).relative_to(root) if PurePosixPath(path).is_relative_to(root) else None
        if relative is None or ".." in relative.parts:
            _refuse_outside(what, path)
        if shipment.is_secret(str(relative)):
            raise shipment.ShipmentError(
                f"{what}: datasets would read {relative} as data, and it is named as credentials are, "
                "which are never sent: move it out of the folder, or name the data files in the entry's "
                "config (config: {data_files: {train: ...}})")
        names.append(str(relative))
    return names


def _files_of(root: Path, entry: Mapping[str, Any], what: str) -> list[str]:
    """What load_dataset reads of the folder `root` (resolved) for the entry: its data files, and
    the card and legacy infos when there."""
    beside = [name for name in (CARD, LEGACY_INFOS) if (root / name).exists() or (root / name).is_symlink()]
    return list(dict.fromkeys([*_data_files(root, entry, what), *beside]))


def folder(index: int, entry: Mapping[str, Any]) -> HfFolder:
    """The files of one entry's local `path`, checked; a UserError naming what to do otherwise."""
    given = entry.get("path")
    what = f"hf_dataset{'' if index == 0 else f' entry {index + 1}'} path {shown(given)}"
    if not isinstance(given, str) or not given:
        raise UserError(f"hf_dataset: every entry needs a path (a dataset folder), got {shown(given)}")
    path = Path(given).expanduser()
    shipment.refuse_broad(path, what)  # before anything looks into it: / would be the whole disk
    if not path.is_dir():
        raise UserError(f"{what} is not a folder here, and the nodes train offline: download the dataset "
                        f"into a folder first (e.g. huggingface-cli download --repo-type dataset {given} "
                        f"--local-dir data/{Path(given).name}) and give that folder")
    return HfFolder(index, shipment.select(path, _files_of(path.resolve(), entry, what), what),
                    _node_name(index, path))


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
