"""`invoke plan`: before a run, for the run as configured, each layout the cluster allows with each
node's memory at its peak against what the node can give, the layout it would pick and why, the
largest batch and the longest sequence each layout fits, and the picked layout's peak per rank,
term by term. `invoke train --parallel auto` follows the same plan (`for_request`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mlxcluster.check import doctor
from mlxcluster.describe.cluster import Cluster, Recorded
from mlxcluster.errors import UserError
from mlxcluster.jobs.request import Options, Request, request_for
from mlxcluster.launch import batch_shares, parallel
from mlxcluster.plan import layouts, speed
from mlxcluster.plan.job import compiled_on, job_for
from mlxcluster.plan.layouts import Fit
from mlxcluster.plan.ranks import Job
from training.parallel_rules import pipeline_micro_batches


@dataclass(frozen=True)
class Plan:
    """Every layout planned, the pick and why, and each layout's largest batch and sequence."""

    job: Job
    fits: tuple[Fit, ...]
    refused: tuple[tuple[str, str], ...]  # (layout, why the cluster cannot run it)
    picked: Fit | None
    why: str
    limits: Mapping[str, tuple[int | None, int | None]]  # layout name -> (batch, sequence)
    speeds_from: str | None = None  # where the step times come from (None: no calibration)


def _shares(cluster: Cluster, request: Request) -> list[float] | None:
    """Each rank's weight in a data-parallel batch, as invoke train would split it (None: equal)."""
    if not batch_shares.inventory_sets_shares(cluster):
        return None
    try:
        return batch_shares.weights(cluster, request.calibration)[0]
    except UserError:  # batch_share auto without a calibration: train says so; the plan splits equally
        return None


def for_request(cluster: Cluster, request: Request, free: Mapping[str, int | None],
                measures: speed.Measures | None = None, *, dry_run: bool = False) -> Plan:
    """The plan of this request on this cluster, whose nodes can give `free` bytes each; each
    layout's step time from `measures` (the calibration and bench.links), where there are some.
    A dry run plans data it has not made yet (or cannot read) as examples of max_seq_length."""
    settings = request.settings
    model = request.model
    if not model.exists() and request.model_source and Path(request.model_source).is_dir():
        model = Path(request.model_source)  # a dry run fetches nothing: its source folder, as it is
    data = request.data
    if "data" in request.pending or (dry_run and not (data / "train.jsonl").is_file()):
        data = None  # a dry run's demo data, not made yet
    job = job_for(settings, model, data, compiled=compiled_on(cluster))
    if job is None:
        raise UserError(f"{request.model} has no safetensors and config.json on this machine to plan "
                        "from: fetch it first (invoke model.fetch), or give --model a local folder")
    tensor = parallel.problems(cluster, request.model, "tensor")
    micro = pipeline_micro_batches(settings, cluster.world_size) if settings.pipeline_micro_batches else 0
    fits, refused = [], []
    for layout in layouts.candidates(cluster, job, free, tensor_problem=tensor[0] if tensor else None,
                                     shares=_shares(cluster, request), micro_batches=micro):
        if isinstance(layout, tuple):
            refused.append(layout)
        else:
            found = layouts.fit(cluster, job, layout, free)
            step = speed.step_seconds(job, layout, cluster, found.peaks, measures) if measures else None
            fits.append(dataclasses.replace(found, step_s=step))
    picked, why = layouts.pick(fits)
    longest = max(settings.max_seq_length, job.shape.positions or 0)
    limits = {f.layout.name: layouts.limits(cluster, job, f.layout, free, longest) for f in fits}
    return Plan(job, tuple(fits), tuple(refused), picked, why, limits, measures.source if measures else None)


def measures_of(rec: Recorded, request: Request) -> speed.Measures | None:
    """The cluster's measures for this request's model and sequence length (None: no calibration)."""
    calibration = batch_shares.latest_calibration(
        rec.calibration, batch_shares.calibration_key(request.model, request.settings))
    return speed.measured(rec.cluster, calibration, inventory=rec.inventory)


def free_memory(cluster: Cluster) -> dict[str, int | None]:
    """What each training node can give a run now, as the memory preflight counts it."""
    gathered = doctor.gather(cluster)
    free = doctor.memory_of(gathered)
    return {node.name: free.get(node.name) for node in cluster.training_nodes}


def as_json(plan: Plan) -> dict[str, Any]:
    """The plan for --json: every layout, each rank's terms in bytes, the pick."""
    return {
        "length": plan.job.length, "batch_size": plan.job.batch_size,
        "picked": plan.picked.layout.name if plan.picked else None, "why": plan.why,
        "step_times_from": plan.speeds_from,
        "layouts": [{"name": f.layout.name, "parallel": f.layout.parallel, "stages": list(f.layout.stages),
                     "fits": f.fits, "need": dict(f.need), "free": dict(f.free), "step_s": f.step_s,
                     "largest_batch": plan.limits[f.layout.name][0],
                     "longest_sequence": plan.limits[f.layout.name][1],
                     "ranks": [{"rank": r, **asdict(t), "total": t.total} for r, t in enumerate(f.peaks)]}
                    for f in plan.fits],
        "refused": [{"name": name, "why": why} for name, why in plan.refused]}


def render(plan: Plan, cluster: Cluster) -> None:
    """The plan as tables: the layouts, then the pick's ranks term by term."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    nodes = [n.name for n in cluster.training_nodes]
    table = Table(title=f"layouts: batch {plan.job.batch_size} of {plan.job.length} tokens per row "
                        "(GB at the peak / free)", title_justify="left")
    for column in ("layout", *nodes, "fits", "step (s)", "largest batch", "longest sequence"):
        table.add_column(column)
    for f in plan.fits:
        batch, length = plan.limits[f.layout.name]
        room = (f"{layouts.gb(f.need[n])} / {layouts.gb(f.free.get(n))}" for n in nodes)
        table.add_row(f.layout.name, *room,
                      "yes" if f.fits else "no", "?" if f.step_s is None else f"{f.step_s:.2f}",
                      str(batch or "-"), str(length or "-"))
    for name, why in plan.refused:
        table.add_row(name, *(["-"] * len(nodes)), f"no: {why}", "-", "-", "-")
    console.print(table)
    if plan.picked:
        terms = Table(title=f"{plan.picked.layout.name}: each rank's peak, term by term (GB)",
                      title_justify="left")
        terms.add_column("term")
        for rank, node in enumerate(cluster.rank_nodes()):
            terms.add_column(f"rank {rank}\n{node}", justify="right")
        for index, (name, _) in enumerate(plan.picked.peaks[0].named()):
            terms.add_row(name, *(layouts.gb(t.named()[index][1]) for t in plan.picked.peaks))
        terms.add_row("total", *(layouts.gb(t.total) for t in plan.picked.peaks))
        console.print(terms)
    console.print(f"step times: {plan.speeds_from}" if plan.speeds_from else
                  "step times: ? (no calibration of this model and max_seq_length: invoke bench.calibrate)")
    console.print(f"pick: {plan.picked.layout.name if plan.picked else 'none'} ({plan.why})")


def run(rec: Recorded, options: Options, *, as_json_output: bool = False) -> Plan:
    """invoke plan: the request as invoke train would read it, planned on the nodes' free memory."""
    # With --json, stdout is the plan alone: what fetching the model or preparing the data says goes
    # to stderr.
    with contextlib.redirect_stdout(sys.stderr) if as_json_output else contextlib.nullcontext():
        request = request_for(rec, options, fetch=True)
        plan = for_request(rec.cluster, request, free_memory(rec.cluster), measures_of(rec, request))
    if as_json_output:
        print(json.dumps(as_json(plan), indent=2))
    else:
        render(plan, rec.cluster)
    return plan


AUTO = "auto"  # invoke train --parallel auto: the layout this plan picks


def refusal(plan: Plan) -> str:
    """Why no layout fits, and the nearest runs that would: the largest batch, or the longest
    sequence, a layout fits."""
    short = "; ".join(f"{f.layout.name}: {', '.join(f.short())}" for f in plan.fits if f.short())
    batch = max(((b, name) for name, (b, _) in plan.limits.items() if b), default=None)
    length = max(((s, name) for name, (_, s) in plan.limits.items() if s), default=None)
    would = []
    if batch:
        would.append(f"--batch-size {batch[0]} with {batch[1]}")
    if length and length[0] < plan.job.length:
        would.append(f"max_seq_length {length[0]} with {length[1]}")
    fix = (f"; what would fit: {' or '.join(would)}" if would else
           "; not even one example fits: add nodes, or train a smaller or quantized model")
    asked = f"{plan.job.batch_size} x {plan.job.length} tokens"
    return f"no layout fits this run's batch of {asked} ({short}){fix}"


def resolved(cluster: Cluster, rec: Recorded, options: Options, *, probe: bool = True) -> Options:
    """invoke train's options with --parallel auto replaced by the layout the plan picks (and a
    pipeline's stage count among the flags), said in a line; a UserError before anything is
    synced when no layout fits. `probe`: ask the nodes' free memory (a dry run does
    not: every layout then fits, and the pick is data)."""
    if options.parallel != AUTO:
        return options
    request = request_for(rec, dataclasses.replace(options, parallel=None), fetch=probe)
    free = free_memory(cluster) if probe else {n.name: None for n in cluster.training_nodes}
    plan = for_request(cluster, request, free, dry_run=not probe)
    if plan.picked is None:
        raise UserError(refusal(plan))
    layout = plan.picked.layout
    extra = options.extra
    if layout.parallel == "pipeline" and len(layout.shares) > 1:  # pipeline x data
        extra = f"{extra} --pipeline-stages {len(layout.stages)}".strip()
    print(f"==> parallel auto: {layout.name} ({plan.why})", flush=True)
    return dataclasses.replace(options, parallel=layout.parallel, extra=extra)
