"""A model directory's manifest (the sha256 of every file), and the state of one copy of it.

`training/model/folder.py` writes the manifest when it fetches a model; `python -m training.model verify`
and the Ansible `model` role check copies against it. The role runs this file on the nodes with
Ansible's own Python (roles/model/module_utils/model_manifest.py is a link to it), so it uses the
standard library only and runs on Python 3.9 (macOS's /usr/bin/python3).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
# Written on a node after its copy was hashed and found right: each file's size, inode, mtime
# and ctime then. While they all hold, the copy is what was hashed (any write, a `touch -r`
# included, moves ctime), so a re-provision need not hash gigabytes again. A dotfile: outside
# the manifest, and rsync leaves it out (roles/model).
VERIFIED = ".verified.json"
_CHUNK = 1 << 20


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def model_files(model_dir: Path) -> list[Path]:
    """The files a copy consists of: top level only, as mlx-lm reads it; the snapshot cache's
    dotfiles and the manifest itself stay out."""
    return sorted(
        p for p in model_dir.iterdir() if p.is_file() and not p.name.startswith(".") and p.name != MANIFEST
    )


def digests(model_dir: Path) -> dict[str, str]:
    return {p.name: sha256(p) for p in model_files(model_dir)}


def write_manifest(model_dir: Path, **info: str) -> dict[str, Any]:
    """Record the sha256 of every model file, so that copies on other nodes can be verified."""
    manifest = {**info, "files": digests(model_dir)}
    (model_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def read_manifest(model_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(model_dir) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def manifest_sha256(model_dir: Path) -> str | None:
    """The digest of the manifest file itself: one value that names the whole model."""
    path = Path(model_dir) / MANIFEST
    return sha256(path) if path.is_file() else None


def verify(model_dir: Path) -> list[str]:
    """Differences between a model directory and its manifest; empty when they agree."""
    model_dir = Path(model_dir)
    try:
        expected: dict[str, str] = json.loads((model_dir / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError) as e:
        return [f"{MANIFEST}: unreadable ({e})"]
    actual = digests(model_dir)
    problems = [f"missing: {name}" for name in sorted(expected.keys() - actual.keys())]
    problems += [f"unexpected: {name}" for name in sorted(actual.keys() - expected.keys())]
    problems += [
        f"changed: {name}"
        for name in sorted(expected.keys() & actual.keys())
        if expected[name] != actual[name]
    ]
    return problems


def _identity(model_dir: Path) -> dict[str, list[int]]:
    """Every file's (size, inode, mtime_ns, ctime_ns), the manifest's too."""
    files = [*model_files(model_dir), model_dir / MANIFEST]
    return {p.name: [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]
            for p, st in ((p, p.stat()) for p in files)}


def verified_unchanged(model_dir: Path, manifest_digest: str) -> bool:
    """True when the copy was hashed right for this manifest and no file changed since."""
    try:
        stamp = json.loads((model_dir / VERIFIED).read_text())
        return stamp["manifest_sha256"] == manifest_digest and stamp["files"] == _identity(model_dir)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def record_verified(model_dir: Path, manifest_digest: str) -> None:
    (model_dir / VERIFIED).write_text(json.dumps({"manifest_sha256": manifest_digest,
                                                  "files": _identity(model_dir)}) + "\n")


def copy_problems(model_dir: Path, expected_manifest_sha256: str | None, *, full: bool = True,
                  record: bool = False) -> list[str]:
    """Why the copy at `model_dir` is not the model whose manifest has that digest (empty: it is).

    Every file is hashed, unless `full` is False and the copy's stamp (VERIFIED) shows that no
    file changed since it was last hashed right. With `record`, a copy hashed right is stamped.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        return ["not installed"]
    found = manifest_sha256(model_dir)
    if found is None:
        return [f"no {MANIFEST}"]
    if expected_manifest_sha256 and found != expected_manifest_sha256:
        return [f"another model ({MANIFEST} sha256 {found[:12]}, expected {expected_manifest_sha256[:12]})"]
    if not full and verified_unchanged(model_dir, found):
        return []
    problems = verify(model_dir)
    if record and not problems:
        record_verified(model_dir, found)
    return problems


def free_bytes(path: Path) -> int:
    """Free bytes for this user on the filesystem `path` is (or would be) on."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def room_shortfall(model_dir: Path, model_bytes: int) -> str | None:
    """What to fix when the filesystem of `model_dir` cannot take the model (None: it can).

    What the copy already holds is counted as there: rsync replaces only what differs.
    """
    model_dir = Path(model_dir)
    held = sum(p.stat().st_size for p in model_files(model_dir)) if model_dir.is_dir() else 0
    need, free = model_bytes - held, free_bytes(model_dir)
    if need <= free:
        return None
    gib = 1 << 30
    return (f"{model_dir}: {free / gib:.2f} GiB free, the model needs {need / gib:.2f} GiB more: "
            "free space there, put cluster_root on a larger disk, or set the node's mpi_slots: 0 "
            "to leave it out of training")
