"""training/examples: the smallest data-parallel program, on one process and on two ranks (ring)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.unit import rings
from training.examples import logistic_regression as lr

REPO = Path(__file__).resolve().parents[4]
MODULE = ["-m", "training.examples.logistic_regression"]


def test_shards_cover_the_data_set_once():
    x, y = lr.dataset(3)
    shards = [lr.shard(x, y, rank, 3) for rank in range(3)]
    assert sum(s[0].shape[0] for s in shards) == x.shape[0] == 12
    assert sorted(v for s in shards for v in s[1].tolist()) == sorted(y.tolist())


def test_one_process_learns_or():
    result = subprocess.run([sys.executable, *MODULE], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["accuracy"] == 1.0 and summary["world_size"] == 1


def test_two_ranks_end_with_the_weights_of_one_process():
    single = json.loads(subprocess.run([sys.executable, *MODULE, "--copies", "3"], cwd=REPO,
                                       capture_output=True, text=True, check=True).stdout)
    launch = rings.launch(2)
    result = subprocess.run([*launch, sys.executable, *MODULE, "--copies", "3"], cwd=REPO,
                            capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL)  # none of pytest's for the ranks
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # only rank 0 reports
    two = json.loads(lines[0])
    # 12 examples over 2 ranks: 6 each; the averaged gradient is the full-batch one.
    assert two["world_size"] == 2 and two["examples_on_rank_0"] == 6
    assert two["accuracy"] == 1.0
    assert two["max_weight_difference_across_ranks"] == 0.0
    assert max(abs(a - b) for a, b in zip(two["weights"], single["weights"], strict=True)) < 1e-4
