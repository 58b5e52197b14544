"""Ansible filter of the apt_packages role: the packages a node still lacks, by the list of installed
packages playbooks/base.yml reads once per run. The roles that install Debian packages skip the
apt_packages role whole (its argument check, its apt task) where nothing is missing: on a converged
cluster that is every node, every run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def apt_packages_missing(names: Sequence[str], installed: Sequence[str] | None) -> list[str]:
    """``{{ names | apt_packages_missing(cluster_installed_packages | default(None)) }}``: the names
    not installed; all of them when the installed list is not known (apt then decides)."""
    if installed is None:
        return list(names)
    have = set(installed)
    return [name for name in names if name not in have]


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"apt_packages_missing": apt_packages_missing}
