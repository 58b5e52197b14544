"""What our training path costs over stock mlx-lm, and whether it trains the same: `invoke
bench.overhead` (lora, dora and full) and the overhead part of `invoke bench.train` (lora).

For each fine-tune type ONE config file is written, with mlx-lm's keys only (`config_for`), and both
programs are given that very file on one node: ours as `python -m training.finetune --config FILE`,
stock mlx-lm as `python -m mlx_lm lora --config FILE --train`, each with nothing more than
`--adapter-path` for its outputs. Both run as one process on the node, started by the one launch
builder (env.sh sourced, the same environment), and they alternate, round after round, so that a
slow spell of the shared machine hits both.

Speed: both are timed the same way, by this machine's clock as their report lines arrive, over the
steady part of the run: from the first report (its steps include compiling the kernels) to the last
one before the final validation (mlx-lm validates before the last step). That window holds every
step and everything our code does around one (progress, metrics, watchdog, batching), and no
validation. A type's ratio is the median of its rounds' ratios.

Losses: with the same seed both train on the same batches over the first epoch (mlx-lm shuffles with
numpy's global RNG seeded from the seed, ours with a private RNG from the seed; mlx-lm's validations
draw from the global RNG between its epochs, so its later epochs differ). So the token counts are
equal, which is checked (ours are exact, in metrics.jsonl; stock prints them in thousands), and the
train losses are compared report by report over the first epoch (stock prints them to 3 decimals).

The runs' folders on the node are removed once read: full fine-tuning leaves hundreds of MB each.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import statistics
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mlxcluster.bench import results
from mlxcluster.check import doctor, room
from mlxcluster.describe.cluster import Cluster, Node, Recorded
from mlxcluster.errors import UserError
from mlxcluster.jobs import train
from mlxcluster.jobs.request import Request
from mlxcluster.launch import builder, relay, remote, sync
from mlxcluster.provision import inputs

FINE_TUNE_TYPES = ("lora", "dora", "full")
TARGET = 0.97  # ours/stock tokens/s that the issue asks for
# Stock prints losses to 3 decimals (off by up to 5e-4); the rest is float rounding in another
# order (our loss is a sum times 1/tokens, mlx-lm's a mean), which grows a little step by step.
LOSS_TOLERANCE = 2e-3
# Stock prints trained tokens in thousands to one decimal: off by up to 50.
TOKEN_TOLERANCE = 50

# What both run, in mlx-lm's keys: lora.yaml's fine-tune, reporting every 5 steps, one validation of
# 2 batches before the first and before the last step (config_for adds steps_per_eval = iters).
SETTINGS: dict[str, Any] = {
    "batch_size": 4, "num_layers": 8, "learning_rate": 1e-4, "max_seq_length": 2048, "seed": 0,
    "steps_per_report": 5, "val_batches": 2,
    "lora_parameters": {"rank": 8, "scale": 20.0, "dropout": 0.0},
}

# Ours: "iter 10/40  loss 2.345  lr ..." (training/loop/progress.py).
_OURS = re.compile(r"^iter\s+(\d+)/\d+\s+loss ")
# mlx-lm's TrainUI report: "  iter  train_loss arrow  tok/s  tokens" (tokens in thousands).
_STOCK = re.compile(r"^\s*(\d+)\s+(\d+\.\d+)\s+\S\s+([\d,]+)\s+([\d.]+)k\s*$")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


# --- the one config file and the two command lines -----------------------------------------------


def config_for(fine_tune_type: str, *, model: str, data: str, iters: int,
               settings: Mapping[str, Any] = SETTINGS) -> dict[str, Any]:
    """The config file both programs train with: mlx-lm's keys only, paths as the node has them.
    One validation before the first step and one before the last, one save at the end."""
    if fine_tune_type not in FINE_TUNE_TYPES:
        raise UserError(f"fine-tune type {fine_tune_type!r}: give one of {', '.join(FINE_TUNE_TYPES)}")
    return {"model": model, "data": data, "fine_tune_type": fine_tune_type, **settings,
            "iters": iters, "steps_per_eval": iters, "save_every": iters}


def write_config(config: Mapping[str, Any], folder: Path) -> Path:
    """`config` as <folder>/<fine_tune_type>.yaml: the file given to both programs."""
    path = folder / f"{config['fine_tune_type']}.yaml"
    path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
    return path


def ours_program(config: str, adapter_path: str) -> list[str]:
    """Our training entry point with the config file, as one process."""
    return ["python", "-m", "training.finetune", "--config", config, "--adapter-path", adapter_path]


def stock_program(config: str, adapter_path: str) -> list[str]:
    """Stock `mlx_lm lora` with the same file (it trains only when told to: --train)."""
    return ["python", "-m", "mlx_lm", "lora", "--config", config, "--train", "--adapter-path", adapter_path]


# --- reading the runs --------------------------------------------------------------------------


@dataclass(frozen=True)
class Reports:
    """One run's train reports by step: when each line reached this machine, the loss, the tokens
    trained so far, and mlx-lm's own tokens/s since the previous report (its clock runs inside
    the steps only: not while the next batch is made, nor in the report callbacks)."""

    arrived: dict[int, float]
    losses: dict[int, float]
    tokens: dict[int, float]
    speeds: dict[int, float]


def _lines(stamped: Sequence[tuple[float, str]]) -> list[tuple[float, str]]:
    return [(when, _ANSI.sub("", line).strip("\r")) for when, line in stamped]


def stock_reports(stamped: Sequence[tuple[float, str]]) -> Reports:
    """Stock mlx-lm's report lines: arrival, loss (3 decimals), tokens/s (whole) and tokens (in
    thousands)."""
    found: Reports = Reports({}, {}, {}, {})
    for when, line in _lines(stamped):
        if match := _STOCK.match(line):
            step = int(match[1])
            found.arrived[step], found.losses[step] = when, float(match[2])
            found.speeds[step], found.tokens[step] = float(match[3].replace(",", "")), float(match[4]) * 1000
    return found


def our_reports(stamped: Sequence[tuple[float, str]], metrics: str) -> Reports:
    """Our report lines' arrival, and the exact figures of metrics.jsonl."""
    arrived = {int(match[1]): when for when, line in _lines(stamped) if (match := _OURS.match(line))}
    records = [json.loads(line) for line in metrics.splitlines() if line.strip()]
    trains = {r["iteration"]: r for r in records if "train_loss" in r}
    return Reports(arrived, {step: r["train_loss"] for step, r in trains.items()},
                   {step: r["trained_tokens"] for step, r in trains.items()},
                   {step: r["tokens_per_second"] for step, r in trains.items()})


# --- what is compared --------------------------------------------------------------------------


def window(iters: int, every: int = SETTINGS["steps_per_report"]) -> tuple[int, int]:
    """The reports that bound the steady part: the first, and the last before the final
    validation (which runs before step `iters`)."""
    last = (iters - 1) // every * every
    if last <= every:
        raise UserError(f"--iters {iters}: need at least {3 * every} steps to leave a steady part "
                        "between the first report and the final validation")
    return every, last


def train_examples(data: Path) -> int:
    """The examples of the data's train split (one JSON line each, as mlx-lm reads it)."""
    with (data / "train.jsonl").open(encoding="utf-8") as lines:
        return sum(1 for line in lines if line.strip())


def first_epoch_steps(examples: int, batch_size: int) -> int:
    """Steps of the first epoch: mlx-lm makes whole batches only."""
    return examples // batch_size


def tokens_per_second(arrived: Mapping[int, float], tokens: Mapping[int, int],
                      bounds: tuple[int, int]) -> float:
    first, last = bounds
    missing = [step for step in bounds if step not in arrived]
    if missing:
        raise UserError(f"the run printed no report for step(s) {missing}: see its output above")
    return (tokens[last] - tokens[first]) / (arrived[last] - arrived[first])


def seconds_in_steps(speeds: Mapping[int, float], tokens: Mapping[int, float],
                     bounds: tuple[int, int]) -> float:
    """Of the window, the time mlx-lm's clock saw inside the steps: each report's tokens over its
    tokens/s. The rest of the window is spent around the steps (making batches, the report
    callbacks, printing): where a training loop's own overhead shows."""
    reports = [step for step in sorted(tokens) if bounds[0] <= step <= bounds[1]]
    return sum((tokens[step] - tokens[before]) / speeds[step]
               for before, step in itertools.pairwise(reports))


def check_same_batches(ours: Reports, stock: Reports) -> None:
    """Same seed, same batches: stock's token counts must be ours, as rounded to 0.1k."""
    if sorted(ours.tokens) != sorted(stock.tokens):
        raise UserError(f"stock mlx-lm reported at steps {sorted(stock.tokens)}, ours at "
                        f"{sorted(ours.tokens)}: see their output above")
    off = max(abs(stock.tokens[step] - ours.tokens[step]) for step in ours.tokens)
    if off > TOKEN_TOLERANCE:
        raise UserError(f"stock mlx-lm trained on other batches than ours ({off:.0f} tokens apart "
                        "at a report): neither speeds nor losses can be compared")


def loss_rows(ours: Reports, stock: Reports, epoch_steps: int) -> list[dict[str, Any]]:
    """Both runs' train losses, report by report, and whether the report is in the first epoch
    (the steps whose batches are the same in both)."""
    return [{"step": step, "ours": ours.losses[step], "stock": stock.losses[step],
             "difference": round(abs(ours.losses[step] - stock.losses[step]), 6),
             "first_epoch": step <= epoch_steps}
            for step in sorted(ours.losses) if step in stock.losses]


def max_first_epoch_difference(rows: Sequence[Mapping[str, Any]]) -> float | None:
    """The largest loss difference of a first-epoch report (None: no report in it)."""
    return max((row["difference"] for row in rows if row["first_epoch"]), default=None)


def compare_round(ours: Reports, stock: Reports, bounds: tuple[int, int], epoch_steps: int,
                  ours_reported: float) -> dict[str, Any]:
    """One round: tokens/s of each over the window (by our exact token counts, which stock's
    must match), their ratio, and the losses report by report."""
    check_same_batches(ours, stock)
    ours_tps = tokens_per_second(ours.arrived, ours.tokens, bounds)
    stock_tps = tokens_per_second(stock.arrived, ours.tokens, bounds)
    losses = loss_rows(ours, stock, epoch_steps)
    window_tokens = ours.tokens[bounds[1]] - ours.tokens[bounds[0]]
    return {"ours_tokens_per_second": round(ours_tps, 1),
            "stock_tokens_per_second": round(stock_tps, 1),
            "ours_over_stock": round(ours_tps / stock_tps, 4),
            "ours_reported_tokens_per_second": round(ours_reported, 1),
            "window_tokens": window_tokens,
            **time_split("ours", window_tokens / ours_tps,
                         seconds_in_steps(ours.speeds, ours.tokens, bounds)),
            **time_split("stock", window_tokens / stock_tps,
                         seconds_in_steps(stock.speeds, ours.tokens, bounds)),
            "losses": losses,
            "max_loss_difference_first_epoch": max_first_epoch_difference(losses)}


SPLIT = ("window_seconds", "seconds_in_steps", "seconds_around_steps")


def time_split(who: str, window_seconds: float, in_steps: float) -> dict[str, float]:
    """A run's window: inside the steps (by mlx-lm's clock) and around them (the rest)."""
    return {f"{who}_{part}": round(seconds, 2)
            for part, seconds in zip(SPLIT, (window_seconds, in_steps, window_seconds - in_steps),
                                     strict=True)}


def summarize(config: Mapping[str, Any], per_round: Sequence[Mapping[str, Any]], bounds: tuple[int, int],
              epoch_steps: int) -> dict[str, Any]:
    """A fine-tune type's figures: medians over the rounds (a slow spell of the shared machine
    moves a mean), and the largest first-epoch loss difference of any round."""
    ratio = statistics.median(r["ours_over_stock"] for r in per_round)
    ours, stock = (statistics.median(r[f"{who}_tokens_per_second"] for r in per_round)
                   for who in ("ours", "stock"))
    differences = [d for r in per_round if (d := r["max_loss_difference_first_epoch"]) is not None]
    worst = max(differences, default=None)
    split = {key: round(statistics.median(r[key] for r in per_round), 2)
             for key in (f"{who}_{part}" for who in ("ours", "stock") for part in SPLIT)}
    return {"fine_tune_type": config["fine_tune_type"], "config": dict(config),
            "iters": config["iters"], "window_reports": list(bounds), "first_epoch_steps": epoch_steps,
            "rounds": list(per_round),
            "ours_tokens_per_second": round(ours, 1), "stock_tokens_per_second": round(stock, 1),
            "ours_over_stock": round(ratio, 4), "target": TARGET, "meets_target": ratio >= TARGET, **split,
            "max_loss_difference_first_epoch": worst, "loss_tolerance": LOSS_TOLERANCE,
            "same_losses": None if worst is None else worst <= LOSS_TOLERANCE}


# --- running them on the node ------------------------------------------------------------------


def _on_head(head: Node, command: Sequence[str]) -> str:
    return remote.output(head, remote.ssh_command(head, shlex.join(command)))


def _put_inputs(layout: Cluster, data: Path, model: Path) -> sync.Placed:
    """Code, data and model on the node, as invoke train puts them: where they are there."""
    data_files, model_files = train.shipments(Request(data, model))
    steps, placed = sync.training_inputs(layout, data_files, model_files, None)
    sync.run_steps(steps)
    return placed


def _put_config(head: Node, config: Mapping[str, Any]) -> str:
    """The config file on the node: its path there."""
    folder = f"{head.work_dir}/bench-overhead"
    with tempfile.TemporaryDirectory() as local:
        written = write_config(config, Path(local))
        sync.run_steps([(f"put the {config['fine_tune_type']} config on {head.name}",
                         sync.push(Path(local), head, folder))])
    return f"{folder}/{written.name}"


def _run(layout: Cluster, program: list[str], run_dir: str) -> list[tuple[float, str]]:
    """`program` as one process on the node, its output lines stamped as they arrive."""
    cmd = builder.command(layout, builder.Job(program, backend="direct"))
    # The marker names the run's processes there, for stopping them after a stall or Ctrl-C.
    relayed = relay.supervise(layout, cmd, run_dir, stamp=True)
    if relayed.code != 0:
        raise UserError(f"the overhead run {run_dir} failed (exit {relayed.code}): see its output above")
    return relayed.stamped


def _ours(layout: Cluster, config: str, run_dir: str) -> tuple[Reports, float]:
    """Our run: its reports, and the tokens/s it reports itself (summary.json)."""
    stamped = _run(layout, ours_program(config, run_dir), run_dir)
    metrics = _on_head(layout.head, ["cat", f"{run_dir}/metrics.jsonl"])
    summary = json.loads(_on_head(layout.head, ["cat", f"{run_dir}/summary.json"]))
    return our_reports(stamped, metrics), summary["tokens_per_second"]


def _stock(layout: Cluster, config: str, run_dir: str) -> Reports:
    return stock_reports(_run(layout, stock_program(config, run_dir), run_dir))


def _remove(head: Node, run_dirs: Sequence[str]) -> None:
    remote.run_quietly(head, shlex.join(["rm", "-rf", *run_dirs]), timeout=120)


def compare(layout: Cluster, data: Path, model: Path, *, iters: int, rounds: int,
            settings: Mapping[str, Any] = SETTINGS, fine_tune_type: str = "lora") -> dict[str, Any]:
    """`rounds` of (ours, stock) on the layout's launcher with one config file of
    `fine_tune_type`: tokens/s of each over the steady window, their ratio, and the losses."""
    bounds = window(iters, settings["steps_per_report"])
    epoch = first_epoch_steps(train_examples(data), settings["batch_size"])
    head = layout.head
    placed = _put_inputs(layout, data, model)
    config = config_for(fine_tune_type, model=placed.model, data=placed.data, iters=iters, settings=settings)
    on_node = _put_config(head, config)
    when = results.stamp()
    per_round = []
    for index in range(rounds):
        ours_dir = f"{head.runs_dir}/bench-ours-{fine_tune_type}-{when}-{index}"
        stock_dir = f"{head.runs_dir}/bench-stock-{fine_tune_type}-{when}-{index}"
        try:
            print(f"==> overhead, {fine_tune_type}, round {index + 1} of {rounds}: ours", flush=True)
            ours, reported = _ours(layout, on_node, ours_dir)
            print(f"==> overhead, {fine_tune_type}, round {index + 1} of {rounds}: stock mlx_lm lora",
                  flush=True)
            stock = _stock(layout, on_node, stock_dir)
        finally:
            _remove(head, [ours_dir, stock_dir])
        per_round.append(compare_round(ours, stock, bounds, epoch, reported))
    return summarize(config, per_round, bounds, epoch)


def layers_for(model: Path, wanted: int = SETTINGS["num_layers"]) -> int:
    """`wanted` layers, or all of a smaller model's (mlx-lm refuses more than it has)."""
    layers = json.loads((model / "config.json").read_text()).get("num_hidden_layers", wanted)
    return min(wanted, int(layers))


def parse_types(text: str | None) -> list[str]:
    """--types: comma-separated fine-tune types (default: all three), each once."""
    if not text:
        return list(FINE_TUNE_TYPES)
    types = [part.strip() for part in text.split(",") if part.strip()]
    wrong = [t for t in types if t not in FINE_TUNE_TYPES]
    if wrong or not types or len(set(types)) != len(types):
        raise UserError(f"--types {text!r}: give some of {', '.join(FINE_TUNE_TYPES)}, comma-separated, "
                        "each once")
    return types


def result(*, inventory: str, node: str, model: Path, data: Path, iters: int, rounds: int,
           by_type: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """bench.overhead's JSON: each fine-tune type's figures, and the lines worth reading first."""
    return {"benchmark": "overhead", "date": results.date(), "inventory": inventory, "node": node,
            "model": str(model), "data": str(data), "host_cpus": os.cpu_count(), "iters": iters,
            "rounds": rounds, "target": TARGET, "loss_tolerance": LOSS_TOLERANCE,
            "ours_over_stock": {t: s["ours_over_stock"] for t, s in by_type.items()},
            "max_loss_difference_first_epoch": {t: s["max_loss_difference_first_epoch"]
                                                for t, s in by_type.items()},
            "types": dict(by_type)}


def run(rec: Recorded, *, iters: int = 40, rounds: int = 3, types: str | None = None,
        data: str | None = None, model: str | None = None, output: str | None = None) -> Path:
    """invoke bench.overhead: each fine-tune type compared on the inventory's launcher; the JSON."""
    chosen = parse_types(types)
    window(iters)  # refused before anything is sent
    layout = rec.cluster.only(rec.cluster.head)  # one process, with every core of the node
    data_dir, model_dir = inputs.resolve(rec.cluster, data, model)
    settings = {**SETTINGS, "num_layers": layers_for(model_dir)}
    shared = ["--batch-size", str(settings["batch_size"]), "--num-layers", str(settings["num_layers"]),
              "--max-seq-length", str(settings["max_seq_length"])]
    doctor.preflight(layout, room.largest(  # the heaviest of the types compared
        room.for_planned_run(layout, model_dir, data_dir, [*shared, "--fine-tune-type", t]) for t in chosen))
    by_type = {t: compare(layout, data_dir, model_dir, iters=iters, rounds=rounds, settings=settings,
                          fine_tune_type=t) for t in chosen}
    found = result(inventory=rec.inventory, node=layout.head.name, model=model_dir, data=data_dir,
                   iters=iters, rounds=rounds, by_type=by_type)
    out = results.write("overhead", found, output)
    for t, s in by_type.items():
        print(f"{t}: ours {s['ours_tokens_per_second']} tok/s, stock {s['stock_tokens_per_second']} tok/s, "
              f"ours/stock {s['ours_over_stock']} (target {TARGET}); max first-epoch loss difference "
              f"{s['max_loss_difference_first_epoch']}")
    print(f"wrote {out}")
    return out
