"""Fixtures of the training tests: trackers (report_to) that write nowhere but the test's folder."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def tracker_processes() -> list[str]:
    """This process's children that are a tracker's service (wandb-core), as `ps` lists them."""
    listing = subprocess.run(["ps", "-A", "-o", "ppid=,command="], capture_output=True, text=True, check=True)
    processes = ([*line.split(None, 1), ""] for line in listing.stdout.splitlines() if line.strip())
    return [command for ppid, command, *_ in processes if int(ppid) == os.getpid() and "wandb" in command]


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Both trackers offline, writing nowhere but tmp_path; every run and wandb's service ended after."""
    import swanlab
    import wandb

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "WANDB_API_KEY", "SWANLAB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-default"))  # where a run without dir= would go
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    yield tmp_path
    wandb.finish()
    if swanlab.has_run():
        swanlab.finish()
    wandb.teardown()  # stops wandb-core, which wandb.finish leaves running for the next run
    assert tracker_processes() == []
