"""`invoke bench.tensor`: one process against every node holding a shard.

Two runs of the same fine-tune, each launched as `invoke train` launches it: the first node alone
(the whole model in one process), then every training node with `--parallel tensor`. The figures:
each run's peak memory per rank (the point of tensor parallelism: the largest rank's against the
single process), tokens/s, and both runs' loss curves in one plot, which should lie on each other.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlxcluster.bench import results
from mlxcluster.check import doctor, room
from mlxcluster.describe.cluster import Recorded
from mlxcluster.errors import UserError
from mlxcluster.jobs import train
from mlxcluster.jobs.request import Request
from mlxcluster.launch import parallel
from mlxcluster.provision import inputs
from training.loop import report


def measured(run_dir: Path) -> dict[str, Any]:
    """One run's figures, from its summary.json."""
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"ranks": summary["world_size"], "parallel": summary.get("parallel", "data"),
            "peak_memory_gb_per_rank": [round(p, 4) for p in summary["peak_memory_gb_per_rank"]],
            "tokens_per_second": round(float(summary["tokens_per_second"]), 1),
            "final_train_loss": summary.get("final_train_loss"),
            "final_val_loss": summary.get("final_val_loss"), "run": str(run_dir)}


def figures(single: Mapping[str, Any], tensor: Mapping[str, Any]) -> dict[str, float | None]:
    """The largest tensor-parallel rank's peak memory, and tokens/s, over the single process's."""
    return {"peak_memory_ratio": round(max(tensor["peak_memory_gb_per_rank"])
                                       / single["peak_memory_gb_per_rank"][0], 3),
            "tokens_per_second_ratio": round(tensor["tokens_per_second"] / single["tokens_per_second"], 3)}


def loss_difference(single: Path, tensor: Path) -> dict[str, float | None]:
    """The largest difference between the two runs' reported losses, step by step (train and
    validation): tensor parallelism computes what one process does, up to the order of sums.
    None when the runs did not report the same steps."""
    differences: dict[str, float | None] = {}
    for key in ("train_loss", "val_loss"):
        one, many = (report.loss_series(report.read_metrics(run / "metrics.jsonl"), key)
                     for run in (single, tensor))
        same = one[0] == many[0] and len(one[0]) > 0
        differences[f"max_{key}_difference"] = (
            round(max(abs(a - b) for a, b in zip(one[1], many[1], strict=True)), 8) if same else None)
    return differences


def plot(runs: Mapping[str, Path], output: Path, title: str) -> Path:
    """Every run's train and validation losses against the step, in one PNG."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.2), layout="constrained")
    axes = figure.add_subplot()
    # The first run wide and pale beneath, the next narrow on top: equal curves stay both visible.
    looks = ({"color": "tab:blue", "linewidth": 6, "markersize": 10, "alpha": 0.35},
             {"color": "tab:red", "linewidth": 1.5, "markersize": 4, "alpha": 1.0})
    for (label, run_dir), look in zip(runs.items(), looks, strict=False):
        records = report.read_metrics(run_dir / "metrics.jsonl")
        for key, style in (("train_loss", "-"), ("val_loss", "o--")):
            xs, ys = report.loss_series(records, key)
            axes.plot(xs, ys, style, label=f"{label}, {key.split('_')[0]}", **look)
    axes.set_xlabel("iteration")
    axes.set_ylabel("loss")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.savefig(output, dpi=120, format="png")
    return output


def table(result: Mapping[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title=f"tensor parallel: {Path(result['model']).name}, global batch "
                    f"{result['global_batch_size']}, {result['iters']} steps",
              caption=f"largest rank's peak memory / one process's: "
                      f"{result['figures']['peak_memory_ratio']:.2f}x; tokens/s: "
                      f"{result['figures']['tokens_per_second_ratio']:.2f}x; largest train loss "
                      f"difference: {result['figures'].get('max_train_loss_difference')}")
    for name in ("run", "peak memory per rank (GB)", "tokens/s", "final train loss"):
        t.add_column(name, justify="left" if name == "run" else "right")
    for name in ("single", "tensor"):
        r = result[name]
        t.add_row(f"{r['ranks']} rank{'s' if r['ranks'] > 1 else ''}, {r['parallel']}",
                  ", ".join(f"{p:.3f}" for p in r["peak_memory_gb_per_rank"]),
                  f"{r['tokens_per_second']:,.1f}", f"{r['final_train_loss']:.3f}")
    return t


def run(rec: Recorded, *, nodes: str | None = None, iters: int = 30,
        batch_size: int | None = None, data: str | None = None, model: str | None = None,
        threads: int | None = None, extra: str = "", output: str | None = None) -> Path:
    """One process on the first node, then the first `nodes` (default: every training node) in
    tensor parallelism; the JSON written."""
    from rich.console import Console

    available = len(rec.cluster.training_nodes)
    if nodes and (not str(nodes).isdigit() or not 2 <= int(nodes) <= available):
        raise UserError(f"--nodes {nodes}: how many nodes hold a shard, from 2 "
                        f"to the {available} training nodes")
    sharded = rec.cluster.first_nodes(int(nodes)) if nodes else rec.cluster
    data_dir, model_dir = inputs.resolve(rec.cluster, data, model)
    parallel.check(sharded, model_dir, "tensor")
    batch = batch_size or 4
    overrides = ["--iters", str(iters), "--batch-size", str(batch), "--steps-per-report", "5",
                 "--steps-per-eval", str(max(iters // 3, 1)), "--save-every", str(iters),
                 *shlex.split(extra)]
    doctor.preflight(rec.cluster, room.largest([
        room.for_planned_run(rec.cluster.first_nodes(1), model_dir, data_dir, overrides),
        room.for_planned_run(sharded, model_dir, data_dir, overrides, parallel="tensor")]))
    run_dirs = {}
    for name, layout, flags in (("single", rec.cluster.first_nodes(1), []),
                                ("tensor", sharded, ["--parallel", "tensor"])):
        print(f"==> tensor: {iters} steps of batch {batch} on {layout.world_size} "
              f"rank{'s' if layout.world_size > 1 else ''} ({name})", flush=True)
        request = Request(data_dir, model_dir, overrides=[*overrides, *flags], threads=threads)
        run_dirs[name] = train.launch_run(layout, request, rec.inventory)
    single, tensor = measured(run_dirs["single"]), measured(run_dirs["tensor"])
    result = {"benchmark": "tensor", "date": results.date(), "inventory": rec.inventory,
              "model": str(model_dir), "iters": iters, "global_batch_size": batch,
              "single": single, "tensor": tensor,
              "figures": figures(single, tensor) | loss_difference(run_dirs["single"], run_dirs["tensor"])}
    out = results.write("tensor", result, output)
    plot({"1 rank": run_dirs["single"], f"{tensor['ranks']} ranks, tensor": run_dirs["tensor"]},
         out.with_suffix(".png"), f"{model_dir.name}: one process and tensor parallel")
    Console(width=max(Console().width, 100)).print(table(result))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return out
