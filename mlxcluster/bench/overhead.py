"""What our training path costs over stock mlx-lm: tokens/s of a 1-rank `invoke train` against
`mlx_lm lora` (mlx-lm's own command line), side by side on one node (part of `invoke bench.train`).

Both run as one process on the launcher, started by the one launch builder (env.sh sourced, the
same environment), with the same model, data, global batch, LoRA shape, learning rate, sequence
length, seed and steps, and they alternate so that a slow spell of the shared machine hits both.

Both are timed the same way: by this machine's clock as their report lines arrive, over the steady
part of the run: from the first report (its steps include compiling the kernels) to the last one
before the final validation (mlx-lm validates before the last step). That window holds every step
and everything our code does around one (progress, metrics, watchdog, batching), and no
validation. With the same seed both train on the same batches (mlx-lm's first shuffle with numpy's
RNG from the seed, ours with a private RNG from the seed), so the token counts are equal: ours are
exact (metrics.jsonl), stock mlx-lm prints them in thousands, which is checked against ours.
"""

from __future__ import annotations

import json
import re
import statistics
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from mlxcluster.bench import results
from mlxcluster.describe.cluster import Cluster
from mlxcluster.errors import UserError
from mlxcluster.jobs import train
from mlxcluster.launch import builder, relay, sync

# The fine-tune both run: lora.yaml's defaults, reporting every 5 steps, one validation of
# 2 batches before the first and before the last step.
SETTINGS = {"batch_size": 4, "num_layers": 8, "learning_rate": 1e-4, "max_seq_length": 2048,
            "seed": 0, "steps_per_report": 5, "val_batches": 2}
LORA = {"rank": 8, "scale": 20.0, "dropout": 0.0}
_OURS = re.compile(r"^iter\s+(\d+)/\d+\s+loss ")
# mlx-lm's TrainUI report: "  iter  train_loss arrow  tok/s  tokens" (tokens in thousands).
_STOCK = re.compile(r"^\s*(\d+)\s+[\d.]+\s+\S\s+([\d,]+)\s+([\d.]+)k\s*$")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _flags(settings: Mapping[str, Any]) -> list[str]:
    return [word for key, value in settings.items()
            for word in (f"--{key.replace('_', '-')}", str(value))]


def _run_flags(iters: int, settings: Mapping[str, Any]) -> list[str]:
    return _flags({**settings, "iters": iters, "steps_per_eval": iters, "save_every": iters})


def ours_flags(iters: int, settings: Mapping[str, Any] = SETTINGS) -> list[str]:
    lora = {"lora_rank": LORA["rank"], "lora_scale": LORA["scale"], "lora_dropout": LORA["dropout"]}
    return _run_flags(iters, {**settings, **lora})


def ours_program(model: str, data: str, adapter_path: str, iters: int,
                 settings: Mapping[str, Any] = SETTINGS) -> list[str]:
    """What invoke train runs on its one rank (mlxcluster/jobs/train.py plans it so)."""
    return train.finetune_argv(model=model, data=data, adapter_path=adapter_path, world_size=1,
                               overrides=ours_flags(iters, settings))


def stock_program(model: str, data: str, adapter_path: str, iters: int, config: str,
                  settings: Mapping[str, Any] = SETTINGS) -> list[str]:
    # The LoRA shape has no flags in mlx_lm lora: it comes from its YAML config (-c).
    return ["python", "-m", "mlx_lm", "lora", "--train", "--model", model, "--data", data,
            "--adapter-path", adapter_path, "-c", config, *_run_flags(iters, settings)]


def report_times(stamped: Sequence[tuple[float, str]], stock: bool) -> dict[int, tuple[float, float | None]]:
    """step -> (when its report line arrived, the thousands of tokens trained, stock only)."""
    times: dict[int, tuple[float, float | None]] = {}
    for when, line in stamped:
        line = _ANSI.sub("", line).strip("\r")
        if stock and (match := _STOCK.match(line)):
            times[int(match[1])] = (when, float(match[3]))
        elif not stock and (match := _OURS.match(line)):
            times[int(match[1])] = (when, None)
    return times


def window(iters: int) -> tuple[int, int]:
    """The reports that bound the steady part: the first, and the last before the final
    validation (which runs before step `iters`)."""
    every = SETTINGS["steps_per_report"]
    last = (iters - 1) // every * every
    if last <= every:
        raise UserError(f"--overhead-iters {iters}: need at least {3 * every} steps to leave "
                        "a steady part between the first report and the final validation")
    return every, last


def tokens_per_second(times: Mapping[int, tuple[float, float | None]], tokens: Mapping[int, int],
                      bounds: tuple[int, int]) -> float:
    first, last = bounds
    missing = [step for step in bounds if step not in times]
    if missing:
        raise UserError(f"the run printed no report for step(s) {missing}: see its output above")
    return (tokens[last] - tokens[first]) / (times[last][0] - times[first][0])


def _stamped(layout: Cluster, cmd: list[str], marker: str) -> list[tuple[float, str]]:
    relayed = relay.supervise(layout, cmd, marker, stamp=True)
    if relayed.code != 0:
        raise UserError(f"the overhead run {marker} failed (exit {relayed.code}): see its output above")
    return relayed.stamped


def _ours(layout: Cluster, data: Path, model: Path, iters: int, run_id: str,
          settings: Mapping[str, Any]) -> tuple[dict[int, tuple[float, float | None]], dict[int, int], float]:
    """Our run, planned and launched as invoke train does it: its report times, its tokens by
    step, and the tokens/s it reports itself (summary.json)."""
    request = train.Request(data, model, overrides=ours_flags(iters, settings), interactive=False)
    plan = train.plan(layout, request, run_id=run_id)
    sync.run_steps(plan.steps)
    stamped = _stamped(layout, plan.launch, plan.marker)
    train.collect(plan)
    records = [json.loads(line) for line in (plan.results / "metrics.jsonl").read_text().splitlines()]
    tokens = {r["iteration"]: r["trained_tokens"] for r in records if "train_loss" in r}
    summary = json.loads((plan.results / "summary.json").read_text())
    return report_times(stamped, stock=False), tokens, summary["tokens_per_second"]


def _stock(layout: Cluster, data: Path, model: Path, iters: int, run_id: str,
           settings: Mapping[str, Any]) -> dict[int, tuple[float, float | None]]:
    """Stock mlx_lm lora on the same node and files: its report times and token counts."""
    head = layout.head
    placed = sync.placement(layout, data, model)
    with tempfile.TemporaryDirectory() as local:
        (Path(local) / "lora.yaml").write_text(yaml.safe_dump({"lora_parameters": LORA}))
        sync.run_steps([(f"put the stock run's LoRA config on {head.name}",
                         sync.push(Path(local), head, f"{head.work_dir}/bench-overhead"))])
    program = stock_program(placed.model, placed.data, f"{head.runs_dir}/{run_id}", iters,
                            f"{head.work_dir}/bench-overhead/lora.yaml", settings)
    cmd = builder.command(layout, builder.Job(program, backend="direct"))
    return report_times(_stamped(layout, cmd, f"runs/{run_id}"), stock=True)


def compare(layout: Cluster, data: Path, model: Path, *, iters: int, rounds: int,
            settings: Mapping[str, Any] = SETTINGS) -> dict[str, Any]:
    """`rounds` of (ours, stock) on the launcher: tokens/s of each over the steady window and
    their ratio, per round and overall."""
    bounds = window(iters)
    when = results.stamp()
    per_round = []
    for index in range(rounds):
        print(f"==> overhead, round {index + 1} of {rounds}: our invoke train, 1 rank", flush=True)
        ours, tokens, reported = _ours(layout, data, model, iters, f"bench-ours-{when}-{index}",
                                       settings)
        print(f"==> overhead, round {index + 1} of {rounds}: stock mlx_lm lora", flush=True)
        stock = _stock(layout, data, model, iters, f"bench-stock-{when}-{index}", settings)
        per_round.append(compare_round(ours, stock, tokens, bounds, reported))
    return _summary(per_round, iters, bounds, settings)


def compare_round(ours: Mapping[int, tuple[float, float | None]],
           stock: Mapping[int, tuple[float, float | None]], tokens: Mapping[int, int],
           bounds: tuple[int, int], ours_reported: float) -> dict[str, Any]:
    # Same seed, same batches: stock's token counts (in thousands) must be ours, rounded.
    off = max(abs((stock[s][1] or 0) * 1000 - tokens[s]) for s in bounds if s in stock)
    if off > 50:
        raise UserError(f"stock mlx-lm trained on other batches than ours ({off:.0f} tokens apart "
                        "at a report): the token counts cannot be compared")
    ours_tps = tokens_per_second(ours, tokens, bounds)
    stock_tps = tokens_per_second(stock, tokens, bounds)
    return {"ours_tokens_per_second": round(ours_tps, 1),
            "stock_tokens_per_second": round(stock_tps, 1),
            "ours_over_stock": round(ours_tps / stock_tps, 4),
            "ours_reported_tokens_per_second": round(ours_reported, 1),
            "window_tokens": tokens[bounds[1]] - tokens[bounds[0]]}


def _summary(per_round: list[dict[str, Any]], iters: int, bounds: tuple[int, int],
             settings: Mapping[str, Any]) -> dict[str, Any]:
    ours = statistics.fmean(r["ours_tokens_per_second"] for r in per_round)
    stock = statistics.fmean(r["stock_tokens_per_second"] for r in per_round)
    return {"iters": iters, "settings": {**settings, "lora_parameters": LORA},
            "window_reports": list(bounds), "rounds": per_round,
            "ours_tokens_per_second": round(ours, 1), "stock_tokens_per_second": round(stock, 1),
            "ours_over_stock": round(ours / stock, 4), "target": 0.97}
