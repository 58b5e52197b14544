"""bench.train's overhead comparison (mlxcluster/bench/overhead.py): both programs really run here
(ours and stock `mlx_lm lora`, one process each, on a tiny model), and what is measured is read
from their real output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcluster.bench import overhead
from mlxcluster.errors import UserError
from tests.unit.training.model.test_folder import tiny_model
from training.data.prepare import prepare

REPO = Path(__file__).resolve().parents[4]
ITERS = 15  # reports at 5, 10, 15: the steady window is 5 -> 10
TINY = {**overhead.SETTINGS, "num_layers": 2, "max_seq_length": 256}  # the tiny llama's 2 layers


def stamped_run(argv: list[str]) -> list[tuple[float, str]]:
    """The program's output lines, each with the time it was read (as the relay stamps them)."""
    env = {**os.environ, "TTY_COMPATIBLE": "0", "HF_HUB_OFFLINE": "1", "OPENBLAS_NUM_THREADS": "1"}
    argv = [sys.executable, *argv[1:]] if argv[0] == "python" else argv
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return [(float(i), line) for i, line in enumerate(proc.stdout.splitlines())]


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("overhead")
    tiny_model(tmp / "tiny")
    prepare(REPO / "training/data/pirate.jsonl", tmp / "data")
    (tmp / "lora.yaml").write_text(f"lora_parameters: {overhead.LORA}\n")
    ours = overhead.ours_program(str(tmp / "tiny"), str(tmp / "data"), str(tmp / "ours"), ITERS, TINY)
    stock = overhead.stock_program(str(tmp / "tiny"), str(tmp / "data"), str(tmp / "stock"), ITERS,
                                   str(tmp / "lora.yaml"), TINY)
    return {"tmp": tmp, "ours": stamped_run(ours), "stock": stamped_run(stock)}


def test_both_runs_report_at_the_same_steps_and_train_on_the_same_batches(both):
    import json

    ours = overhead.report_times(both["ours"], stock=False)
    stock = overhead.report_times(both["stock"], stock=True)
    assert sorted(ours) == sorted(stock) == [5, 10, 15]
    records = [json.loads(line) for line in (both["tmp"] / "ours" / "metrics.jsonl").read_text().splitlines()]
    tokens = {r["iteration"]: r["trained_tokens"] for r in records if "train_loss" in r}
    # Same seed, same batches: stock prints the very token counts ours records, in thousands.
    for step in (5, 10, 15):
        assert abs(stock[step][1] * 1000 - tokens[step]) <= 50, (step, stock[step], tokens[step])
    result = overhead.compare_round(ours, stock, tokens, overhead.window(ITERS), 123.0)
    assert result["window_tokens"] == tokens[10] - tokens[5]
    assert result["ours_over_stock"] > 0


def test_the_window_leaves_out_the_first_steps_and_the_final_validation():
    assert overhead.window(40) == (5, 35)
    assert overhead.window(41) == (5, 40)
    with pytest.raises(UserError, match="at least 15 steps"):
        overhead.window(10)


def test_tokens_per_second_is_over_the_window_and_other_batches_are_refused():
    times = {5: (100.0, 0.5), 10: (110.0, 1.0), 15: (125.0, 1.5)}
    tokens = {5: 500, 10: 1000, 15: 1500}
    assert overhead.tokens_per_second(times, tokens, (5, 10)) == 50.0
    with pytest.raises(UserError, match="no report for step"):
        overhead.tokens_per_second({5: (1.0, None)}, tokens, (5, 10))
    other = {5: (100.0, 0.7), 10: (110.0, 1.2)}
    with pytest.raises(UserError, match="other batches"):
        overhead.compare_round(times, other, tokens, (5, 10), 1.0)
