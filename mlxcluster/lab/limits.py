"""A lab node made smaller: a CPU quota or a memory limit on every process of its namespace.

A real home cluster mixes machines (a slow Mac beside a fast one, one with less memory); the lab's
nodes share one Linux box. A control group holds all of a node's processes (its sshd, and so every
ssh session and training rank it starts later): `cpu` caps its share of the CPU (30 % of one core),
`memory` its RAM (no swap). Both cgroup layouts are handled: v1 (a hierarchy per controller, as on
this machine) and v2 (one unified tree).
"""

from __future__ import annotations

import math
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from mlxcluster.errors import UserError

CGROUP_ROOT = Path(os.environ.get("MLX_CGROUP_ROOT", "/sys/fs/cgroup"))
PERIOD_US = 100_000


class LimitError(UserError):
    pass


@dataclass(frozen=True)
class Layout:
    """Where a controller's groups live: v2 (unified) or v1 (one folder per controller)."""

    unified: bool
    root: Path

    def folder(self, controller: str, name: str) -> Path:
        return self.root / name if self.unified else self.root / controller / name


def layout(root: Path = CGROUP_ROOT) -> Layout:
    controllers = root / "cgroup.controllers"
    if controllers.exists():
        return Layout(True, root)
    if (root / "cpu").is_dir() and (root / "memory").is_dir():
        return Layout(False, root)
    raise LimitError(f"no cgroup cpu and memory controllers under {root}: the lab cannot limit a node here")


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_memory(text: str) -> int:
    """Bytes from 800M, 1.5G, 1.5GB, 2GiB (binary units), or a plain number of bytes."""
    number = str(text).strip().upper().removesuffix("IB").removesuffix("B")
    unit = number[-1:] if number[-1:] in _UNITS else ""
    try:
        value = float(number.removesuffix(unit)) * _UNITS[unit]
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value > 2**60:
        raise LimitError(f"--memory {text!r}: give a size like 800MB or 1.5GB")
    if value < 2**20:
        raise LimitError(f"--memory {text!r}: at least 1 MB")
    return int(value)


def group_name(lab_id: int, node: int) -> str:
    return f"mlx-lab{lab_id}-node{node}"


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as error:
        raise LimitError(f"cannot write {value!r} to {path}: {error}") from None


def _netns_pids(netns: str) -> list[str]:
    return subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True,
                          check=False).stdout.split()


def limit(lab_id: int, node: int, netns: str, *, cpu_percent: float | None = None,
          memory_bytes: int | None = None, root: Path = CGROUP_ROOT) -> list[Path]:
    """Put every process of `netns` under a CPU quota (percent of one core) and/or a memory limit;
    the groups written. Processes it starts later inherit them."""
    where = layout(root)
    name = group_name(lab_id, node)
    written = []
    if where.unified:
        _write(root / "cgroup.subtree_control", "+cpu +memory")
    if cpu_percent is not None:
        if not 1 <= cpu_percent <= 100 * (os.cpu_count() or 1):
            raise LimitError(f"--cpu {cpu_percent}: a percent of one core, from 1 up to "
                             f"{100 * (os.cpu_count() or 1)}")
        folder = where.folder("cpu", name)
        folder.mkdir(exist_ok=True)
        quota = int(PERIOD_US * cpu_percent / 100)
        if where.unified:
            _write(folder / "cpu.max", f"{quota} {PERIOD_US}")
        else:
            _write(folder / "cpu.cfs_period_us", str(PERIOD_US))
            _write(folder / "cpu.cfs_quota_us", str(quota))
        written.append(folder)
    if memory_bytes is not None:
        folder = where.folder("memory", name)
        folder.mkdir(exist_ok=True)
        if where.unified:
            _write(folder / "memory.max", str(memory_bytes))
            _write(folder / "memory.swap.max", "0")
        else:
            # memory + swap may never be below memory alone: a raised limit writes it first.
            files = ["memory.limit_in_bytes"]
            if (folder / "memory.memsw.limit_in_bytes").exists():
                current = (folder / "memory.limit_in_bytes").read_text().strip()
                raised = current.isdigit() and memory_bytes > int(current)
                both = "memory.memsw.limit_in_bytes"
                files = [both, *files] if raised else [*files, both]
            for file in files:
                _write(folder / file, str(memory_bytes))
            _write(folder / "memory.swappiness", "0")
        written.append(folder)
    for folder in dict.fromkeys(written):
        for pid in _netns_pids(netns):
            try:
                (folder / "cgroup.procs").write_text(pid)
            except ProcessLookupError:
                pass  # gone meanwhile
    return written


def clear(lab_id: int, node: int, root: Path = CGROUP_ROOT) -> None:
    """Lift a node's limits: its processes go back to the root groups, and the groups go."""
    try:
        where = layout(root)
    except LimitError:
        return
    name = group_name(lab_id, node)
    for controller in ("cpu", "memory"):
        folder = where.folder(controller, name)
        if not folder.is_dir():
            continue
        parent = root if where.unified else root / controller
        try:
            pids = (folder / "cgroup.procs").read_text().split()
        except OSError:
            pids = []
        for pid in pids:
            try:
                (parent / "cgroup.procs").write_text(pid)
            except (ProcessLookupError, OSError):
                pass
        try:
            folder.rmdir()
        except OSError:
            pass  # v2 shares one folder for both: already gone
