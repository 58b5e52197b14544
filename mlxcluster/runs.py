"""The controller's record of training runs: runs/<id>/ and what is in it.

`invoke train` writes runs/<id>/run.json when a launch starts and updates it when it ends; the
run's files come back next to it (adapters, metrics, checkpoints/). `--resume` picks a run from
them, `invoke generate` the latest finished one.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
from pathlib import Path
from typing import Any

from mlxcluster.errors import UserError
from mlxcluster.paths import REPO, RUNS
from training.checkpoint_files import newest_whole


class RunError(UserError):
    """No run to resume or to read, or one that cannot be; the message says what to do instead."""


def new_id() -> str:
    return dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def write_info(results: Path, info: dict) -> None:
    """runs/<id>/run.json, replaced whole: what the run is, and how far it got."""
    results.mkdir(parents=True, exist_ok=True)
    partial = results / ".run.json.partial"
    partial.write_text(json.dumps(info, indent=2) + "\n")
    partial.replace(results / "run.json")


def read_info(results: Path) -> dict[str, Any]:
    return json.loads((results / "run.json").read_text())


def latest_checkpoint(results: Path) -> int | None:
    """The step of the run's newest whole checkpoint: the one rank 0 resumes from (the same check,
    training/checkpoint_files.py), damaged newer ones passed over."""
    path, _, _ = newest_whole(results)
    return int(path.name) if path is not None else None


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
    return run_dir.name, read_info(run_dir)


def resume_config(run_id: str) -> Path:
    """A copy of the run's config.yaml, which rank 0 wrote and which came back with the run's
    files, to go to every node like a --config: every rank reads the settings the run started
    with."""
    config = REPO / "build" / "resume" / f"{run_id}.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(RUNS / run_id / "config.yaml", config)
    return config


def latest_finished(runs: Path = RUNS) -> Path:
    run_dirs = sorted(p for p in runs.glob("2*") if (p / "summary.json").exists())
    if not run_dirs:
        raise RunError("no finished run in runs/: run invoke train first, or pass --adapter")
    return run_dirs[-1]


def base_model(run: Path) -> str:
    """The model a run was trained from, as its run.json records it."""
    if not (run / "run.json").exists():
        raise RunError(f"{run} has no run.json: pass --model <base model directory>")
    return read_info(run)["model"]


def print_summary(results: Path) -> None:
    from rich.console import Console

    Console().print(summary_table(results))


def summary_table(results: Path) -> Any:
    """A rich table of a finished run: its summary numbers and where its files are."""
    from rich.table import Table

    table = Table(title=f"run {results.name}", show_header=False)
    summary_file = results / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    for key, value in summary.items():
        if not isinstance(value, (dict, list)):
            table.add_row(key, str(value))
    for name in ("adapters.safetensors", "metrics.jsonl", "loss.png", "config.yaml"):
        table.add_row(name, str(results / name) if (results / name).exists() else "missing")
    return table
