"""A check's verdict: what it is about, green or red, and the fix for red. Its own module so that
the doctor's helpers (pairs.py) and the doctor build the same kind of row."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    scope: str  # a node, "node1 -> node2", or "cluster"
    name: str
    ok: bool
    detail: str
    fix: str = ""

    @property
    def nodes(self) -> list[str]:
        """The nodes it is about: one, two (a pair's ends), or none (the cluster's)."""
        return [] if self.scope == "cluster" else [part.strip() for part in self.scope.split("->")]
