"""`invoke bench.shares`: on a mixed cluster, equal batch shares against calibrated ones.

One run measures, in this order: every node alone (the calibration, which it also keeps for
`batch_share: auto`), then the whole cluster with equal shares of each global batch, then with
shares in proportion to the nodes' own speeds. The figures: each run's tokens/s, calibrated over
equal, and calibrated against the sum of the nodes' solo speeds (what perfect sharing would reach).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlxcluster.bench import calibrate, results
from mlxcluster.describe.cluster import Recorded
from mlxcluster.jobs import train
from mlxcluster.jobs.request import Request
from mlxcluster.launch import batch_shares
from training.data import shares


def cluster_run(rec: Recorded, base: Request, cut: list[int]) -> dict[str, Any]:
    """The whole cluster with these shares, launched as invoke train launches."""
    request = Request(base.data, base.model, base.config,
                      overrides=[*base.overrides, "--batch-shares", ",".join(map(str, cut))],
                      threads=base.threads)
    run_dir = train.launch_run(rec.cluster, request, rec.inventory)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"shares": cut, "tokens_per_second": round(float(summary["tokens_per_second"]), 1),
            "wall_time_s": round(float(summary["wall_time"]), 1),
            "ranks": summary.get("batch", {}).get("ranks", []), "run": str(run_dir)}


def figures(solo: Mapping[str, Mapping[str, float]], equal: Mapping[str, Any],
            calibrated: Mapping[str, Any]) -> dict[str, float]:
    solo_sum = sum(n["tokens_per_second"] for n in solo.values())
    return {"calibrated_over_equal": round(calibrated["tokens_per_second"] / equal["tokens_per_second"], 3),
            "solo_sum_tokens_per_second": round(solo_sum, 1),
            "calibrated_over_solo_sum": round(calibrated["tokens_per_second"] / solo_sum, 3)}


def table(result: Mapping[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title=f"batch shares: {result['model']}, global batch {result['global_batch_size']}, "
                    f"{result['iters']} steps",
              caption=f"calibrated / equal: {result['figures']['calibrated_over_equal']:.2f}x; calibrated / "
                      f"sum of solo speeds: {result['figures']['calibrated_over_solo_sum']:.0%}")
    for name in ("run", "shares", "tokens/s"):
        t.add_column(name, justify="left" if name == "run" else "right")
    for name, n in result["solo"].items():
        t.add_row(f"{name} alone", "-", f"{n['tokens_per_second']:,.0f}")
    for name in ("equal", "calibrated"):
        r = result[name]
        t.add_row(f"all, {name}", ",".join(map(str, r["shares"])), f"{r['tokens_per_second']:,.0f}")
    return t


def run(rec: Recorded, *, iters: int = 30, batch_size: int | None = None, data: str | None = None,
        model: str | None = None, threads: int | None = None, extra: str = "",
        output: str | None = None) -> Path:
    """Calibrate, then equal and calibrated shares on every node; the JSON written."""
    from rich.console import Console

    cal_plan = calibrate.plan(rec, iters=max(6, iters // 3), batch_size=batch_size, data=data, model=model,
                              config=None, threads=threads, extra=extra)
    entry = calibrate.measure(rec, cal_plan)
    batch_shares.add_calibration(rec.calibration, entry)
    global_batch = batch_size or cal_plan.settings.batch_size
    base = Request(cal_plan.request.data, cal_plan.request.model, overrides=[
        "--iters", str(iters), "--batch-size", str(global_batch), "--steps-per-report", "5",
        "--steps-per-eval", str(iters), "--save-every", str(iters), "--val-batches", "1",
        *shlex.split(extra)], threads=threads)
    weights, _ = batch_shares.calibrated_weights(rec.cluster, entry)
    runs = {}
    for name, cut in (("equal", shares.split(global_batch, [1.0] * len(weights))),
                      ("calibrated", shares.split(global_batch, weights))):
        print(f"==> shares: {iters} steps of global batch {global_batch} on every node, {name} shares "
              f"{','.join(map(str, cut))}", flush=True)
        runs[name] = cluster_run(rec, base, cut)
    result = {"benchmark": "shares", "date": results.date(), "inventory": rec.inventory,
              "model": entry["model"], "iters": iters, "global_batch_size": global_batch,
              "solo": entry["nodes"], **runs, "figures": figures(entry["nodes"], runs["equal"],
                                                                   runs["calibrated"])}
    out = results.write("shares", result, output)
    Console(width=max(Console().width, 100)).print(table(result))
    print(f"wrote {out}")
    return out
