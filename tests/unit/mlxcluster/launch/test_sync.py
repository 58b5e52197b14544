"""The sync steps run in waves (mlxcluster/launch/sync.py's run_steps): the steps between two WAITs
at once, each wave after the one before it, a failure said with its step once its wave is over."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxcluster.launch import sync


def meet(mine: Path, theirs: Path) -> list[str]:
    """A step that leaves its mark and waits (5 s at most) for the other's: both end only when they
    run at the same time."""
    return ["sh", "-c", f"touch {mine}; for i in $(seq 50); do [ -e {theirs} ] && exit 0; sleep 0.1; "
            "done; exit 1"]


def test_the_steps_of_a_wave_run_at_once_and_a_wave_after_the_one_before(tmp_path: Path, capsys):
    a, b, copied = tmp_path / "a", tmp_path / "b", tmp_path / "copied"
    steps = [("to node1", meet(a, b)), ("to node2", meet(b, a)), sync.WAIT,
             ("from node1", ["sh", "-c", f"[ -e {a} ] && [ -e {b} ] && touch {copied}"])]
    sync.run_steps(steps, in_waves=True)
    assert copied.exists()
    assert capsys.readouterr().out == "==> to node1\n==> to node2\n==> from node1\n"
    # One after the other (the default), the first would wait for the second in vain.
    for mark in (a, b):
        mark.unlink()
    with pytest.raises(sync.SyncError, match=r"^to node1 failed \(1\)"):
        sync.run_steps(steps)


def test_a_failed_step_stops_the_steps_after_its_wave_and_says_which(tmp_path: Path):
    late = tmp_path / "late"
    steps = [("sync code to node1", ["true"]), ("sync data to node2", ["sh", "-c", "echo full >&2; exit 3"]),
             sync.WAIT, ("verify on node2", ["touch", str(late)])]
    with pytest.raises(sync.SyncError, match=r"sync data to node2 failed \(3\):\nfull"):
        sync.run_steps(steps, in_waves=True)
    assert not late.exists()


def test_a_dry_run_prints_every_step_but_no_wait(capsys):
    sync.run_steps([("one", ["true"]), sync.WAIT, ("two", ["false"])], dry_run=True, in_waves=True)
    assert capsys.readouterr().out == "# one\ntrue\n# two\nfalse\n"
