"""`invoke bench.calibrate`: each node's own speed and memory at this fine-tune, for batch_share: auto
and for the plan's step times.

Every node that trains runs a few steps of the configured model alone, one node after the other (on
a shared machine two at once would slow each other), launched exactly as `invoke train` launches:
one rank, its share of the run's global batch. Its tokens/s (past the first report, which compiles)
and peak memory go into build/<inventory>/calibration.json under the model's manifest digest and
the sequence length, where `invoke train` finds the latest one (mlxcluster/launch/batch_shares.py).

A second run at another batch size (half the share, or 2 rows where the share is 1) gives the plan
the line through both steps: the fixed seconds of a pass, and tokens/s past them
(mlxcluster/plan/speed.py). A second run that fails leaves the first's tokens/s alone, as before.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcluster.bench import results
from mlxcluster.check import doctor, room
from mlxcluster.describe.cluster import Cluster, Node, Recorded
from mlxcluster.errors import UserError
from mlxcluster.jobs import train
from mlxcluster.jobs.request import Request
from mlxcluster.launch import batch_shares
from mlxcluster.launch import settings as run_settings
from mlxcluster.plan import speed
from mlxcluster.provision import inputs
from training.config import FinetuneConfig


def alone(node: Node) -> Cluster:
    """`node` as a cluster of its own: the launcher, with one rank, which takes the whole batch
    (its max_micro_batch still holds)."""
    return Cluster(node.name, (dataclasses.replace(node, slots=1, batch_share=None),), provisioned=False)


def node_row(summary: Mapping[str, Any]) -> dict[str, Any]:
    return {"tokens_per_second": round(float(summary["tokens_per_second"]), 1),
            "peak_memory_gb": round(float(summary.get("peak_memory_gb") or 0.0), 3),
            "step_seconds": summary.get("step_seconds")}


def step_point(summary: Mapping[str, Any]) -> tuple[float, float] | None:
    """A run's steady step as (tokens, seconds); None: it reported once only."""
    seconds, rate = summary.get("step_seconds"), summary.get("tokens_per_second")
    return (float(rate) * float(seconds), float(seconds)) if seconds and rate else None


def with_pace(row: Mapping[str, Any], first: Mapping[str, Any], second: Mapping[str, Any],
              second_rows: int) -> dict[str, Any]:
    """`row` with the line through both runs' steps (the second run's own figures beside it)."""
    points = step_point(first), step_point(second)
    kept = {**row, "second": {"examples_per_step": second_rows, **node_row(second)}}
    if points[0] is None or points[1] is None:
        return kept
    pace = speed.fitted(points[0], points[1])
    return {**kept, "marginal_tokens_per_second": round(pace.speed, 2),
            "overhead_seconds": round(pace.overhead, 4)}


def table(entry: Mapping[str, Any]) -> Any:
    from rich.table import Table

    fastest = max(n["tokens_per_second"] for n in entry["nodes"].values()) or 1.0
    t = Table(title=f"calibration: {entry['model']}, {entry['examples_per_step']} examples per step, "
                    f"max_seq_length {entry['max_seq_length']}")
    for name in ("node", "tokens/s", "of the fastest", "peak memory", "fixed s a step", "tokens/s past it"):
        t.add_column(name, justify="right" if name != "node" else "left")
    for name, n in entry["nodes"].items():
        overhead, marginal = n.get("overhead_seconds"), n.get("marginal_tokens_per_second")
        t.add_row(name, f"{n['tokens_per_second']:,.0f}", f"{n['tokens_per_second'] / fastest:.0%}",
                  f"{n['peak_memory_gb']:.2f} GB", "-" if overhead is None else f"{overhead:.3f}",
                  "-" if marginal is None else f"{marginal:,.0f}")
    return t


@dataclass(frozen=True)
class Plan:
    """What a calibration runs: the settings it is valid for, and each node's run."""

    settings: FinetuneConfig
    per_rank: int  # examples per step: a rank's equal share of the run's global batch
    iters: int
    request: Request
    second_rows: int  # examples per step of the second run, for the plan's line through two steps
    second_request: Request


def plan(rec: Recorded, *, iters: int, batch_size: int | None, data: str | None, model: str | None,
         config: str | None, threads: int | None, extra: str) -> Plan:
    data_dir, model_dir = inputs.resolve(rec.cluster, data, model)
    config_file = Path(config).resolve() if config else None
    settings = run_settings.read(config_file, run_settings.split_extra(extra))
    global_batch = batch_size or settings.batch_size
    per_rank = max(1, math.ceil(global_batch / max(rec.cluster.world_size, 1)))
    second_rows = per_rank // 2 if per_rank > 1 else 2

    def request(rows: int) -> Request:
        overrides = ["--iters", str(iters), "--batch-size", str(rows), "--steps-per-report", "2",
                     "--steps-per-eval", str(iters), "--save-every", str(iters), "--val-batches", "1",
                     *shlex.split(extra)]
        return Request(data_dir, model_dir, config_file, overrides=overrides, threads=threads)

    return Plan(settings, per_rank, iters, request(per_rank), second_rows, request(second_rows))


def summary_of(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def measure(rec: Recorded, the_plan: Plan) -> dict[str, Any]:
    """Every training node alone, one after the other: the calibration entry (not yet kept)."""
    asked = the_plan.request  # each node alone, at the first run's batch (the larger)
    doctor.preflight(rec.cluster, room.largest(
        room.for_planned_run(rec.cluster.only(node), asked.model, asked.data, asked.overrides,
                             config=asked.config) for node in rec.cluster.training_nodes))
    nodes, run_dirs = {}, {}
    for node in rec.cluster.training_nodes:
        print(f"==> calibrate: {node.name} alone, {the_plan.per_rank} example"
              f"{'s' if the_plan.per_rank > 1 else ''} per step", flush=True)
        run_dir = train.launch_run(alone(node), the_plan.request, rec.inventory)
        run_dirs[node.name] = str(run_dir)
        first = summary_of(run_dir)
        nodes[node.name] = node_row(first)
        print(f"==> calibrate: {node.name} alone, {the_plan.second_rows} examples per step, for the plan's "
              "step times", flush=True)
        try:
            second = summary_of(train.launch_run(alone(node), the_plan.second_request, rec.inventory))
        except (UserError, OSError, ValueError) as error:  # the first run's figures still hold
            print(f"warning: {node.name}'s second calibration run failed, so its plan has no fixed "
                  f"part: {error}", flush=True)
            continue
        nodes[node.name] = with_pace(nodes[node.name], first, second, the_plan.second_rows)
    model = the_plan.request.model
    return {"date": results.date(), **batch_shares.calibration_key(model, the_plan.settings),
            "model": model.name, "examples_per_step": the_plan.per_rank, "iters": the_plan.iters,
            "grad_checkpoint": the_plan.settings.grad_checkpoint,  # the plan's step time scales by it
            "nodes": nodes, "runs": run_dirs}


def run(rec: Recorded, *, iters: int = 10, batch_size: int | None = None, data: str | None = None,
        model: str | None = None, config: str | None = None, threads: int | None = None,
        extra: str = "", output: str | None = None) -> Path:
    """invoke bench.calibrate: measure every node; keep the figures in calibration.json; the JSON
    written."""
    from rich.console import Console

    entry = measure(rec, plan(rec, iters=iters, batch_size=batch_size, data=data, model=model,
                              config=config, threads=threads, extra=extra))
    batch_shares.add_calibration(rec.calibration, entry)
    out = results.write("calibrate", {"benchmark": "calibrate", "inventory": rec.inventory, **entry}, output)
    Console(width=max(Console().width, 100)).print(table(entry))
    print(f"wrote {out}; invoke train takes batch_share: auto from {rec.calibration}")
    return out
