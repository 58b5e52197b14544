"""The controller's record of training runs: runs/<id>/ and what is in it.

`invoke train` writes runs/<id>/run.json when a launch starts and updates it when it ends; the
run's files come back next to it (adapters, metrics, checkpoints/). `--resume` picks a run from
them, `invoke generate` the latest finished one.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import itertools
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from mlxcluster.errors import UserError, reason
from mlxcluster.paths import DEFAULT_INVENTORY, REPO, RUNS
from training.loop.checkpoint_files import newest_whole


class RunError(UserError):
    """No run to resume or to read, or one that cannot be; the message says what to do instead."""


def new_id() -> str:
    return dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def claim_id() -> str:
    """A new run's id, its runs/<id> made here and now so that no other run takes it: the second
    it starts, then -2, -3... when another run on this controller started in the same second (a
    second terminal, a script starting runs, or two test labs side by side)."""
    stamp = new_id()
    RUNS.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        run_id = stamp if n == 1 else f"{stamp}-{n}"
        try:
            (RUNS / run_id).mkdir()
        except FileExistsError:
            continue
        return run_id
    raise AssertionError("unreachable")


@contextlib.contextmanager
def released_if_unstarted(run_id: str) -> Iterator[str]:
    """Around what comes between claiming an id and starting its run (planning, checks): if that
    fails, the id is given back, its runs/<id> removed while still empty."""
    try:
        yield run_id
    except BaseException:
        with contextlib.suppress(OSError):
            (RUNS / run_id).rmdir()
        raise


def write_info(results: Path, info: dict) -> None:
    """runs/<id>/run.json, replaced whole: what the run is, and how far it got."""
    results.mkdir(parents=True, exist_ok=True)
    partial = results / ".run.json.partial"
    partial.write_text(json.dumps(info, indent=2) + "\n")
    partial.replace(results / "run.json")


def read_info(results: Path) -> dict[str, Any]:
    """runs/<id>/run.json; a RunError when it is missing, cut short or not a run's record."""
    path = results / "run.json"
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RunError(f"{path} does not exist: {results.name} is not a run of invoke train") from None
    except (OSError, ValueError, RecursionError) as error:
        raise RunError(f"{path} cannot be read ({reason(error)}): the run's "
                       "record is damaged; start a new run with invoke train") from None
    if not isinstance(info, dict):
        raise RunError(f"{path} holds no run record: start a new run with invoke train")
    return info


def recorded_path(results: Path, info: dict[str, Any], key: str) -> str:
    """A folder the run's record names (its data, its model); a RunError when it names none."""
    value = info.get(key)
    if not isinstance(value, str) or not value:
        raise RunError(f"{results / 'run.json'} names no {key}: the run's record is damaged; start a "
                       "new run with invoke train")
    return value


def add_to_summary(run: Path, fields: Callable[[dict[str, Any]], Mapping[str, Any]]) -> None:
    """Put what only the controller knows into the summary the ranks wrote: the `fields` made from
    it, written aside and renamed into place."""
    path = run / "summary.json"
    summary = json.loads(path.read_text())
    summary.update(fields(summary))
    partial = path.with_name(".summary.json.partial")
    partial.write_text(json.dumps(summary, indent=2) + "\n")
    partial.replace(path)


def add_step_times(run: Path, times: Sequence[float]) -> None:
    """Each rank's expected time for its part of a step, relative to the fastest rank's (from the
    weights it split by), into the summary's batch ranks."""

    def timed(summary: dict[str, Any]) -> dict[str, Any]:
        batch = summary.get("batch", {})
        for rank, time in zip(batch.get("ranks", []), times, strict=False):
            rank["expected_step_time"] = round(time, 3)
        return {"batch": batch} if batch else {}

    add_to_summary(run, timed)


def latest_checkpoint(results: Path) -> int | None:
    """The step of the run's newest whole checkpoint: the one rank 0 resumes from (the same check,
    training/loop/checkpoint_files.py), damaged newer ones passed over."""
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
    with, but for those the layout gave rank by rank (run.json's layout_settings: batch shares,
    micro-batch caps, the ranks that dequantize), which the launch works out again for the nodes
    it has now (fewer, after a fault)."""
    import yaml

    config = REPO / "build" / "resume" / f"{run_id}.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    info = read_info(RUNS / run_id)
    # Runs recorded before layout_settings: shares in run.json were the layout's.
    older = ["batch_shares", "max_micro_batch"] if info.get("batch_shares") else []
    given = info.get("layout_settings", older)
    text = (RUNS / run_id / "config.yaml").read_text()
    if given:
        settings = yaml.safe_load(text)
        if isinstance(settings, dict):
            text = yaml.safe_dump({k: None if k in given else v for k, v in settings.items()},
                                  sort_keys=False)
    config.write_text(text)
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
    return recorded_path(run, read_info(run), "model")


def print_summary(results: Path, inventory: str | None = None) -> None:
    from rich.console import Console

    Console().print(summary_table(results))
    print("\n".join(next_steps(results, inventory)))


def next_steps(results: Path, inventory: str | None = None) -> list[str]:
    """What to do with a finished run: its commands, as they would be typed here."""
    run = results.name
    on = f" -i {inventory}" if inventory and Path(inventory) != Path(DEFAULT_INVENTORY) else ""
    full = (results / "adapter_config.json").is_file() and \
        json.loads((results / "adapter_config.json").read_text()).get("fine_tune_type") == "full"
    lines = ["next:", f'  invoke generate --adapter runs/{run} --prompt "..."   # the base and this run']
    if not full:
        lines.append(f"  invoke serve{on} --run {run}   # behind an OpenAI-compatible API, on its nodes")
    lines.append(f"  invoke fuse --run {run}   # a model folder that mlx_lm generate and mlx_lm.server load")
    return lines


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


def named_in(output: str) -> Path | None:
    """The run folder an `invoke train` printed names in its summary table's title
    (summary_table's "run <id>"); None when it printed none."""
    for line in output.splitlines():
        words = line.split()
        if len(words) == 2 and words[0] == "run" and words[1].startswith("2"):
            return RUNS / words[1]
    return None


# --- invoke generate ------------------------------------------------------------------------------

ADAPTER_FILES = ("adapter_config.json", "adapters.safetensors")


def adapters_of(run: Path, flag: str = "--adapter") -> Path:
    """A folder of LoRA adapters as mlx-lm loads them (a run's folder, or any with mlx-lm's two
    files); a RunError naming what it lacks."""
    if not run.is_dir():
        raise RunError(f"{flag} {run}: no such folder; give a run's folder, e.g. runs/<id>")
    for name in ADAPTER_FILES:
        if not (run / name).is_file():
            raise RunError(f"{flag} {run}: no {name} (a broken link, or not a folder of adapters); "
                           "give a finished run's folder, e.g. runs/<id>")
    try:
        config = json.loads((run / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:
        raise RunError(f"{flag} {run}: adapter_config.json cannot be read ({reason(error)})") from None
    if not isinstance(config, dict) or not ({"num_layers", "lora_parameters"} <= config.keys()
                                            or config.get("fine_tune_type") == "full"):
        raise RunError(f"{flag} {run}: adapter_config.json lacks num_layers and lora_parameters, "
                       "which mlx-lm needs to place the adapters")
    return run


def named(item: str | None, flag: str = "--run") -> Path:
    """The run folder a flag names (a run id under runs/, or a folder), with its adapter files; none
    named: the latest finished run."""
    if not item:
        return adapters_of(latest_finished())
    folder = RUNS / item if "/" not in item and (RUNS / item).is_dir() else Path(item)
    return adapters_of(folder, flag)


def model_for(run: Path, given: str | None) -> Path:
    """The base model to answer with: the one given, else the run's own; a RunError when it is no
    model folder."""
    from training.model.folder import missing_files

    model = Path(given) if given else Path(base_model(run))
    label = "--model" if given else f"run {run.name}'s model"
    if not model.is_dir():
        raise RunError(f"{label} {model}: no such folder; pass --model <base model directory>")
    if missing := missing_files(model):
        raise RunError(f"{model} is not a model folder: it has no {', '.join(missing)}")
    return model


def side_by_side(prompt: str, adapter: str | None, model: str | None, max_tokens: int) -> None:
    """invoke generate: the base model's and the fine-tuned model's answers, side by side."""
    from training.tools.generate import side_by_side as answers

    run = adapters_of(Path(adapter)) if adapter else latest_finished()
    base = model_for(run, model)
    try:
        answers(base, run, prompt, max_tokens)
    except (ValueError, KeyError, RuntimeError) as error:  # mlx-lm's word on files it cannot use
        raise RunError(f"the adapters in {run} do not fit {base}: {' '.join(str(error).split())[:300]}"
                       ) from None
