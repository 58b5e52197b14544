"""QLoRA in real training (a 4-bit tiny llama, uneven chat data, two local processes on MLX's ring
backend): two ranks at shares 3:1, one of them dequantizing at load, train one process's adapters on
the quantized weights; summary.json says each rank's base weights; a run resumes exactly; dora
trains on a quantized base too, and full is refused there unless every rank dequantizes."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest

from tests.unit import rings
from tests.unit.training.test_finetune import interrupted_copy, run_launcher, training_args
from tests.unit.training.test_shares_training import adapters, max_difference, uneven_baseline
from training import finetune as ft

PACKED = "4-bit affine, group 32"


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-bit tiny llama, uneven chat data, and one single-process QLoRA run over them."""
    return uneven_baseline(tmp_path_factory.mktemp("qlora"), quantized=True)


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def test_two_ranks_at_3_to_1_in_micro_batches_one_dequantizing_train_one_process_s_adapters(qlora_run: Path):
    root = qlora_run
    launch = rings.launch(2)
    # Rank 0 runs its 3 examples as 2 + 1 on the packed weights; rank 1 its 1 on float weights.
    extra = ["--expected-world-size", "2", "--batch-shares", "3,1", "--max-micro-batch", "2,1"]
    args = training_args(root / "model", root / "data", root / "two", *extra, "--dequantize-ranks", "1")
    result = run_launcher([*launch, sys.executable, "-m", "training.finetune", *args], timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr

    diff = max_difference(root / "single", root / "two")
    assert diff < 1e-4, diff
    assert max(abs(w).max().item() for w in adapters(root / "single").values()) > 1e-2  # they moved
    assert summary(root / "single")["base_weights_per_rank"] == [PACKED]
    said = summary(root / "two")["base_weights_per_rank"]
    assert said == [PACKED, f"dequantized from {PACKED}, to float32"]
    batch = summary(root / "two")["batch"]
    assert (batch["shares"], batch["micro_batches"]) == ([3, 1], 2)
    print(f"max abs difference, 1 process against 2 ranks at 3:1, rank 1 dequantized: {diff:.3g}")


def test_an_interrupted_qlora_run_resumes_to_the_adapters_of_an_uninterrupted_one(qlora_run: Path):
    root = qlora_run
    resumed = interrupted_copy(root / "single", root / "resumed", at_step=6)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert ft.main(training_args(root / "model", root / "data", resumed, "--resume"), environ={}) == 0
    assert f"resuming from {resumed}/checkpoints/0000006 (step 6 of 10)" in out.getvalue()
    diff = max_difference(root / "single", resumed)
    assert diff < 1e-6, diff


def test_dora_trains_on_a_quantized_base_and_full_only_on_dequantized_ranks(
    qlora_run: Path, capsys: pytest.CaptureFixture[str]
):
    root = qlora_run
    short = ("--iters", "2", "--steps-per-eval", "2", "--save-every", "2")
    assert (
        ft.main(
            training_args(root / "model", root / "data", root / "dora", *short, "--fine-tune-type", "dora"),
            environ={},
        )
        == 0
    )
    assert summary(root / "dora")["base_weights_per_rank"] == [PACKED]
    assert any(name.endswith(".m") for name in adapters(root / "dora"))  # DoRA's magnitudes

    assert (
        ft.main(
            training_args(root / "model", root / "data", root / "full", *short, "--fine-tune-type", "full"),
            environ={},
        )
        == 2
    )
    assert (
        f"error: fine_tune_type full on a quantized model ({PACKED}): mlx keeps a quantized layer's "
        "packed weights frozen"
    ) in capsys.readouterr().err
    assert (
        ft.main(
            training_args(
                root / "model",
                root / "data",
                root / "full",
                *short,
                "--fine-tune-type",
                "full",
                "--dequantize-ranks",
                "0",
            ),
            environ={},
        )
        == 0
    )
    assert summary(root / "full")["base_weights_per_rank"] == [f"dequantized from {PACKED}, to float32"]
    assert any(name.endswith("mlp.down_proj.weight") for name in adapters(root / "full"))
