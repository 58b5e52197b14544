"""`invoke bench.plan`: how good the plan is, on a grid of runs (nodes x parallelism x float and
4-bit weights x batch size x sequence length x grad checkpointing).

Each cell is one run of `invoke train` on the first nodes of the cluster. Every run's summary.json
keeps, per rank, the peak and the step time the plan gave it beside the measured ones (`ranks`:
mlxcluster/plan/of_run.py), so a cell's errors come from the run itself, as they would for a user.
The step time is planned from the cluster's calibration (`invoke bench.calibrate`, which this bench
runs first for each model and sequence length, with the grid's first grad-checkpoint setting) and
the newest `invoke bench.links` of the inventory (not run here: without it, no transfer time).

Aims (the issue's): a rank's planned peak never under its measured peak by more than 5 % nor over
it by more than 15 %; a step's planned time within 25 % of the measured one. A cell that fails
(refused, or out of memory) is kept with its error, and the grid goes on.

On the lab, whose nodes share this machine's cores, the machine's own speed wanders: the same
one-node calibration run measured 28.9 and 39.0 tokens/s 12 minutes apart, and a 2-second matrix
product 2.0 to 4.1 GFLOP/s with nothing else running. So there, before each cell, the first node
runs its calibration's first run again (the control), and the cell's step is judged against the plan
scaled by how fast the control ran against the calibration (`step_error_controlled`); the raw error
is kept beside it. A Mac cluster has no such neighbour, and no control is run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcluster.bench import calibrate, results, scaling
from mlxcluster.describe.cluster import Recorded
from mlxcluster.errors import UserError
from mlxcluster.jobs import train
from mlxcluster.jobs.request import Request
from mlxcluster.lab.hosts import LAB_ROOT
from mlxcluster.launch import batch_shares
from mlxcluster.launch import parallel as parallelism
from mlxcluster.local import python_module
from mlxcluster.paths import MODELS
from mlxcluster.provision import inputs

PARALLELS = ("data", "tensor", "pipeline")
WEIGHTS = ("float", "4bit")
CHECKPOINTING = ("off", "on")
MEMORY_AIM = (-0.05, 0.15)  # planned over measured peak, less one
STEP_AIM = 0.25  # |planned over measured step time, less one|
COUNTS, BATCHES, LENGTHS = (1, 2, 3), (2, 4), (128, 256)  # the grid's defaults
BITS, GROUP = 4, 64  # the 4-bit copy: mlx_lm convert -q's defaults


@dataclass(frozen=True)
class Cell:
    """One run of the grid."""

    nodes: int
    parallel: str
    weights: str  # float or 4bit
    batch_size: int
    length: int  # max_seq_length
    grad_checkpoint: bool

    @property
    def name(self) -> str:
        return (f"{self.nodes} node{'s' if self.nodes > 1 else ''} {self.parallel}, {self.weights}, "
                f"batch {self.batch_size}, {self.length} tokens{', gc' if self.grad_checkpoint else ''}")

    def flags(self) -> list[str]:
        return ["--batch-size", str(self.batch_size), "--max-seq-length", str(self.length),
                *(["--grad-checkpoint"] if self.grad_checkpoint else []),
                *parallelism.flags(self.parallel)]


def grid(counts: Sequence[int], parallels: Sequence[str], weights: Sequence[str], batches: Sequence[int],
         lengths: Sequence[int], checkpointing: Sequence[str]) -> list[Cell]:
    """The cells, grouped by weights and length (one calibration each): on 1 node data parallel only
    (the others split nothing), on more each parallelism asked for; data parallelism only where the
    batch gives every rank an example (`invoke train` refuses the others)."""
    cells = []
    for kind in weights:
        for length in lengths:
            for batch in batches:
                for gc in checkpointing:
                    for count in counts:
                        for parallel in ("data",) if count == 1 else parallels:
                            if parallel != "data" or batch >= count:
                                cells.append(Cell(count, parallel, kind, batch, length, gc == "on"))
    return cells


def quantized_copy(model: Path, output: Path | None = None) -> Path:
    """A 4-bit copy of a float model on the controller, as `mlx_lm convert -q` writes one and
    `invoke model.fetch` keeps it (with its manifest), made once: its folder."""
    out = output or MODELS / f"{model.name}-{BITS}bit-g{GROUP}"
    if (out / "config.json").is_file():
        return out
    staging = out.with_name(out.name + ".convert")
    shutil.rmtree(staging, ignore_errors=True)
    python_module("mlx_lm", ["convert", "--hf-path", str(model), "--mlx-path", str(staging), "-q",
                             "--q-bits", str(BITS), "--q-group-size", str(GROUP)])
    try:
        inputs.fetch_model(str(staging), out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def errors(rank: Mapping[str, Any]) -> dict[str, float | None]:
    """A rank's planned over measured, less one: its peak's and its step's (None: not planned or
    not measured)."""
    def ratio(planned: float | None, measured: float | None) -> float | None:
        return round(planned / measured - 1, 4) if planned and measured else None

    return {"memory_error": ratio(rank.get("planned_peak_bytes"), rank.get("peak_bytes")),
            "step_error": ratio(rank.get("planned_step_s"), rank.get("step_s"))}


def controlled(rank: Mapping[str, Any], control: float) -> float | None:
    """A rank's step error against the plan scaled to the machine's speed at the time: the control
    ran at `control` times its calibrated speed, so the plan's step takes 1/control as long."""
    planned, measured = rank.get("planned_step_s"), rank.get("step_s")
    return round(planned / control / measured - 1, 4) if planned and measured and control > 0 else None


def judged(cell: Cell, ranks: Sequence[Mapping[str, Any]], cores: int | None = None,
           control: float | None = None) -> dict[str, Any]:
    """A cell's row: each rank's figures and errors, and whether they meet the aims (a figure not
    planned, e.g. a step time without a calibration, is not judged). `cores`: the host's, where
    every node is a lab node on it: a cell with more ranks than cores has its step not judged, its
    ranks waiting for each other's core (each Mac has its own). `control`: how fast the machine
    ran just before, against the calibration (the step is then judged on `step_error_controlled`)."""
    low, high = MEMORY_AIM
    rows = [{**rank, **errors(rank)} for rank in ranks]
    if control is not None:
        rows = [{**r, "step_error_controlled": controlled(r, control)} for r in rows]
    memory = [r["memory_error"] for r in rows if r["memory_error"] is not None]
    judged_error = "step_error_controlled" if control is not None else "step_error"
    step = next((r[judged_error] for r in rows if r[judged_error] is not None), None)
    shared = cores is not None and len(rows) > cores
    return {**dataclasses.asdict(cell), "cell": cell.name, "ranks": rows,
            **({"control": round(control, 4)} if control is not None else {}),
            "memory_met": bool(memory) and all(low <= e <= high for e in memory),
            "step_met": None if step is None or shared else abs(step) <= STEP_AIM,
            **({"step_not_judged": f"{len(rows)} ranks on the lab host's {cores} cores"} if shared else {})}


def summary(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What the grid says in a few figures: cells run and failed, the worst errors, aims met."""
    ran = [r for r in rows if "error" not in r]
    memory = [e for r in ran for e in (x["memory_error"] for x in r["ranks"]) if e is not None]
    def span(key: str) -> dict[str, float | None]:
        found = [r["ranks"][0][key] for r in ran if r["ranks"] and r["ranks"][0].get(key) is not None]
        return {"min": min(found, default=None), "max": max(found, default=None)}

    return {"cells": len(rows), "failed": len(rows) - len(ran),
            "memory_errors": {"min": min(memory, default=None), "max": max(memory, default=None)},
            "step_errors": span("step_error"), "step_errors_controlled": span("step_error_controlled"),
            "memory_met": sum(bool(r["memory_met"]) for r in ran),
            "step_met": sum(bool(r["step_met"]) for r in ran),
            "step_judged": sum(r["step_met"] is not None for r in ran),
            "all_aims_met": bool(ran) and len(ran) == len(rows) and all(
                r["memory_met"] and r["step_met"] is not False for r in ran)}


def table(rows: Sequence[Mapping[str, Any]], title: str) -> Any:
    from rich.table import Table

    low, high = MEMORY_AIM
    t = Table(title=title, caption=f"error: planned / measured - 1; aims: memory {low:+.0%} to {high:+.0%}, "
              f"step within {STEP_AIM:.0%}")
    for name in ("cell", "peak GB per rank (planned / measured)", "memory error",
                 "step s (planned / measured)", "step error"):
        t.add_column(name, justify="left" if name == "cell" else "right")
    for row in rows:
        if "error" in row:
            t.add_row(row["cell"], f"[red]failed: {row['error'][:70]}", "", "", "")
            continue
        ranks = row["ranks"]
        peaks = ", ".join(f"{_gb(r['planned_peak_bytes'])}/{_gb(r['peak_bytes'])}" for r in ranks)
        memory = ", ".join("-" if r["memory_error"] is None else f"{r['memory_error']:+.1%}" for r in ranks)
        first = ranks[0] if ranks else {}
        step = f"{first.get('planned_step_s') or '-'} / {first.get('step_s') or '-'}"
        step_error = "-" if first.get("step_error") is None else f"{first['step_error']:+.1%}"
        if first.get("step_error_controlled") is not None:
            step_error += f", {first['step_error_controlled']:+.1%} at the control's {row['control']:.2f}x"
        step_error += " (cores shared)" if row.get("step_not_judged") else ""
        t.add_row(row["cell"], peaks, _marked(memory, row["memory_met"]), step,
                  _marked(step_error, row["step_met"]))
    return t


def _gb(size: float | None) -> str:
    return "-" if size is None else f"{size / 1e9:.2f}"


def _marked(text: str, met: bool | None) -> str:
    return text if met is not False else f"[red]{text}"


def plot(rows: Sequence[Mapping[str, Any]], output: Path, title: str) -> Path:
    """Planned against measured: every rank's peak, and every cell's step, with the aims' bands."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 5.2), layout="constrained")
    memory, step = figure.subplots(1, 2)
    colors = {"data": "tab:blue", "tensor": "tab:red", "pipeline": "tab:green"}
    for parallel, color in colors.items():
        ran = [r for r in rows if r["parallel"] == parallel and "error" not in r]
        peaks = [(x["peak_bytes"] / 1e9, x["planned_peak_bytes"] / 1e9) for r in ran for x in r["ranks"]
                 if x.get("peak_bytes") and x.get("planned_peak_bytes")]
        # A step planned at the control's speed where there was one (the judged figure).
        steps = [(r["ranks"][0]["step_s"], r["ranks"][0]["planned_step_s"] / r.get("control", 1.0))
                 for r in ran
                 if r["ranks"] and r["ranks"][0].get("step_s") and r["ranks"][0].get("planned_step_s")]
        for axes, points in ((memory, peaks), (step, steps)):
            if points:
                axes.scatter(*zip(*points, strict=True), color=color, label=parallel, s=18)
    for axes, (low, high), unit in ((memory, MEMORY_AIM, "peak GB"), (step, (-STEP_AIM, STEP_AIM), "step s")):
        top = max(axes.get_xlim()[1], axes.get_ylim()[1])
        line = [0, top]
        axes.plot(line, line, color="grey", linewidth=0.8)
        axes.fill_between(line, [x * (1 + low) for x in line], [x * (1 + high) for x in line],
                          color="grey", alpha=0.15, label="aim")
        axes.set_xlabel(f"measured {unit}")
        axes.set_ylabel(f"planned {unit}")
        axes.grid(alpha=0.3)
        axes.legend()
    memory.set_title("each rank's peak")
    step.set_title("each run's step")
    figure.suptitle(title)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=120, format="png")
    return output


def _groups(cells: Sequence[Cell]) -> Iterator[tuple[tuple[str, int], list[Cell]]]:
    """The cells by weights and length, in order: each group shares a calibration."""
    keys = list(dict.fromkeys((c.weights, c.length) for c in cells))
    for key in keys:
        yield key, [c for c in cells if (c.weights, c.length) == key]


@dataclass(frozen=True)
class Calibrated:
    """A group's calibration: what it ran, and the first node's tokens/s in its first run."""

    plan: calibrate.Plan
    speed: float

    def control(self, rec: Recorded) -> float:
        """The first node's calibration run again, now: its tokens/s over the calibration's."""
        node = rec.cluster.training_nodes[0]
        print(f"==> plan bench: the control, {node.name} alone as its calibration ran", flush=True)
        run_dir = train.launch_run(calibrate.alone(node), self.plan.request, rec.inventory)
        return float(calibrate.summary_of(run_dir)["tokens_per_second"]) / self.speed


def calibration_rows(group: Sequence[Cell]) -> int:
    """The most examples a rank of these cells runs at once: a whole batch (one node, or tensor
    parallelism; a data or pipeline rank runs its share or micro-batch, fewer)."""
    return max(cell.batch_size for cell in group)


def _calibrate(rec: Recorded, count: int, model: Path, data: Path, group: Sequence[Cell], iters: int,
               threads: int | None, extra: str) -> Calibrated:
    """Each of the first `count` nodes alone at the group's model and length (bench.calibrate), at
    the most rows any rank of the group runs (a 1-node or tensor cell's whole batch), then half as
    many: the cells' steps are planned between the two points, not beyond them."""
    cell = group[0]
    sub = dataclasses.replace(rec, cluster=rec.cluster.first_nodes(count))
    flags = f"--max-seq-length {cell.length}{' --grad-checkpoint' if cell.grad_checkpoint else ''} {extra}"
    the_plan = calibrate.plan(sub, iters=iters, batch_size=calibration_rows(group) * count, data=str(data),
                              model=str(model), config=None, threads=threads, extra=flags.strip())
    entry = calibrate.measure(sub, the_plan)
    batch_shares.add_calibration(rec.calibration, entry)
    first = rec.cluster.training_nodes[0].name
    return Calibrated(the_plan, float(entry["nodes"][first]["tokens_per_second"]))


def _cell(rec: Recorded, cell: Cell, request: Request, cores: int | None,
          calibrated: Calibrated | None) -> dict[str, Any]:
    """One cell run as invoke train runs it, after its control where there is one: its row (or its
    error)."""
    moded = dataclasses.replace(request, overrides=[*request.overrides, *cell.flags()])
    try:
        control = calibrated.control(rec) if calibrated else None
        print(f"==> plan bench: {cell.name}", flush=True)
        run_dir = train.launch_run(rec.cluster.first_nodes(cell.nodes), moded, rec.inventory)
    except (UserError, subprocess.CalledProcessError) as error:
        message = str(error).strip()
        return {**dataclasses.asdict(cell), "cell": cell.name,
                "error": message.splitlines()[-1] if message else type(error).__name__}
    found = calibrate.summary_of(run_dir)
    return {**judged(cell, found.get("ranks") or [], cores, control), "run": str(run_dir)}


def run(rec: Recorded, *, nodes: Sequence[int] = COUNTS, parallel: Sequence[str] = PARALLELS,
        weights: Sequence[str] = WEIGHTS, batch_sizes: Sequence[int] = BATCHES,
        lengths: Sequence[int] = LENGTHS, grad_checkpoint: Sequence[str] = CHECKPOINTING, iters: int = 8,
        data: str | None = None, model: str | None = None, threads: int | None = None, extra: str = "",
        output: str | None = None) -> Path:
    """invoke bench.plan: calibrate, run every cell, judge each against the aims; JSON and PNG."""
    from rich.console import Console

    available = len(rec.cluster.training_nodes)
    if max(nodes) > available:
        raise UserError(f"--nodes {','.join(map(str, nodes))}: at most the {available} training nodes "
                        "of the inventory")
    data_dir, float_model = inputs.resolve(rec.cluster, data, model)
    if scaling.quantization(float_model) not in (None, "float") and "float" in weights:
        raise UserError(f"{float_model} is quantized already: give a float model, or --weights 4bit")
    models = {kind: float_model if kind == "float" else quantized_copy(float_model) for kind in weights}
    overrides = ["--iters", str(iters), "--steps-per-report", "2", "--steps-per-eval", str(iters),
                 "--save-every", str(iters), "--val-batches", "1", *shlex.split(extra)]
    cells = grid(nodes, parallel, weights, batch_sizes, lengths, grad_checkpoint)
    # Lab nodes are namespaces of this machine, sharing its cores.
    cores = os.cpu_count() if Path(rec.inventory).resolve().is_relative_to(LAB_ROOT) else None
    rows = []
    for (kind, _length), group in _groups(cells):
        calibrated = _calibrate(rec, max(nodes), models[kind], data_dir, group, iters, threads, extra)
        request = Request(data_dir, models[kind], overrides=overrides, threads=threads)
        # The control only where the machine's speed is shared (lab nodes on this machine).
        rows += [_cell(rec, cell, request, cores, calibrated if cores else None) for cell in group]
    overall = summary(rows)
    title = f"{float_model.name}: planned against measured, {len(rows)} runs of {iters} steps"
    out = results.write("plan", {
        "benchmark": "plan", "date": results.date(), "inventory": rec.inventory,
        "models": {kind: str(path) for kind, path in models.items()}, "data": str(data_dir),
        "iters": iters, "host_cpus": os.cpu_count(), "lab_host_cores": cores,
        "aims": {"memory_error": list(MEMORY_AIM), "step_error": STEP_AIM},
        "summary": overall, "rows": rows}, output)
    png = plot(rows, out.with_suffix(".png"), title)
    Console(width=max(Console().width, 150)).print(table(rows, title))
    print(json.dumps(overall))
    print(f"wrote {out} and {png}")
    return out
