"""The scaling report of `invoke bench.scaling`: the same fine-tune on 1 node and on more.

Each configuration is one run of `invoke train` (its summary.json and run.json); this module turns
them into rows (wall time, tokens/s, speedup and scaling efficiency against one node, and where the
time went), a rich table, and a PNG.
"""

from __future__ import annotations

import json
import math
import os
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mlxcluster.bench import results
from mlxcluster.check import doctor
from mlxcluster.describe.cluster import Recorded
from mlxcluster.errors import UserError
from mlxcluster.jobs import train
from mlxcluster.launch import runs
from mlxcluster.provision import inputs

# Where a run's time goes, in the order the report shows it. All are seconds of rank 0's run,
# except sync: the controller's rsync of code, data and model before the launch.
TIME_SPLIT = ("sync", "model_load", "training", "evaluation")


def row(nodes: int, ranks: int, summary: Mapping[str, Any], run_info: Mapping[str, Any]) -> dict[str, Any]:
    """One configuration's figures, from its run's summary.json and run.json."""
    split = summary.get("time_split") or {}
    return {
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
    }


def with_speedup(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rows with speedup (tokens/s over the 1-node row's) and efficiency (speedup / nodes)."""
    base = next((r for r in rows if r["nodes"] == 1), None)
    if base is None or not base["tokens_per_second"]:
        raise ValueError("a scaling report needs the 1-node configuration as its baseline")
    out = []
    for r in rows:
        speedup = r["tokens_per_second"] / base["tokens_per_second"]
        out.append({**r, "speedup": round(speedup, 3), "efficiency": round(speedup / r["nodes"], 3)})
    return out


def table(rows: Sequence[Mapping[str, Any]], title: str) -> Any:
    from rich.table import Table

    t = Table(title=title, caption="seconds of each part; grad sync: one all-reduce of the "
              "gradients timed alone, times the steps (within training)")
    for name in ("nodes", "ranks", "wall", "tokens/s", "speedup", "efficiency",
                 "sync", "load", "training", "eval", "grad sync"):
        t.add_column(name, justify="right", no_wrap=True)
    for r in rows:
        t.add_row(str(r["nodes"]), str(r["ranks"]), f"{r['wall_time_s']:.0f} s",
                  f"{r['tokens_per_second']:,.0f}", f"{r['speedup']:.2f}x", f"{r['efficiency']:.0%}",
                  *(f"{r['time_split_s'][k]:.1f}" for k in TIME_SPLIT),
                  f"{r['gradient_sync_estimate_s']:.2f}")
    return t


def plot(rows: Sequence[Mapping[str, Any]], output: Path, title: str) -> Path:
    """Speedup against nodes (with the ideal line) and each configuration's time split."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 4.2), layout="constrained")
    speed, split = figure.subplots(1, 2)
    nodes = [r["nodes"] for r in rows]
    speed.plot(nodes, nodes, linestyle="--", color="grey", label="ideal")
    speed.plot(nodes, [r["speedup"] for r in rows], marker="o", color="tab:blue", label="measured")
    for r in rows:
        speed.annotate(f"{r['efficiency']:.0%}", (r["nodes"], r["speedup"]),
                       textcoords="offset points", xytext=(6, -12))
    speed.set_xlabel("nodes")
    speed.set_ylabel("speedup in tokens/s over 1 node")
    speed.set_xticks(nodes)
    speed.grid(alpha=0.3)
    speed.legend()
    labels = [f"{r['nodes']} node{'s' if r['nodes'] > 1 else ''}" for r in rows]
    bottom = [0.0] * len(rows)
    for key in TIME_SPLIT:
        values = [r["time_split_s"][key] for r in rows]
        split.bar(labels, values, bottom=bottom, label=key.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
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


def run(rec: Recorded, *, nodes: str | None = None, iters: int = 30, batch_size: int | None = None,
        data: str | None = None, model: str | None = None, threads: int | None = None,
        extra: str = "", output: str | None = None) -> Path:
    """invoke bench.scaling: each configuration launched exactly as invoke train launches, then
    the table, the JSON and the PNG."""
    from rich.console import Console

    layouts = {count: rec.cluster.first_nodes(count)
               for count in node_counts(nodes, len(rec.cluster.training_nodes))}
    if not batch_size:
        step = math.lcm(*(layout.world_size for layout in layouts.values()))
        batch_size = step * -(-4 // step)
    data_dir, model_dir = inputs.resolve(rec.cluster, data, model)
    doctor.preflight(rec.cluster, inputs.model_bytes(model_dir))
    overrides = ["--iters", str(iters), "--batch-size", str(batch_size), "--steps-per-report", "5",
                 "--steps-per-eval", str(iters), "--save-every", str(iters), *shlex.split(extra)]
    request = train.Request(data_dir, model_dir, overrides=overrides, threads=threads)
    rows, run_dirs = [], {}
    for count, layout in layouts.items():
        print(f"==> scaling: {iters} steps of global batch {batch_size} on {count} "
              f"node{'s' if count > 1 else ''}", flush=True)
        run_dir = train.launch_run(layout, request, rec.inventory)
        run_dirs[count] = str(run_dir)
        rows.append(row(count, layout.world_size, json.loads((run_dir / "summary.json").read_text()),
                        runs.read_info(run_dir)))
    rows = with_speedup(rows)
    title = f"{model_dir.name}: {iters} steps, global batch {batch_size}"
    out = results.write("scaling", {
        "benchmark": "scaling", "date": results.date(), "inventory": rec.inventory,
        "model": str(model_dir), "data": str(data_dir), "iters": int(iters),
        "global_batch_size": int(batch_size), "host_cpus": os.cpu_count(), "rows": rows,
        "runs": run_dirs}, output)
    png = plot(rows, out.with_suffix(".png"), title)
    Console(width=max(Console().width, 120)).print(table(rows, title))
    print(f"wrote {out} and {png}")
    return out
