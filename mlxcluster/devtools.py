"""The project's own checks, behind `invoke lint` and `invoke test`."""

from __future__ import annotations

import os

from mlxcluster import local
from mlxcluster.lab import cache

RUFF_TARGETS = ("tasks.py", "mlxcluster", "training", "tests", "filter_plugins")


def lint() -> None:
    """ruff, yamllint and ansible-lint's production profile (offline: no Galaxy)."""
    local.run(["ruff", "check", *RUFF_TARGETS])
    local.run(["yamllint", "--strict", "."])
    local.run(["ansible-lint", "--profile", "production", "--offline"])


def test(*, unit: bool = False, k: str | None = None) -> None:
    """pytest: the unit tests alone, or everything (the lab tests need root, and a filled cache
    that lab hosts install from)."""
    cmd = ["pytest", "tests/unit"] if unit else ["pytest"]
    if k:
        cmd += ["-k", k]
    if not unit and os.geteuid() == 0:
        cache.prepare_offline_cache()
    local.run(cmd)
