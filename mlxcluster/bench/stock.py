"""Stock `mlx_lm lora` as one process beside bench.scaling's runs: the same model, data and
settings, its tokens/s and its peak memory, as a row of the scaling report.

It runs as bench.overhead runs stock (mlxcluster/bench/overhead.py: the inputs put where invoke
train puts them, one config file of mlx-lm's keys, one process started by the launch builder, its
report lines stamped as they arrive), with one addition: mlx-lm 0.32's report lines carry no
memory figure (its TrainUI prints iteration, loss, tok/s and tokens; the peak goes only to
callbacks), so the process prints mlx's peak memory as it exits (`PEAK_AT_EXIT`). That is the
figure our ranks put in summary.json (mx.get_peak_memory() after the run), so the two compare.

Its tokens/s is counted on the clock our summary.json's is: mlx-lm's own, inside the steps, from
the first report (whose steps include compiling) to the last, with no validation. The arrival
clock over overhead's steady window, which also holds the time around the steps, is kept beside it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mlxcluster.bench import overhead, results
from mlxcluster.describe.cluster import Cluster
from mlxcluster.errors import UserError
from training.config import FinetuneConfig

PROGRAM = "mlx_lm lora"

# mlx-lm's entry point (`python -m mlx_lm lora ...`), untouched, with mlx's peak memory printed at
# exit. One line: the launcher finds the process again by its command line (builder.stop_command).
PEAK_AT_EXIT = (
    "import atexit, sys; import mlx.core as mx; "
    "atexit.register(lambda: print(f'peak memory {mx.get_peak_memory() / 1e9:.4f} GB', flush=True)); "
    "from mlx_lm import cli; sys.argv[0] = 'mlx_lm'; cli.main()"
)
_PEAK = re.compile(r"^peak memory (\d+(?:\.\d+)?) GB$")

# Settings of ours that mlx-lm reads too and that change speed or memory, beyond overhead's.
_MORE_KEYS = ("fine_tune_type", "optimizer", "grad_checkpoint", "grad_accumulation_steps", "mask_prompt")


def program(config: str, adapter_path: str) -> list[str]:
    """overhead's stock command line, run through PEAK_AT_EXIT: `python -c ... lora --config ...`."""
    stock = overhead.stock_program(config, adapter_path)
    if stock[:3] != ["python", "-m", "mlx_lm"]:
        raise ValueError(f"stock's command line is no longer python -m mlx_lm: {stock}")
    return ["python", "-c", PEAK_AT_EXIT, *stock[3:]]


def settings_for(ours: FinetuneConfig, model: Path) -> dict[str, Any]:
    """What stock trains with: our runs' values of overhead's mlx-lm settings and of a few more,
    with num_layers capped to the model's layers (mlx-lm refuses more than it has)."""
    found = {key: getattr(ours, key) for key in (*overhead.SETTINGS, *_MORE_KEYS)}
    if ours.num_layers > 0:
        found["num_layers"] = overhead.layers_for(model, ours.num_layers)
    return found


def peak_memory_gb(stamped: Sequence[tuple[float, str]]) -> float:
    """The peak memory PEAK_AT_EXIT printed (GB)."""
    for _, line in reversed(overhead._lines(stamped)):
        if match := _PEAK.match(line.strip()):
            return float(match[1])
    raise UserError("stock mlx_lm lora printed no peak memory as it exited: see its output above")


def tokens_per_second_in_steps(reports: overhead.Reports) -> float:
    """Tokens after the first report over mlx-lm's time inside their steps: summary.json's
    tokens_per_second, measured the same way for stock."""
    steps = sorted(reports.tokens)
    if len(steps) < 2:
        raise UserError(f"stock mlx_lm lora reported at steps {steps}: at least two reports are needed")
    bounds = (steps[0], steps[-1])
    seconds = overhead.seconds_in_steps(reports.speeds, reports.tokens, bounds)
    return (reports.tokens[bounds[1]] - reports.tokens[bounds[0]]) / seconds


def row(stamped: Sequence[tuple[float, str]], *, iters: int, steps_per_report: int,
        base_weights: str | None) -> dict[str, Any]:
    """Stock's row of the scaling report, from its stamped output: one rank on one node."""
    reports = overhead.stock_reports(stamped)
    if not reports.losses:
        raise UserError("stock mlx_lm lora printed no train report: see its output above")
    window = overhead.tokens_per_second(reports.arrived, reports.tokens,
                                        overhead.window(iters, steps_per_report))
    last = max(reports.losses)
    return {"program": PROGRAM, "nodes": 1, "ranks": 1, "parallel": None, "wall_time_s": None,
            "tokens_per_second": round(tokens_per_second_in_steps(reports), 1),
            "tokens_per_second_window": round(window, 1),
            "iterations": last, "final_train_loss": reports.losses[last],
            "time_split_s": None, "gradient_sync_estimate_s": None,
            "peak_memory_gb_per_rank": [round(peak_memory_gb(stamped), 4)],
            "base_weights": [base_weights] if base_weights else None}


def measure(layout: Cluster, data: Path, model: Path, *, iters: int, settings: Mapping[str, Any],
            base_weights: str | None) -> dict[str, Any]:
    """Stock on the layout's one node with `settings`: its row. Its folder there is removed once
    read (overhead's runs are, too)."""
    head = layout.head
    placed = overhead._put_inputs(layout, data, model)
    config = overhead.config_for(settings["fine_tune_type"], model=placed.model, data=placed.data,
                                 iters=iters, settings=settings)
    on_node = overhead._put_config(head, config)
    run_dir = f"{head.runs_dir}/bench-scaling-stock-{results.stamp()}"
    print(f"==> scaling: stock {PROGRAM}, {iters} steps of batch {settings['batch_size']} as one "
          f"process on {head.name}", flush=True)
    try:
        stamped = overhead._run(layout, program(on_node, run_dir), run_dir)
    finally:
        overhead._remove(head, [run_dir])
    return row(stamped, iters=iters, steps_per_report=settings["steps_per_report"],
               base_weights=base_weights)
