"""Nodes left out of training after a fault: build/<inventory>/drained.json, beside the layout.

A node that a run went on without (mlxcluster/check/faults.py names it and its cause) stays out
of later runs until its checks pass again: `invoke doctor` shows it, and `invoke train` (a new run,
a resume, a restart) checks it before it launches and lets it back in when it is green, so a node
rejoins between runs and restarts, never half-way through a step. The run's own record
(runs/<id>/run.json, "drained") keeps the entries of the nodes it went on without.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Collection
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mlxcluster.errors import reason

FILE = "drained.json"


@dataclass(frozen=True)
class Drained:
    """One node left out: why (its fault's cause and the failure's words), by which run, when,
    and the step the run went on from without it."""

    node: str
    cause: str
    why: str
    run: str
    at: str
    step: int | None = None

    @classmethod
    def now(cls, node: str, cause: str, why: str, run: str, step: int | None) -> Drained:
        return cls(node, cause, why, run, dt.datetime.now().isoformat(timespec="seconds"), step)

    @property
    def line(self) -> str:
        since = self.at.replace("T", " ")
        return f"{self.node} left out since {since} by run {self.run} ({self.cause})"


def read(build: Path) -> dict[str, Drained]:
    """The nodes left out, by name. A missing file is none; an unreadable one is said and counts
    as none: every node is checked before a launch anyway, so a node it named that is still
    broken stops the launch with its red checks."""
    path = build / FILE
    try:
        entries: Any = json.loads(path.read_text(encoding="utf-8"))
        return {e["node"]: Drained(**{k: e[k] for k in Drained.__dataclass_fields__ if k in e})
                for e in entries}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError, KeyError) as error:
        print(f"warning: {path} cannot be read ({reason(error)}): no node counts as left out; delete it to "
              "silence this", flush=True)
        return {}


def _write(build: Path, drained: Collection[Drained]) -> None:
    build.mkdir(parents=True, exist_ok=True)
    path = build / FILE
    if not drained:
        path.unlink(missing_ok=True)
        return
    partial = path.with_name(f".{FILE}.partial")
    entries = [asdict(d) for d in sorted(drained, key=lambda d: d.node)]
    partial.write_text(json.dumps(entries, indent=2) + "\n")
    partial.replace(path)


def add(build: Path, entry: Drained) -> None:
    """Record `entry` (replacing the node's earlier one)."""
    _write(build, {**read(build), entry.node: entry}.values())


def rejoin(build: Path, names: Collection[str]) -> list[Drained]:
    """Let the nodes `names` back in (their checks pass again); the entries removed."""
    found = read(build)
    back = [found.pop(name) for name in names if name in found]
    if back:
        _write(build, found.values())
    return back
