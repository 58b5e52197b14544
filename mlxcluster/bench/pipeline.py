"""The report of `invoke bench.pipeline`: data, tensor and pipeline parallelism on the same model and
batch, on 2, 3 and 4 nodes (and pipeline and data together), against one process.

Each configuration is one run of `invoke train` (its summary.json and run.json). For each: tokens/s,
each rank's peak memory, and the bytes the busiest cable (a pair of neighbouring ranks) carried per
step. A pipeline run's summary.json has each stage's counters (training/sharding/pipeline.py's
`PipelineStep.counters`): seconds blocked in recv, bytes sent to each rank, micro-batches, steps.
From them: each stage's idle fraction against its schedule's (`schedule_idle`: GPipe with the
step's recomputation; GPipe's own bubble is recorded beside it), and the bytes counted on each cable.
Tensor and data parallelism's bytes are derived (`tensor_all_sums`, `ring_cable_bytes`). Each aim
is recorded with its figure and whether it was met.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mlxcluster.bench import results, scaling
from mlxcluster.check import doctor, room
from mlxcluster.describe.cluster import Cluster, Recorded
from mlxcluster.errors import UserError
from mlxcluster.jobs import train
from mlxcluster.jobs.request import Request
from mlxcluster.launch import parallel as parallelism
from mlxcluster.launch import settings as run_settings
from mlxcluster.launch.stages import layer_count
from mlxcluster.provision import inputs, model_store

MODES = ("data", "tensor", "pipeline")
PIPELINE_DATA = "pipeline x data"
IDLE_AIM_POINTS = 0.05  # a stage's idle fraction within 5 points of its schedule's (schedule_idle)
PEAK_AIM_MARGIN = 0.10  # a stage's peak at most its layers' share of one process's peak plus 10 %
BYTES_AIM_RATIO = 0.10  # a pipeline's busiest cable at most a tenth of tensor's
COLORS = {"data": "tab:blue", "tensor": "tab:red", "pipeline": "tab:green", PIPELINE_DATA: "tab:olive"}


def configurations(counts: Sequence[int], stages: int | None) -> list[tuple[int, str, int | None]]:
    """The runs, in order: one process, each count in each mode, then pipeline and data together
    (`stages` stages, replicated) on each count they divide into more than one replica."""
    plan: list[tuple[int, str, int | None]] = [(1, "data", None)]
    plan += [(count, mode, None) for count in counts for mode in MODES]
    if stages:
        plan += [(count, PIPELINE_DATA, stages) for count in counts if count > stages and count % stages == 0]
    return plan


def bubble(stages: int, micro: int) -> float:
    """GPipe's idle fraction of a stage: (S - 1) / (M + S - 1), S stages, M micro-batches."""
    return (stages - 1) / (micro + stages - 1)


# A layer's backward costs about twice its forward (two matrix products per one: the inputs' and the
# weights' gradients), the usual estimate; the step's recomputation makes a non-last stage's work per
# micro-batch forward + (forward + backward) = 4 units a layer, the last stage's 3 (it runs its
# forward only once, under the gradient).
BACKWARD_PER_FORWARD = 2.0


def schedule_idle(layers: Sequence[int], micro: int) -> list[float]:
    """Each stage's idle fraction as training/sharding/pipeline.py's GPipe step with recomputation
    schedules it, from its layers' work alone: the forward wave through the stages before the last
    (F), then the backward wave (B, the recomputed forward in it), each (M - 1) times the slowest
    stage's after the first micro-batch crossed them all. With equal work per stage and no
    recomputation it is GPipe's (S - 1) / (M + S - 1); here the last stage, whose forward runs once,
    idles more than the others."""
    last = len(layers) - 1
    forward = [count * (0.0 if stage == last else 1.0) for stage, count in enumerate(layers)]
    backward = [count * (1.0 + BACKWARD_PER_FORWARD) for count in layers]
    total = sum(forward) + sum(backward) + (micro - 1) * (max(forward) + max(backward))
    return [1 - micro * (f + b) / total for f, b in zip(forward, backward, strict=True)]


def ring_cable_bytes(message: float, ranks: int) -> float:
    """The bytes each cable of a ring carries for one all_sum of `message` bytes over `ranks`:
    each rank sends 2 (N - 1) / N of it to its neighbour (reduce-scatter, then all-gather); N > 2
    ranks have N cables, one per rank, and 2 ranks one cable carrying both ranks' sends."""
    sent = 2 * (ranks - 1) / ranks * message
    return sent * (2 if ranks == 2 else 1)


def tensor_all_sums(layers: int, trained: int) -> int:
    """The all-sums of a whole activation (rows x seq x hidden) one LoRA training step makes in
    tensor parallelism (training/sharding/tensor_parallel.py, head_groups.py, vocab_parallel.py):
    forward, the vocabulary-split embedding's 1 and each layer's row-parallel o_proj and down_proj
    (2 a layer); backward, the head's input gradient (sum_gradients: 1) and each column-parallel
    layer's input gradient (q, k, v, gate, up: 5) in the layers above the lowest trained one, whose
    own attention inputs lead to no trained weight: only its MLP's 2 (MLX's backward of an
    all_sum is the identity). Left out, so that this is a lower bound: LoRA's rank-r all-sums
    and the split cross-entropy's per-token ones, r / hidden and 3 / hidden of these."""
    trained = min(layers, trained) if trained > 0 else layers
    return 1 + 2 * layers + 1 + 5 * (trained - 1) + 2


def safetensors_bytes(path: Path) -> int:
    """The bytes of a safetensors file's tensors, from its header (the run's trainable parameters)."""
    with path.open("rb") as file:
        (size,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(size))
    return sum(end - start for name, entry in header.items() if name != "__metadata__"
               for start, end in [entry["data_offsets"]])


def stage_figures(counters: Mapping[str, Any], peak: float, one_process_peak: float) -> dict[str, Any]:
    """A pipeline rank's figures from its counters: idle fraction against the bubble, and its peak
    against its layers' share of one process's."""
    steps = max(1, counters["steps"])
    start, stop = counters["layers"]
    micro = counters["micro_batches"] / steps
    share = (stop - start) / counters["total_layers"]
    idle = counters["recv_wait_seconds"] / counters["step_seconds"] if counters["step_seconds"] else 0.0
    expected = bubble(counters["stages"], round(micro))
    limit = one_process_peak * (share + PEAK_AIM_MARGIN)
    return {"layers": [start, stop], "micro_batches_per_step": micro, "idle_fraction": round(idle, 4),
            "bubble": round(expected, 4),
            "peak_gb": peak, "peak_share": round(share, 4), "peak_limit_gb": round(limit, 4),
            "peak_met": peak <= limit,
            "bytes_sent_per_step": {to: sent / steps for to, sent in counters["bytes_sent_to"].items()}}


def pipeline_cables(figures: Sequence[Mapping[str, Any]], stages: int) -> list[dict[str, Any]]:
    """The bytes each neighbouring pair of a replica's stages carried per step, both ways, counted
    (ranks r and r + 1 of one replica: r + 1 not a multiple of `stages`)."""
    cables = []
    for rank in range(len(figures) - 1):
        if (rank + 1) % stages == 0:
            continue
        forward = figures[rank]["bytes_sent_per_step"].get(str(rank + 1), 0.0)
        backward = figures[rank + 1]["bytes_sent_per_step"].get(str(rank), 0.0)
        cables.append({"ranks": [rank, rank + 1], "bytes_per_step": forward + backward})
    return cables


def row(nodes: int, mode: str, summary: Mapping[str, Any], stages: int | None = None) -> dict[str, Any]:
    """A configuration's measured figures, from its summary.json; the pipeline's counters kept."""
    return {"nodes": nodes, "mode": mode, "ranks": summary.get("world_size", nodes),
            "stages": stages or (nodes if mode == "pipeline" else None),
            "tokens_per_second": round(float(summary["tokens_per_second"]), 1),
            "peak_memory_gb_per_rank": [round(float(p), 4)
                                        for p in summary.get("peak_memory_gb_per_rank") or []],
            "counters": summary.get("pipeline_per_rank")}


def activation_bytes(rows: Sequence[Mapping[str, Any]], nodes: int) -> float | None:
    """One way's bytes of a step's activations (rows x seq x hidden x dtype), as the pipeline run
    on `nodes` counted them on a cable (half its bytes: forward and back): tensor parallelism's
    all-sums carry that shape, on the same batches."""
    for r in rows:
        if r["nodes"] == nodes and r["mode"] == "pipeline" and r.get("cables"):
            return max(c["bytes_per_step"] for c in r["cables"]) / 2
    return None


def _aim(what: str, figure: float, aim: float, met: bool) -> dict[str, Any]:
    return {"what": what, "figure": round(figure, 6), "aim": round(aim, 6), "met": bool(met)}


def _counted(r: dict[str, Any], one_peak: float) -> list[dict[str, Any]]:
    """A pipeline row's stages judged, its cables counted; its aims (peak and idle per rank)."""
    peaks = r["peak_memory_gb_per_rank"] or [0.0] * len(r["counters"])
    r["stage_figures"] = [stage_figures(c, p, one_peak) for c, p in zip(r["counters"], peaks, strict=True)]
    r["cables"] = pipeline_cables(r["stage_figures"], r["stages"])
    layers = [stop - start for start, stop in (f["layers"] for f in r["stage_figures"][:r["stages"]])]
    scheduled = schedule_idle(layers, round(r["stage_figures"][0]["micro_batches_per_step"]))
    aims = []
    for rank, f in enumerate(r["stage_figures"]):
        f["scheduled_idle"] = round(scheduled[rank % r["stages"]], 4)
        f["idle_met"] = abs(f["idle_fraction"] - f["scheduled_idle"]) <= IDLE_AIM_POINTS
        name = f"{r['nodes']} nodes, {r['mode']}, rank {rank}"
        aims.append(_aim(f"{name}: peak GB <= one process's x (layers' share + {PEAK_AIM_MARGIN:.0%})",
                         f["peak_gb"], f["peak_limit_gb"], f["peak_met"]))
        aims.append(_aim(f"{name}: |idle fraction - the schedule's| <= {IDLE_AIM_POINTS}",
                         abs(f["idle_fraction"] - f["scheduled_idle"]), IDLE_AIM_POINTS, f["idle_met"]))
    return aims


def _cable_bytes(r: dict[str, Any], rows: Sequence[Mapping[str, Any]], gradients: int, layers: int,
                 trained: int) -> tuple[float | None, str]:
    """The busiest cable's bytes per step, and how they were found."""
    ranks = r["ranks"]
    if r["mode"] == "data":
        return ring_cable_bytes(gradients, ranks), (
            f"derived: one ring all_sum of the trainable parameters' {gradients} bytes over {ranks} ranks")
    if r["mode"] == "tensor":
        activations = activation_bytes(rows, r["nodes"])
        if activations is None:
            return None, "not derived: no pipeline run on as many nodes counted the activations' bytes"
        sums = tensor_all_sums(layers, trained)
        return sums * ring_cable_bytes(activations, ranks), (
            f"derived: {sums} ring all_sums of a step's activations ({activations:.0f} bytes, as the "
            f"pipeline counted them) over {ranks} ranks")
    counted = max((c["bytes_per_step"] for c in r["cables"]), default=0.0)
    if r["mode"] == "pipeline":
        return counted, "counted: what _send sent, both ways"
    # The ring backend averages each stage's gradients over every rank in turn (the others adding zeros).
    return counted + ring_cable_bytes(gradients, ranks), (
        "counted (_send) plus derived: each stage's gradients in turn one ring all_sum over every rank")


def judged(rows: Sequence[Mapping[str, Any]], gradients: int, layers: int,
           trained: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows with their stages' figures and cable bytes, and every aim with whether it was met.
    rows[0]: one process; `gradients`: the trainable parameters' bytes; `layers`, `trained`: the
    model's layers and the last ones fine-tuned (num_layers, -1 for all)."""
    out = [dict(r) for r in rows]
    one_peak = max(out[0]["peak_memory_gb_per_rank"], default=0.0)
    aims = []
    for r in out[1:]:
        if r.get("counters"):
            aims += _counted(r, one_peak)
    for r in out[1:]:
        r["cable_bytes_per_step"], r["cable_bytes_how"] = _cable_bytes(r, out, gradients, layers, trained)
    for r in out:
        if r["mode"] != "pipeline":
            continue
        tensor = next((t for t in out if t["mode"] == "tensor" and t["nodes"] == r["nodes"]), None)
        if tensor and tensor["cable_bytes_per_step"]:
            limit = BYTES_AIM_RATIO * tensor["cable_bytes_per_step"]
            aims.append(_aim(f"{r['nodes']} nodes: pipeline's busiest cable bytes per step <= "
                             f"{BYTES_AIM_RATIO} x tensor's", r["cable_bytes_per_step"], limit,
                             r["cable_bytes_per_step"] <= limit))
    return out, aims


def _label(r: Mapping[str, Any]) -> str:
    return "1 process" if r["nodes"] == 1 else f"{r['nodes']} nodes, {r['mode']}"


def plot(rows: Sequence[Mapping[str, Any]], output: Path, title: str) -> Path:
    """Tokens/s and the largest rank's peak per mode and node count, and each pipeline rank's idle
    fraction beside its schedule's."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(15, 4.6), layout="constrained")
    speed, memory, idle = figure.subplots(1, 3)
    one = rows[0]
    for mode in (*MODES, PIPELINE_DATA):
        line = [r for r in rows[1:] if r["mode"] == mode]
        if line:
            xs = [r["nodes"] for r in line]
            speed.plot(xs, [r["tokens_per_second"] for r in line], marker="o", color=COLORS[mode], label=mode)
            memory.plot(xs, [max(r["peak_memory_gb_per_rank"], default=0) for r in line], marker="o",
                        color=COLORS[mode], label=mode)
    speed.axhline(one["tokens_per_second"], linestyle="--", color="grey", label="1 process")
    memory.axhline(max(one["peak_memory_gb_per_rank"], default=0), linestyle="--", color="grey",
                   label="1 process")
    for axes, label in ((speed, "tokens/s"), (memory, "largest rank's peak GB")):
        axes.set_xlabel("nodes")
        axes.set_xticks(sorted({r["nodes"] for r in rows[1:]}))
        axes.set_ylabel(label)
        axes.grid(alpha=0.3)
        axes.legend()
    names, measured, expected = [], [], []
    for r in rows:
        for rank, f in enumerate(r.get("stage_figures") or []):
            names.append(f"{_label(r)}\nrank {rank}")
            measured.append(f["idle_fraction"])
            expected.append(f["scheduled_idle"])
    xs = range(len(names))
    idle.bar([x - 0.2 for x in xs], measured, width=0.4, label="idle in recv", color="tab:green")
    idle.bar([x + 0.2 for x in xs], expected, width=0.4, label="the schedule's (schedule_idle)",
             color="tab:grey")
    idle.set_xticks(list(xs), names, fontsize=6, rotation=60)
    idle.set_ylabel("fraction of the step")
    idle.set_title("pipeline ranks: idle against the schedule's")
    idle.legend()
    figure.suptitle(title)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=120, format="png")
    return output


def table(rows: Sequence[Mapping[str, Any]], title: str) -> Any:
    from rich.table import Table

    t = Table(title=title, caption="cable: the busiest neighbouring pair's bytes per step (see the JSON "
              "for how each was found); idle, scheduled idle and GPipe's bubble: each pipeline rank's")
    for name in ("run", "tokens/s", "peak GB per rank", "cable MB/step", "idle", "scheduled", "bubble"):
        t.add_column(name, justify="left" if name == "run" else "right")
    for r in rows:
        figures = r.get("stage_figures") or []
        cable = r.get("cable_bytes_per_step")
        t.add_row(_label(r), f"{r['tokens_per_second']:,.1f}",
                  ", ".join(f"{p:.2f}" for p in r["peak_memory_gb_per_rank"]),
                  "-" if cable is None else f"{cable / 1e6:.2f}",
                  ", ".join(f"{f['idle_fraction']:.2f}" for f in figures) or "-",
                  ", ".join(f"{f['scheduled_idle']:.2f}" for f in figures) or "-",
                  ", ".join(f"{f['bubble']:.2f}" for f in figures) or "-")
    return t


def node_counts(text: str | None, available: int) -> list[int]:
    """--nodes as sorted counts of at least 2 (each mode splits something), up to the training nodes."""
    try:
        counts = sorted({int(n) for n in str(text).split(",")}) if text else [2, 3, 4]
    except ValueError:
        raise UserError(f"--nodes {text}: node counts separated by commas, e.g. 2,3,4") from None
    counts = [count for count in counts if text or count <= available]
    if not counts or counts[0] < 2 or counts[-1] > available:
        raise UserError(f"--nodes {text}: counts from 2 up to the {available} training nodes of the "
                        "inventory")
    return counts


def _base_mode(mode: str) -> str:
    return "pipeline" if mode == PIPELINE_DATA else mode


def _measured(rec: Recorded, plan: Sequence[tuple[int, str, int | None]], layouts: Mapping[int, Cluster],
              request: Request) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Each configuration launched exactly as invoke train launches: its row and its run folder."""
    rows, run_dirs = [], {}
    for count, mode, stages in plan:
        print(f"==> pipeline bench: {count} node{'s' if count > 1 else ''}, {mode}", flush=True)
        flags = [*parallelism.flags(_base_mode(mode)),
                 *(["--pipeline-stages", str(stages)] if stages else [])]
        moded = dataclasses.replace(request, overrides=[*request.overrides, *flags])
        run_dir = train.launch_run(layouts[count], moded, rec.inventory)
        run_dirs["1" if count == 1 else f"{count}-{mode.replace(' ', '')}"] = str(run_dir)
        rows.append(row(count, mode, json.loads((run_dir / "summary.json").read_text()), stages))
    return rows, run_dirs


def run(rec: Recorded, *, nodes: str | None = None, pipeline_stages: int | None = None, iters: int = 20,
        batch_size: int | None = None, data: str | None = None, model: str | None = None,
        threads: int | None = None, extra: str = "", output: str | None = None) -> Path:
    """invoke bench.pipeline: one process, then each count in data, tensor and pipeline (and pipeline
    and data together), each launched as invoke train launches; the JSON with every aim, the PNG."""
    from rich.console import Console

    counts = node_counts(nodes, len(rec.cluster.training_nodes))
    plan = configurations(counts, pipeline_stages)
    layouts = {count: rec.cluster.first_nodes(count) for count in {1, *counts}}
    if not batch_size:
        step = math.lcm(*(layout.world_size for layout in layouts.values()))
        batch_size = step * -(-4 // step)
    data_dir, model_dir = inputs.resolve(rec.cluster, data, model)
    overrides = ["--iters", str(iters), "--batch-size", str(batch_size), "--steps-per-report", "5",
                 "--steps-per-eval", str(iters), "--save-every", str(iters), *shlex.split(extra)]
    request = Request(data_dir, model_dir, overrides=overrides, threads=threads)
    for count, mode, stages in plan[1:]:
        parallelism.check(layouts[count], model_dir, _base_mode(mode), stages=stages)
    needs = (room.for_planned_run(layouts[count], model_dir, data_dir, overrides, parallel=_base_mode(mode))
             for count, mode, _ in plan)
    doctor.preflight(rec.cluster, room.largest(needs))
    measured, run_dirs = _measured(rec, plan, layouts, request)
    layers = layer_count(model_store.shape_of(str(model_dir)) or {}) or 0
    gradients = safetensors_bytes(Path(run_dirs["1"]) / "adapters.safetensors")
    rows, aims = judged(measured, gradients, layers, run_settings.read(None, overrides).num_layers)
    weights = scaling.quantization(model_dir)
    title = f"{model_dir.name} ({weights or 'weights unknown'}): {iters} steps, global batch {batch_size}"
    out = results.write("pipeline", {
        "benchmark": "pipeline", "date": results.date(), "inventory": rec.inventory, "model": str(model_dir),
        "quantization": weights, "data": str(data_dir), "iters": int(iters),
        "global_batch_size": int(batch_size),
        "model_layers": layers, "trainable_bytes": gradients, "host_cpus": os.cpu_count(),
        "aims": aims, "all_aims_met": all(a["met"] for a in aims), "rows": rows, "runs": run_dirs}, output)
    png = plot(rows, out.with_suffix(".png"), title)
    Console(width=max(Console().width, 140)).print(table(rows, title))
    for a in aims:
        print(f"{'met' if a['met'] else 'NOT MET'}: {a['what']}: {a['figure']:.4g} (aim {a['aim']:.4g})")
    print(f"wrote {out} and {png}")
    return out
