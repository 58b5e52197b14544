"""Read a fine-tuning run's metrics.jsonl: summary numbers, where the time went, the loss plot.

    python -m training.loop.report ADAPTER_DIR [--output loss.png]

`training.finetune` does both at the end of a run (rank 0); this command redraws the plot from the
metrics file, e.g. on the controller once the run's files are back, or while a run is going.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

METRICS = "metrics.jsonl"
PLOT = "loss.png"


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file, in order (blank lines skipped)."""
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ValueError(f"line {number}: not JSON ({error.msg})") from None
    return records


def loss_series(records: Iterable[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Iterations and values of the records that hold `key` (train_loss or val_loss)."""
    pairs = [(int(r["iteration"]), float(r[key])) for r in records if key in r]
    return [i for i, _ in pairs], [v for _, v in pairs]


def world_sizes(records: Sequence[Mapping[str, Any]]) -> list[int]:
    """The numbers of ranks a run trained on, in order (one, unless it went on without a node)."""
    sizes: list[int] = []
    for record in records:
        if (size := record.get("world_size", 1)) not in sizes[-1:]:
            sizes.append(size)
    return sizes or [1]


def summarize(records: Sequence[Mapping[str, Any]], wall_time: float) -> dict[str, Any]:
    """The numbers a run ends with: losses, throughput, memory, ranks.

    Throughput excludes validation time; `tokens_per_second` also leaves out the first report,
    whose steps include compiling the kernels; `tokens_per_second_overall` keeps it.
    """
    train = [r for r in records if "train_loss" in r]
    val = [r for r in records if "val_loss" in r]
    train_time = sum(r.get("train_time", 0.0) for r in train)
    trained_tokens = train[-1]["trained_tokens"] if train else 0
    # The first report's steps include compiling the kernels (tens of seconds on a cold CPU cache).
    steady = train[1:] if len(train) > 1 else train
    steady_time = sum(r.get("train_time", 0.0) for r in steady)
    steady_tokens = trained_tokens - (train[0]["trained_tokens"] if len(train) > 1 else 0)
    steady_steps = (train[-1]["iteration"] - (train[0]["iteration"] if len(train) > 1 else 0)) if train else 0
    return {
        "iterations": train[-1]["iteration"] if train else 0,
        # The ranks it ended on; a run that went on without a node has had more than one number.
        "world_size": records[-1]["world_size"] if records else 1,
        "world_sizes": world_sizes(records),
        "first_train_loss": train[0]["train_loss"] if train else None,
        "final_train_loss": train[-1]["train_loss"] if train else None,
        "first_val_loss": val[0]["val_loss"] if val else None,
        "final_val_loss": val[-1]["val_loss"] if val else None,
        "trained_tokens": trained_tokens,
        "train_time": train_time,
        "tokens_per_second": steady_tokens / steady_time if steady_time > 0 else 0.0,
        "tokens_per_second_overall": trained_tokens / train_time if train_time > 0 else 0.0,
        # A step's seconds past the first report, as tokens_per_second counts them (None: no step).
        "step_seconds": steady_time / steady_steps if steady_steps > 0 and steady_time > 0 else None,
        "peak_memory_gb": max((r["peak_memory_gb"] for r in records), default=0.0),
        "wall_time": wall_time,
    }


def time_split(
    records: Sequence[Mapping[str, Any]], model_load: float, sync_per_step: float, steps: int
) -> dict[str, float]:
    """Where rank 0's time went: loading, training steps, validation, and of the training the
    estimated share of the gradient all-reduce (the one timed alone, times the steps)."""
    return {
        "model_load": model_load,
        "training": sum(r.get("train_time", 0.0) for r in records if "train_loss" in r),
        "evaluation": sum(r.get("val_time", 0.0) for r in records if "val_loss" in r),
        "gradient_sync_estimate": sync_per_step * steps,
    }


def batch_split(
    shares: Sequence[int], micro_batches: int, rank_tokens: Sequence[int], tokens_per_second: float | None,
    limits: Sequence[int] = (),
) -> dict[str, Any]:
    """How the global batches were shared: each rank's examples per step, the most it ran at once
    (max_micro_batch, "no limit" where none), and its part of the tokens and of the run's tokens/s
    (its tokens over the same training time)."""
    total = sum(rank_tokens)
    caps = list(limits) or [0] * len(shares)
    return {
        "shares": list(shares),
        "micro_batches": micro_batches,
        "ranks": [
            {
                "rank": rank,
                "examples_per_step": share,
                "max_micro_batch": cap or "no limit",
                "trained_tokens": tokens,
                "tokens_per_second": (tokens_per_second or 0.0) * tokens / total if total else 0.0,
            }
            for rank, (share, tokens, cap) in enumerate(zip(shares, rank_tokens, caps, strict=True))
        ],
    }


def plot_losses(records: Sequence[Mapping[str, Any]], output: Path, title: str | None = None) -> Path:
    """Draw train and validation loss against the iteration into a PNG file."""
    # The object API draws with Agg without touching pyplot's global backend and figure state.
    from matplotlib.figure import Figure

    train_x, train_y = loss_series(records, "train_loss")
    val_x, val_y = loss_series(records, "val_loss")
    if not train_x and not val_x:
        raise ValueError("no train_loss or val_loss records to plot")
    if title is None:
        sizes = world_sizes(records)
        title = f"LoRA fine-tuning on {' then '.join(map(str, sizes))} rank{'s' if sizes != [1] else ''}"
    figure = Figure(figsize=(7, 4.2), layout="constrained")
    axes = figure.add_subplot()
    if train_x:
        axes.plot(train_x, train_y, label="train", color="tab:blue")
    if val_x:
        axes.plot(val_x, val_y, label="validation", color="tab:orange", marker="o")
    axes.set_xlabel("iteration")
    axes.set_ylabel("loss")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=120, format="png")
    return output


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m training.loop.report", description="Plot the train/val loss of a fine-tuning run."
    )
    parser.add_argument("run", type=Path, help=f"the run's adapter directory (or its {METRICS})")
    parser.add_argument("--output", type=Path, help=f"the PNG to write (default: {PLOT} next to the metrics)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    metrics = args.run / METRICS if args.run.is_dir() else args.run
    try:
        records = read_metrics(metrics)
        output = plot_losses(records, args.output or metrics.parent / PLOT)
    except FileNotFoundError:
        print(f"error: {metrics}: no such file", file=sys.stderr)
        return 2
    except ValueError as error:
        print(f"error: {metrics}: {error}", file=sys.stderr)
        return 2
    print(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
