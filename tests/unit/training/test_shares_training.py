"""Batch shares in real training (a tiny llama, two local processes on MLX's ring backend): ranks
with shares 3:1 on examples of different lengths, and micro-batches, train the adapters of one
process on the same global batches."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from tests.unit import rings
from tests.unit.training.model.test_folder import tiny_model
from tests.unit.training.test_finetune import run_launcher, training_args
from training import finetune as ft
from training.loop import report


def uneven(i: int) -> dict[str, Any]:
    """Chat examples from 20 to over 100 tokens: the ranks' token counts differ in every batch."""
    return {
        "messages": [
            {"role": "user", "content": f"count {i:03d} " + "and more " * (i % 7) * 2},
            {"role": "assistant", "content": f"answer {i * 7 % 1000:03d}" + " yes" * (i % 5)},
        ]
    }


def uneven_inputs(root: Path, **model: Any) -> Path:
    """Under `root`: a tiny llama (tiny_model's `model` changes, e.g. quantized=True) and uneven chat
    data, 24 train and 8 valid examples."""
    tiny_model(root / "model", **model)
    (root / "data").mkdir()
    for name, examples in (("train", range(24)), ("valid", range(500, 508))):
        (root / "data" / f"{name}.jsonl").write_text("".join(json.dumps(uneven(i)) + "\n" for i in examples))
    return root


def uneven_baseline(root: Path, **model: Any) -> Path:
    """uneven_inputs and one single-process run over them in root/single (global batch 4): the
    baseline that runs on several ranks must match."""
    uneven_inputs(root, **model)
    with contextlib.redirect_stdout(io.StringIO()):
        assert ft.main(training_args(root / "model", root / "data", root / "single"), environ={}) == 0
    return root


def adapters(run: Path) -> dict[str, mx.array]:
    loaded = mx.load(str(run / "adapters.safetensors"))
    assert isinstance(loaded, dict)
    return loaded


def max_difference(a: Path, b: Path) -> float:
    first, second = adapters(a), adapters(b)
    assert first.keys() == second.keys()
    return max(mx.abs(first[name] - second[name]).max().item() for name in first)


def losses(run: Path, key: str) -> list[float]:
    return [r[key] for r in report.read_metrics(run / "metrics.jsonl") if key in r]


def test_two_ranks_with_shares_3_to_1_train_the_adapters_of_one_process(uneven_run: Path):
    root = uneven_run
    launch = rings.launch(2)
    args = training_args(root / "model", root / "data", root / "shares", "--expected-world-size", "2",
                         "--batch-shares", "3,1")
    result = run_launcher([*launch, sys.executable, "-m", "training.finetune", *args], timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr

    diff = max_difference(root / "single", root / "shares")
    assert diff < 1e-4, diff
    assert max(mx.abs(w).max().item() for w in adapters(root / "single").values()) > 1e-2  # they moved
    # The losses agree report by report: the reported loss is the global batch's token mean.
    for key in ("train_loss", "val_loss"):
        assert losses(root / "shares", key) == pytest.approx(losses(root / "single", key), abs=1e-4)
    # summary.json records the shares and each rank's part of the tokens and of the tokens/s.
    batch = json.loads((root / "shares" / "summary.json").read_text())["batch"]
    assert batch["shares"] == [3, 1] and batch["micro_batches"] == 1
    first, second = batch["ranks"]
    assert (first["examples_per_step"], second["examples_per_step"]) == (3, 1)
    assert first["trained_tokens"] > 2 * second["trained_tokens"] > 0
    single = json.loads((root / "single" / "summary.json").read_text())["batch"]
    assert first["trained_tokens"] + second["trained_tokens"] == single["ranks"][0]["trained_tokens"]
    assert first["tokens_per_second"] > second["tokens_per_second"] > 0
    print(f"max abs difference, 1 process against 2 ranks at 3:1: {diff:.3g}")


@pytest.fixture(scope="module")
def micro_run(uneven_run: Path) -> str:
    """The single-process run again, one example at a time (4 micro-batches a step); its output."""
    root = uneven_run
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = ft.main(training_args(root / "model", root / "data", root / "micro", "--max-micro-batch", "1"),
                       environ={})
    assert code == 0
    return out.getvalue()


def test_micro_batches_train_the_adapters_of_the_whole_batch_at_once(uneven_run: Path, micro_run: str):
    root = uneven_run
    diff = max_difference(root / "single", root / "micro")
    assert diff < 1e-4, diff
    # Reports, validations and checkpoints come at the same steps as without micro-batches.
    single, micro = (report.read_metrics(root / run / "metrics.jsonl") for run in ("single", "micro"))
    assert [r["iteration"] for r in micro] == [r["iteration"] for r in single]
    for key in ("train_loss", "val_loss"):
        assert losses(root / "micro", key) == pytest.approx(losses(root / "single", key), abs=1e-4)
    assert sorted(p.name for p in (root / "micro" / "checkpoints").iterdir()) == ["0000006", "0000010"]
    assert "iter  2/10  loss " in micro_run and "done: 10 iterations on 1 rank" in micro_run


def test_shares_and_micro_batches_together_on_two_ranks(uneven_run: Path):
    root = uneven_run
    launch = rings.launch(2)
    # Rank 1 holds one example at a time: its 1 example in the first micro-batch, none in the
    # second, while rank 0 runs its 3 as 2 + 1.
    args = training_args(root / "model", root / "data", root / "both", "--expected-world-size", "2",
                         "--batch-shares", "3,1", "--max-micro-batch", "2,1")
    result = run_launcher([*launch, sys.executable, "-m", "training.finetune", *args], timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    diff = max_difference(root / "single", root / "both")
    assert diff < 1e-4, diff


def test_a_run_in_micro_batches_resumes_to_the_adapters_of_an_uninterrupted_one(uneven_run: Path,
                                                                               micro_run: str):
    from tests.unit.training.test_finetune import interrupted_copy

    root = uneven_run
    resumed = interrupted_copy(root / "micro", root / "micro-resumed", at_step=6)
    args = training_args(root / "model", root / "data", resumed, "--resume", "--max-micro-batch", "1")
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert ft.main(args, environ={}) == 0
    assert f"resuming from {resumed}/checkpoints/0000006 (step 6 of 10)" in out.getvalue()
    diff = max_difference(root / "micro", resumed)
    assert diff < 1e-6, diff
    assert [r["iteration"] for r in report.read_metrics(resumed / "metrics.jsonl") if "train_loss" in r] == [
        2, 4, 6, 8, 10]
