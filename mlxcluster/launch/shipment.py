"""What of a folder on the controller may go to the nodes: the files the job reads, nothing else.

Every copy from the controller to the nodes of a user's folder (a data set, a model, a run's
checkpoints) goes through `select`: it names the files the job reads, checks each one, and the
copy (mlxcluster/launch/sync.py) sends exactly those, by an rsync filter that includes them one by one
and excludes everything else. A folder is never sent whole: a data folder that also holds
`.ssh/` or a Hugging Face token sends its splits and nothing more, and a folder that is neither
a data set nor a model is refused before any copy, naming what it lacks.

A file is sent only if it is a regular file inside the folder once every symlink is resolved,
and not a hidden one: a symlink that leads out of the folder (to ~/.ssh, to /etc) or to a hidden
file in it (.cache/huggingface/token) is refused, never followed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath

from mlxcluster.errors import UserError, reason, shown
from mlxcluster.paths import PLAIN_NAME
from training.loop.checkpoint_files import ARRAYS, DIRECTORY, NAME, STATE
from training.model.folder import is_model_file, missing_from
from training.model.manifest import MANIFEST

# The splits mlx-lm's local data sets read (mlx_lm.tuner.datasets.load_local_dataset); train is
# the one a run cannot do without.
DATA_SPLITS = ("train.jsonl", "valid.jsonl", "test.jsonl")
REQUIRED_SPLIT = "train.jsonl"
TEST_SPLIT = "test.jsonl"  # what `test: true` evaluates on


# Files that hold credentials by their usual names (ssh keys, certificates and their keys, cloud and
# service-account credentials, tokens, password stores): never sent, hidden or not, even from a
# folder that goes with everything else in it (invoke run --ship).
SECRET_NAMES = ("id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*", "*.pem", "*.key", "*.p12", "*.pfx",
                "*.jks", "*.keystore", "*.kdbx", "*.ovpn", "*.tfstate", "*.tfvars", "credentials",
                "credentials.*", "*credentials*.json", "service-account*.json", "client_secret*.json",
                "token", "*.token", "*_token", "authorized_keys", "known_hosts", "secrets.*",
                "*.secret", "*.secrets", "netrc", "_netrc", "pgpass", "htpasswd")


class ShipmentError(UserError):
    """A folder that cannot go to the nodes as it is; the message names it and what to do."""


def is_hidden(name: str) -> bool:
    """A relative path with a hidden file or folder anywhere on it (.ssh/config, data/.env)."""
    return any(part.startswith(".") for part in PurePosixPath(name).parts)


def is_secret(name: str) -> bool:
    """A file named as credentials usually are (SECRET_NAMES), wherever it sits."""
    base = PurePosixPath(name).name.lower()
    return any(fnmatch(base, pattern) for pattern in SECRET_NAMES)


def refuse_broad(folder: Path, what: str) -> None:
    """A folder that is the file system's root, a home folder, or holds one (/Users, /home) is
    never scanned nor sent: it holds everything of a user's, keys and tokens included."""
    resolved = folder.resolve()
    root = Path(resolved.anchor)
    home = Path.home().resolve()
    # /Users/other or /home/other: someone's home, as the user's own is (not so for root's /root).
    homes = home.parent if home.parent != root else None
    if resolved == root or home.is_relative_to(resolved) or resolved.parent == homes:
        kind = ("the root folder" if resolved == root else "a home folder"
                if resolved == home or resolved.parent == homes else "a folder holding home folders")
        raise ShipmentError(f"{what}: {shown(folder)} is {kind}, which is never sent to the nodes: "
                            "give the folder of the job's own files (make one and put them in it)")


@dataclass(frozen=True)
class Shipment:
    """Files of `root` (resolved) to send, as paths relative to it; nothing else of it goes."""

    root: Path
    files: tuple[str, ...]

    def rsync_filter(self) -> list[str]:
        """rsync options that transfer exactly `files` (and the folders holding them)."""
        rules: list[str] = []
        for name in self.files:
            parts = PurePosixPath(name).parts
            rules += [f"--include=/{'/'.join(parts[:i])}/" for i in range(1, len(parts))]
            rules.append(f"--include=/{name}")
        return [*dict.fromkeys(rules), "--exclude=*"]


def select(root: Path, names: Iterable[str], what: str) -> Shipment:
    """`names` of the folder `root`, each checked: a plain relative path, a regular file, and inside
    `root` with every symlink resolved. `what` names the folder in messages (e.g. "--data DIR")."""
    base = root.resolve()
    if not base.is_dir():
        raise ShipmentError(f"{what}: {shown(root)} is not a folder")
    chosen = []
    for name in names:
        parts = PurePosixPath(name).parts
        if not parts or not all(PLAIN_NAME.fullmatch(part) for part in parts):
            raise ShipmentError(f"{what}: {name!r} is not a plain file name (letters, digits and . _ - "
                                "+ @ = , only, no hidden files): rename it")
        path = base.joinpath(*parts)
        resolved = path.resolve()
        if not resolved.is_relative_to(base):
            raise ShipmentError(f"{what}: {name} leads out of the folder (to {shown(resolved)}): only files "
                                f"inside {shown(base)} are sent; copy the file into it instead of linking it")
        if any(part.startswith(".") for part in resolved.relative_to(base).parts):
            raise ShipmentError(f"{what}: {name} leads to a hidden file ({resolved.relative_to(base)}), "
                                "which is never sent: put the file itself in its place")
        if not resolved.is_file():
            raise ShipmentError(f"{what}: {name} is not a regular file")
        chosen.append(name)
    return Shipment(base, tuple(chosen))


def dataset(root: Path, what: str | None = None) -> Shipment:
    """A prepared data set's splits (train.jsonl, and valid.jsonl and test.jsonl when there)."""
    what = what or f"--data {shown(root)}"
    base = root.resolve()
    if not base.is_dir():
        raise ShipmentError(f"{what}: no such folder; give a folder prepared by invoke data.prepare "
                            "(train.jsonl, valid.jsonl)")
    if not (base / REQUIRED_SPLIT).exists():
        raise ShipmentError(f"{what} is not a data set: it has no {REQUIRED_SPLIT} (invoke data.prepare "
                            "--input FILE --output DIR writes train.jsonl and valid.jsonl)")
    return select(root, [name for name in DATA_SPLITS if (base / name).exists()], what)


def model_file_names(manifest: object) -> list[str]:
    """The files a manifest lists; a ShipmentError when it lists none."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files:
        raise ShipmentError(f"its {MANIFEST} lists no files")
    return [str(name) for name in files]


def model(root: Path, what: str | None = None) -> Shipment:
    """A model folder's files as its manifest lists them (and the manifest): what the nodes verify
    their copy against. Every listed file must be one an mlx-lm model has."""
    what = what or f"--model {shown(root)}"
    base = root.resolve()
    if not base.is_dir():
        raise ShipmentError(f"{what}: no such folder; give a model folder made by invoke model.fetch")
    try:
        manifest = json.loads((base / MANIFEST).read_text(encoding="utf-8"))
        names = model_file_names(manifest)
    except FileNotFoundError:
        raise ShipmentError(f"{what} is not a model folder: it has no {MANIFEST} (invoke model.fetch "
                            f"--source {shown(root)} writes a checked copy into models/)") from None
    except (OSError, ValueError, ShipmentError) as error:
        raise ShipmentError(f"{what}: its {MANIFEST} cannot be read ({reason(error)}): fetch the model again "
                            "with invoke model.fetch") from None
    if strays := [n for n in names if not is_model_file(n)]:
        raise ShipmentError(f"{what}: its {MANIFEST} lists {', '.join(strays[:5])}, which no mlx-lm "
                            "model has (weights, config, tokenizer): fetch the model again with "
                            "invoke model.fetch")
    # What training/model/folder.py fetch requires of a model folder, here of the files its manifest lists.
    if missing := missing_from(names):
        raise ShipmentError(f"{what} is not a whole model: its {MANIFEST} lists no {', '.join(missing)}")
    return select(root, [*names, MANIFEST], what)


def checkpoints(run_dir: Path) -> Shipment | None:
    """A run's checkpoints (each one's arrays and state.json), for a launcher that lost them; None
    when the run has none. The checkpoints folder itself must be a folder of the run, not a link."""
    what = f"run {run_dir.name}'s {DIRECTORY}"
    folder = run_dir / DIRECTORY
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise ShipmentError(f"{what}: {shown(folder)} is not a folder of the run (a link or a file): "
                            "a resumed run sends only the checkpoints it wrote itself")
    if not folder.is_dir():
        return None
    steps = sorted(p.name for p in folder.iterdir() if NAME.fullmatch(p.name) and p.is_dir())
    names = [f"{step}/{name}" for step in steps for name in (*ARRAYS, STATE)
             if (folder / step / name).exists() or (folder / step / name).is_symlink()]
    return select(folder, names, what) if names else None


def config_file(path: Path, what: str = "--config") -> Path:
    """A settings file to send alone: a regular file (its folder never goes with it)."""
    if not path.is_file():
        raise ShipmentError(f"{what} {shown(path)}: no such file")
    return path
