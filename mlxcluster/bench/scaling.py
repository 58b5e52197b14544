"""The scaling report of `invoke bench.scaling`: the same fine-tune on 1 node and on more.

Each configuration is one run of `invoke train` (its summary.json and run.json): the 1-node run,
the baseline, then each larger node count in each parallelism asked for (`--parallel data,tensor`;
tensor parallelism on one node would split nothing, so the baseline is run once, data parallel).
With `--stock`, stock `mlx_lm lora` runs too, as one process on the first node with the same
model, data and settings (mlxcluster/bench/stock.py). This module turns them into rows (wall time,
tokens/s, speedup and scaling efficiency against our 1-node run, each rank's peak memory and the
largest against the 1-node run's, the base weights, and where the time went), a rich table, and
a PNG.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mlxcluster.bench import overhead, results
from mlxcluster.bench import stock as stock_mlx_lm
from mlxcluster.check import doctor, room
from mlxcluster.describe.cluster import Cluster, Recorded
from mlxcluster.errors import UserError
from mlxcluster.jobs import train
from mlxcluster.jobs.request import Request
from mlxcluster.launch import parallel as parallelism
from mlxcluster.launch import runs
from mlxcluster.launch import settings as run_settings
from mlxcluster.provision import inputs, model_store
from training.model.quantization import describe

# Where a run's time goes, in the order the report shows it. All are seconds of rank 0's run,
# except sync: the controller's rsync of code, data and model before the launch.
TIME_SPLIT = ("sync", "model_load", "training", "evaluation")
OURS = "ours"
BASELINE_MODE = "data"  # the 1-node run: its ranks (one per slot) share each batch
MODE_COLORS = {"data": "tab:blue", "tensor": "tab:red", "pipeline": "tab:green"}


def parallel_modes(text: str | None) -> list[str]:
    """--parallel: the parallelisms of the runs on more than one node, each once (default data),
    in the order parallelism.MODES has them."""
    if not text:
        return [BASELINE_MODE]
    modes = [part.strip() for part in str(text).split(",")]
    if not all(modes) or set(modes) - set(parallelism.MODES) or len(set(modes)) != len(modes):
        raise UserError(f"--parallel {text}: give {', '.join(parallelism.MODES[:-1])} or "
                        f"{parallelism.MODES[-1]}, or several separated by commas "
                        f"({','.join(parallelism.MODES)}), each once")
    return [mode for mode in parallelism.MODES if mode in modes]


def configurations(counts: Sequence[int], modes: Sequence[str]) -> list[tuple[int, str]]:
    """The runs, in order: the 1-node baseline once, then each larger count in each mode."""
    return [(1, BASELINE_MODE), *((count, mode) for count in counts if count > 1 for mode in modes)]


def quantization(model: Path) -> str | None:
    """The model's base weights in a few words (`4-bit affine, group 64`, `float`); None: its
    config.json is not on the controller."""
    config = model_store.shape_of(str(model))
    return describe(config) if config is not None else None


def row(nodes: int, ranks: int, summary: Mapping[str, Any], run_info: Mapping[str, Any],
        mode: str = BASELINE_MODE) -> dict[str, Any]:
    """One configuration's figures, from its run's summary.json and run.json."""
    split = summary.get("time_split") or {}
    return {
        "program": OURS,
        "parallel": mode,
        "nodes": nodes,
        "ranks": ranks,
        "wall_time_s": round(float(run_info.get("wall_time_s") or summary["wall_time"]), 1),
        "tokens_per_second": round(float(summary["tokens_per_second"]), 1),
        "iterations": summary["iterations"],
        "final_train_loss": summary["final_train_loss"],
        "time_split_s": {
            "sync": round(float(run_info.get("sync_s") or 0.0), 1),
            **{key: round(float(split.get(key, 0.0)), 1) for key in TIME_SPLIT[1:]},
        },
        "gradient_sync_estimate_s": round(float(split.get("gradient_sync_estimate", 0.0)), 2),
        "peak_memory_gb_per_rank": [round(float(p), 4) for p in summary.get("peak_memory_gb_per_rank") or []],
        # Quantized, dequantized at load, or float, as each rank loaded it.
        "base_weights": summary.get("base_weights_per_rank"),
    }


def largest_peak(r: Mapping[str, Any]) -> float | None:
    """The peak memory of the row's largest rank (GB); None: not recorded."""
    return max(r.get("peak_memory_gb_per_rank") or [], default=None)


def is_ours(r: Mapping[str, Any]) -> bool:
    return r.get("program", OURS) == OURS


def with_speedup(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rows with speedup (tokens/s over our 1-node row's), efficiency (speedup / nodes; none for
    stock, which scales nothing), and peak_memory_ratio (the largest rank's peak over our 1-node
    run's)."""
    base = next((r for r in rows if r["nodes"] == 1 and is_ours(r)), None)
    if base is None or not base["tokens_per_second"]:
        raise ValueError("a scaling report needs the 1-node configuration as its baseline")
    base_peak = largest_peak(base)
    out = []
    for r in rows:
        speedup = r["tokens_per_second"] / base["tokens_per_second"]
        peak = largest_peak(r)
        out.append({**r, "speedup": round(speedup, 3),
                    "efficiency": round(speedup / r["nodes"], 3) if is_ours(r) else None,
                    "peak_memory_ratio": round(peak / base_peak, 3) if peak and base_peak else None})
    return out


COLUMNS = ("program", "nodes", "ranks", "mode", "wall", "tokens/s", "speedup", "efficiency",
           "peak GB", "peak ratio", "sync", "load", "training", "eval", "grad sync")


def _cells(r: Mapping[str, Any]) -> list[str]:
    """A row as the table shows it; a dash where stock has no such figure."""
    split, peak, ratio = r.get("time_split_s"), largest_peak(r), r.get("peak_memory_ratio")
    return [r.get("program", OURS), str(r["nodes"]), str(r["ranks"]), r.get("parallel") or "-",
            "-" if r.get("wall_time_s") is None else f"{r['wall_time_s']:.0f} s",
            f"{r['tokens_per_second']:,.0f}", f"{r['speedup']:.2f}x",
            "-" if r.get("efficiency") is None else f"{r['efficiency']:.0%}",
            "-" if peak is None else f"{peak:.2f}", "-" if ratio is None else f"{ratio:.2f}x",
            *(f"{split[k]:.1f}" if split else "-" for k in TIME_SPLIT),
            "-" if r.get("gradient_sync_estimate_s") is None else f"{r['gradient_sync_estimate_s']:.2f}"]


def table(rows: Sequence[Mapping[str, Any]], title: str) -> Any:
    from rich.table import Table

    t = Table(title=title, caption="peak GB: the largest rank's peak memory; peak ratio: over our "
              "1-node run's. seconds of each part; grad sync: one all-reduce of the gradients timed "
              "alone, times the steps (within training)")
    for name in COLUMNS:
        t.add_column(name, justify="left" if name in ("program", "mode") else "right", no_wrap=True)
    for r in rows:
        t.add_row(*_cells(r))
    return t


def speedup_lines(rows: Sequence[Mapping[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """Each parallelism's line of the speedup plot, (nodes, speedups): from our 1-node baseline
    through that mode's runs on more nodes."""
    ours = [r for r in rows if is_ours(r)]
    base = next(r for r in ours if r["nodes"] == 1)
    lines = {}
    for mode in parallelism.MODES:
        line = [base, *(r for r in ours if r["nodes"] > 1 and r["parallel"] == mode)]
        if len(line) > 1 or mode == BASELINE_MODE:
            lines[mode] = ([r["nodes"] for r in line], [r["speedup"] for r in line])
    return lines


def bar_label(r: Mapping[str, Any]) -> str:
    """A run's name under its time-split bar: `1 node`, `2 nodes, tensor`."""
    if r["nodes"] == 1:
        return "1 node"
    return f"{r['nodes']} nodes, {r['parallel']}"


def plot(rows: Sequence[Mapping[str, Any]], output: Path, title: str) -> Path:
    """Speedup against nodes (with the ideal line), one line per parallelism and stock's point,
    and where each of our runs' time went."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 4.6), layout="constrained")
    speed, split = figure.subplots(1, 2)
    nodes = sorted({r["nodes"] for r in rows})
    speed.plot(nodes, nodes, linestyle="--", color="grey", label="ideal")
    for mode, (xs, ys) in speedup_lines(rows).items():
        speed.plot(xs, ys, marker="o", color=MODE_COLORS.get(mode), label=f"{mode} parallel")
    for r in rows:
        if is_ours(r):
            speed.annotate(f"{r['efficiency']:.0%}", (r["nodes"], r["speedup"]),
                           textcoords="offset points", xytext=(6, -12))
        else:
            speed.plot([r["nodes"]], [r["speedup"]], marker="s", linestyle="none", color="black",
                       label=f"stock {r['program']}, 1 process")
    speed.set_xlabel("nodes")
    speed.set_ylabel("speedup in tokens/s over 1 node")
    speed.set_xticks(nodes)
    speed.grid(alpha=0.3)
    speed.legend()
    ours = [r for r in rows if is_ours(r)]
    labels = [bar_label(r) for r in ours]
    bottom = [0.0] * len(ours)
    for key in TIME_SPLIT:
        values = [r["time_split_s"][key] for r in ours]
        split.bar(labels, values, bottom=bottom, label=key.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    split.tick_params(axis="x", labelrotation=20)
    split.set_ylabel("seconds")
    split.set_title("where the time went")
    split.legend()
    figure.suptitle(title)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=120, format="png")
    return output


def node_counts(text: str | None, available: int) -> list[int]:
    """--nodes as sorted counts: from 1 (the baseline) up to the training nodes there are."""
    try:
        counts = sorted({int(n) for n in str(text).split(",")}) if text else sorted({1, available})
    except ValueError:
        raise UserError(f"--nodes {text}: node counts separated by commas, e.g. 1,{available}") from None
    if counts[0] != 1 or counts[-1] > available:
        raise UserError(f"--nodes {text}: counts from 1 (the baseline) up to the {available} "
                        "training nodes of the inventory")
    return counts


def _our_runs(rec: Recorded, plan: Sequence[tuple[int, str]], layouts: Mapping[int, Cluster],
              request: Request, steps: str) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Each configuration launched exactly as invoke train launches: its row, and its run folder
    (by node count, and the mode after it for tensor parallelism)."""
    rows, run_dirs = [], {}
    for count, mode in plan:
        layout = layouts[count]
        print(f"==> scaling: {steps} on {count} "
              f"node{'s' if count > 1 else ''}, {mode} parallel", flush=True)
        # The flag trains the ranks so, and is what the controller checks and records (request.parallel).
        moded = dataclasses.replace(request, overrides=[*request.overrides, *parallelism.flags(mode)])
        run_dir = train.launch_run(layout, moded, rec.inventory)
        run_dirs[str(count) if mode == BASELINE_MODE else f"{count}-{mode}"] = str(run_dir)
        rows.append(row(count, layout.world_size, json.loads((run_dir / "summary.json").read_text()),
                        runs.read_info(run_dir), mode))
    return rows, run_dirs


def _stock_row(one_node: Cluster, request: Request) -> dict[str, Any]:
    """Stock mlx_lm lora alone on the node of our 1-node run, with our runs' settings."""
    ours = request.settings
    layout = one_node.only(one_node.training_nodes[0])
    return stock_mlx_lm.measure(layout, request.data, request.model, iters=ours.iters,
                                settings=stock_mlx_lm.settings_for(ours, request.model),
                                base_weights=quantization(request.model))


def run(rec: Recorded, *, nodes: str | None = None, parallel: str | None = None, stock: bool = False,
        iters: int = 30, batch_size: int | None = None, data: str | None = None,
        model: str | None = None, threads: int | None = None, extra: str = "",
        output: str | None = None) -> Path:
    """invoke bench.scaling: each configuration launched exactly as invoke train launches, stock
    mlx_lm lora after them when asked, then the table, the JSON and the PNG."""
    from rich.console import Console

    modes = parallel_modes(parallel)
    counts = node_counts(nodes, len(rec.cluster.training_nodes))
    plan = configurations(counts, modes)
    layouts = {count: rec.cluster.first_nodes(count) for count in counts}
    if not batch_size:
        step = math.lcm(*(layout.world_size for layout in layouts.values()))
        batch_size = step * -(-4 // step)
    data_dir, model_dir = inputs.resolve(rec.cluster, data, model)
    overrides = ["--iters", str(iters), "--batch-size", str(batch_size), "--steps-per-report", "5",
                 "--steps-per-eval", str(iters), "--save-every", str(iters), *shlex.split(extra)]
    request = Request(data_dir, model_dir, overrides=overrides, threads=threads)
    # Refused before the first run rather than after it: a model tensor parallelism cannot split,
    # and too few steps for stock's steady window.
    for count, mode in plan:
        parallelism.check(layouts[count], model_dir, mode)
    if stock:
        ours = run_settings.read(None, overrides)
        overhead.window(ours.iters, ours.steps_per_report)
    doctor.preflight(rec.cluster, room.largest(
        room.for_planned_run(layouts[count], model_dir, data_dir, overrides, parallel=mode)
        for count, mode in plan))
    rows, run_dirs = _our_runs(rec, plan, layouts, request, f"{iters} steps of global batch {batch_size}")
    if stock:
        rows.append(_stock_row(layouts[1], request))
    rows = with_speedup(rows)
    weights = quantization(model_dir)
    title = f"{model_dir.name} ({weights or 'weights unknown'}): {iters} steps, global batch {batch_size}"
    out = results.write("scaling", {
        "benchmark": "scaling", "date": results.date(), "inventory": rec.inventory,
        "model": str(model_dir), "quantization": weights, "data": str(data_dir), "iters": int(iters),
        "global_batch_size": int(batch_size), "parallel_modes": modes, "stock": bool(stock),
        "host_cpus": os.cpu_count(), "rows": rows, "runs": run_dirs}, output)
    png = plot(rows, out.with_suffix(".png"), title)
    Console(width=max(Console().width, 160)).print(table(rows, title))
    print(f"wrote {out} and {png}")
    return out
