"""The controller's record of training runs (runs/<id>/) and the relay of a run's output.

`invoke train` writes runs/<id>/run.json when a launch starts and updates it when it ends; the
run's files come back next to it (adapters, metrics, checkpoints/). `--resume` picks a run from
them. The relay passes a launch's output through as it comes and notices a rank that stalled.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


class RunError(ValueError):
    """No run to resume, or one that cannot be; the message says what to do instead."""


# What a rank's watchdog prints when it stops itself (training/watchdog.py).
STALL_MESSAGE = b"error: no progress for"
# How long the launcher gets to exit after a rank stalled. mpirun waits for ever for the node
# daemon of a node that dropped off the link, so then the run is stopped from here.
STALL_GRACE = 10.0


def relay(cmd: list[str], cwd: Path, keep: int = 1 << 16,
          on_stall: Callable[[], None] | None = None) -> tuple[int, str]:
    """Run cmd with its output passed through as it comes (progress bars included); return the
    exit status and the output's tail, from which a failure is described.

    on_stall is called once if a rank reported a stall and cmd is still running STALL_GRACE
    seconds later."""
    with subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        return _pass_through(proc, keep, on_stall)


def _pass_through(proc: subprocess.Popen, keep: int,
                  on_stall: Callable[[], None] | None) -> tuple[int, str]:
    assert proc.stdout is not None
    tail = b""
    out = sys.stdout.buffer
    stalled_at: float | None = None
    while True:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            if not (chunk := proc.stdout.read1(4096)):
                break
            out.write(chunk)
            out.flush()
            if stalled_at is None and STALL_MESSAGE in tail[-len(STALL_MESSAGE):] + chunk:
                stalled_at = time.monotonic()
            tail = (tail + chunk)[-keep:]
        if stalled_at is not None and on_stall and time.monotonic() - stalled_at > STALL_GRACE:
            on_stall()
            on_stall = None
    return proc.wait(), tail.decode(errors="replace")


def write_info(results: Path, info: dict) -> None:
    """runs/<id>/run.json, replaced whole: what the run is, and how far it got."""
    results.mkdir(parents=True, exist_ok=True)
    partial = results / ".run.json.partial"
    partial.write_text(json.dumps(info, indent=2) + "\n")
    partial.replace(results / "run.json")


def latest_checkpoint(results: Path) -> int | None:
    steps = [int(p.name) for p in (results / "checkpoints").glob("[0-9]" * 7)
             if (p / "state.json").exists()]
    return max(steps, default=None)


def resume_hint(results: Path) -> str:
    step = latest_checkpoint(results)
    if step is None:
        return ""
    return f"; its checkpoint at step {step} continues with: invoke train --resume {results.name}"


def resumable(runs: Path, run_id: str | None) -> tuple[str, dict]:
    """(id, run.json) of the run --resume continues: the one named, or the latest unfinished."""
    if run_id is None:
        unfinished = sorted(p for p in runs.glob("2*") if (p / "run.json").exists()
                            and not (p / "summary.json").exists())
        if not unfinished:
            raise RunError("no unfinished run in runs/ to resume: start one with invoke train")
        run_dir = unfinished[-1]
    else:
        run_dir = runs / Path(run_id).name
        if not (run_dir / "run.json").exists():
            known = ", ".join(p.name for p in sorted(runs.glob("2*"))[-5:]) or "none"
            raise RunError(f"--resume {run_id}: no run.json in {run_dir} (recent runs: {known})")
        if (run_dir / "summary.json").exists():
            raise RunError(f"run {run_dir.name} finished all its steps: nothing to resume "
                           "(start a new run with invoke train)")
    if not (run_dir / "config.yaml").exists():
        raise RunError(f"run {run_dir.name} stopped before it started training (it has no "
                       "config.yaml): start a new run with invoke train")
    return run_dir.name, json.loads((run_dir / "run.json").read_text())
