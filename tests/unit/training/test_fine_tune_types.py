"""Every fine-tune type (lora, dora, full) and every optimizer, as mlx_lm lora trains them (a tiny
llama, uneven chat data): stock `mlx_lm lora` and one process of ours train the same weights; two
ranks at shares 3:1 with micro-batches train one process's; an interrupted run resumes exactly
with any optimizer and gradient accumulation; the test split is evaluated; and stock
`mlx_lm generate` and `mlx_lm fuse` take what a run leaves."""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load

from tests.unit import rings
from tests.unit.training.test_finetune import interrupted_copy, run_launcher
from tests.unit.training.test_shares_training import adapters, max_difference
from training import finetune as ft

FINE_TUNE_TYPES = ("lora", "dora", "full")
OPTIMIZERS = ("adam", "adamw", "muon", "sgd", "adafactor")
# One epoch of the 24 training examples at batch 4: stock mlx-lm draws its next epoch's order from
# numpy's global RNG after its validations have drawn from it too; ours has its own.
ONE_EPOCH = 6


def args(root: Path, out: Path, *extra: str, data: Path | None = None) -> list[str]:
    return [
        "--model", str(root / "model"), "--data", str(data or root / "data"), "--adapter-path", str(out),
        "--iters", str(ONE_EPOCH), "--batch-size", "4", "--learning-rate", "1e-3", "--num-layers", "-1",
        "--steps-per-report", "2", "--steps-per-eval", "3", "--save-every", "4", "--val-batches", "-1",
        "--seed", "3", *extra,
    ]  # fmt: skip


def ours(root: Path, out: Path, *extra: str) -> str:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert ft.main(args(root, out, *extra), environ={}) == 0
    return stdout.getvalue()


def moved(a: Path, base: Path) -> float:
    """How far a full fine-tune moved the layers from the base model's weights."""
    trained = adapters(a)
    original = {name: value for name, value in mx.load(str(base / "model.safetensors")).items()
                if name in trained}
    return max(mx.abs(trained[name] - original[name]).max().item() for name in original)


@pytest.fixture(scope="module")
def runs(uneven_run: Path) -> Path:
    """For each fine-tune type, one process of ours over one epoch."""
    for kind in FINE_TUNE_TYPES:
        ours(uneven_run, uneven_run / f"one-{kind}", "--fine-tune-type", kind)
    return uneven_run


@pytest.mark.parametrize("kind", FINE_TUNE_TYPES)
def test_one_process_trains_the_weights_stock_mlx_lm_lora_trains(runs: Path, kind: str):
    stock = runs / f"stock-{kind}"
    result = subprocess.run([sys.executable, "-m", "mlx_lm", "lora", "--train", "--fine-tune-type", kind,
                             *args(runs, stock)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    diff = max_difference(runs / f"one-{kind}", stock)
    assert diff < 1e-4, diff
    if kind == "full":
        assert moved(stock, runs / "model") > 1e-3
    # The same final train loss, as mlx-lm reports it and as summary.json has it.
    summary = json.loads((runs / f"one-{kind}" / "summary.json").read_text())
    assert summary["fine_tune_type"] == kind
    print(f"{kind}: max abs difference, ours against stock mlx_lm lora: {diff:.3g}")


@pytest.mark.parametrize("kind", ["dora", "full"])  # lora: tests/unit/training/test_shares_training.py
def test_two_ranks_with_shares_and_micro_batches_train_one_process_s_weights(runs: Path, kind: str):
    launch = rings.launch(2)
    out = runs / f"two-{kind}"
    command = [*launch, sys.executable, "-m", "training.finetune",
               *args(runs, out, "--fine-tune-type", kind, "--expected-world-size", "2",
                     "--batch-shares", "3,1", "--max-micro-batch", "2,0")]
    result = run_launcher(command, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    diff = max_difference(runs / f"one-{kind}", out)
    assert diff < 1e-4, diff
    batch = json.loads((out / "summary.json").read_text())["batch"]
    assert batch["shares"] == [3, 1] and batch["micro_batches"] == 2
    print(f"{kind}: max abs difference, 2 ranks at 3:1 in micro-batches against 1 process: {diff:.3g}")


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_every_optimizer_resumes_exactly_with_gradient_accumulation(uneven_run: Path, optimizer: str):
    root = uneven_run
    settings = ("--optimizer", optimizer, "--grad-accumulation-steps", "2", "--iters", "10")
    whole = root / f"whole-{optimizer}"
    ours(root, whole, *settings)
    # Checkpoints at reports that end an update: 4 and 8 (every 4, each a multiple of 2).
    assert sorted(p.name for p in (whole / "checkpoints").iterdir()) == ["0000004", "0000008"]
    resumed = interrupted_copy(whole, root / f"resumed-{optimizer}", at_step=4)
    said = ours(root, resumed, *settings, "--resume")
    assert "resuming from" in said and "(step 4 of 10)" in said
    diff = max_difference(whole, resumed)
    assert diff < 1e-6, diff
    assert max(mx.abs(w).max().item() for w in adapters(whole).values()) > 1e-3


def test_gradient_accumulation_composes_with_shares_and_micro_batches_on_two_ranks(uneven_run: Path):
    """grad_accumulation_steps 2 on two ranks at shares 3:1 in micro-batches: the trainer accumulates
    2 x 2 micro-batches per update, and the weights are one process's with the same accumulation."""
    root = uneven_run
    settings = ("--optimizer", "adam", "--grad-accumulation-steps", "2", "--iters", "10")
    one = root / "accumulating-one"
    ours(root, one, *settings)
    two = root / "accumulating-two"
    launch = rings.launch(2)
    result = run_launcher([*launch, sys.executable, "-m", "training.finetune",
                           *args(root, two, *settings, "--expected-world-size", "2", "--batch-shares", "3,1",
                                 "--max-micro-batch", "2,0")], timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert max_difference(one, two) < 1e-4
    # Checkpoints only where an update ends, the same as one process's.
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["0000004", "0000008"]


def test_gradient_accumulation_means_what_it_means_in_mlx_lm(uneven_run: Path):
    """grad_accumulation_steps 2 at batch 2: an update every 2 iterations, on their 4 examples' mean
    gradient; iterations count batches, and the schedule counts updates."""
    root = uneven_run
    out = root / "accumulated"
    ours(root, out, "--optimizer", "sgd", "--batch-size", "2", "--grad-accumulation-steps", "2",
         "--lr-schedule", "{name: linear_schedule, arguments: [1.0e-3, 0.0, 4]}")
    stock = root / "stock-accumulated"
    result = subprocess.run([sys.executable, "-m", "mlx_lm", "lora", "--train", "--optimizer", "sgd",
                             *args(root, stock, "--batch-size", "2", "--grad-accumulation-steps", "2")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    # Stock mlx-lm takes lr_schedule from a config file only; ours as a flag too: compare as sgd at the
    # constant rate instead.
    constant = root / "accumulated-constant"
    ours(root, constant, "--optimizer", "sgd", "--batch-size", "2", "--grad-accumulation-steps", "2")
    assert max_difference(constant, stock) < 1e-4
    assert max_difference(out, constant) > 1e-6  # the schedule did change the updates


def test_the_test_split_is_evaluated_at_the_end_as_mlx_lm_does(uneven_run: Path):
    from tests.unit.training.test_shares_training import uneven

    root = uneven_run
    data = root / "with-test"
    data.mkdir()
    for name in ("train.jsonl", "valid.jsonl"):
        (data / name).write_text((root / "data" / name).read_text())
    (data / "test.jsonl").write_text("".join(json.dumps(uneven(i)) + "\n" for i in range(700, 712)))
    out = root / "tested"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert ft.main(args(root, out, "--test", "--test-batches", "-1", data=data), environ={}) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["test_loss"] > 0 and summary["test_ppl"] == pytest.approx(math.exp(summary["test_loss"]))
    assert f"Test loss {summary['test_loss']:.3f}, Test ppl {summary['test_ppl']:.3f}." in stdout.getvalue()
    stock = subprocess.run([sys.executable, "-m", "mlx_lm", "lora", "--test", "--data", str(data),
                            "--model", str(root / "model"), "--adapter-path", str(out),
                            "--test-batches", "-1", "--batch-size", "4"],
                           capture_output=True, text=True, timeout=300)
    assert stock.returncode == 0, stock.stdout + stock.stderr
    assert f"Test loss {summary['test_loss']:.3f}" in stock.stdout


def generate(model: Path, adapters: Path | None, prompt: str) -> str:
    command = [sys.executable, "-m", "mlx_lm", "generate", "--model", str(model), "--prompt", prompt,
               "--max-tokens", "8", "--temp", "0"]
    result = subprocess.run([*command, *(["--adapter-path", str(adapters)] if adapters else [])],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.split("==========")[1]  # the text, without the timings after it


@pytest.mark.parametrize("kind", FINE_TUNE_TYPES)
def test_stock_mlx_lm_generate_and_fuse_take_what_a_run_leaves(runs: Path, kind: str):
    run = runs / f"one-{kind}"
    config: dict[str, Any] = json.loads((run / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == kind and config["num_layers"] == -1
    lora = None if kind == "full" else {"rank": 8, "dropout": 0.0, "scale": 20.0}
    assert config["lora_parameters"] == lora
    fused = runs / f"fused-{kind}"
    result = subprocess.run([sys.executable, "-m", "mlx_lm", "fuse", "--model", str(runs / "model"),
                             "--adapter-path", str(run), "--save-path", str(fused)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    # The fused model computes what the base model with the run's weights computes.
    with_adapters, tokenizer = load(str(runs / "model"), adapter_path=str(run))
    alone, _ = load(str(fused))
    prompt = mx.array([tokenizer.encode("count 012")])
    assert mx.abs(with_adapters(prompt) - alone(prompt)).max().item() < 1e-3
    assert generate(runs / "model", run, "count 012") == generate(fused, None, "count 012")


def test_report_to_wandb_logs_the_run_s_reports_from_rank_0_only(runs: Path, offline: Path):
    """Two ranks with report_to wandb (offline): one wandb run, rank 0's, at metrics.jsonl's steps,
    with the final validation too."""
    from tests.unit.training.loop.test_reporting import wandb_history
    from training.loop import report

    launch = rings.launch(2)
    out = runs / "reported"
    result = run_launcher([*launch, sys.executable, "-m", "training.finetune",
                           *args(runs, out, "--expected-world-size", "2", "--report-to", "wandb")],
                          timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    run, rows = wandb_history(out)
    assert run.display_name == out.name
    metrics = report.read_metrics(out / "metrics.jsonl")
    train = {r["iteration"]: r["train_loss"] for r in metrics if "train_loss" in r}
    logged = {step: row["train_loss"] for step, row in rows.items() if "train_loss" in row}
    assert logged == pytest.approx(train)
    assert rows[ONE_EPOCH]["val_loss"] == pytest.approx(metrics[-1]["val_loss"])
    assert len(list(out.glob("wandb/offline-run-*"))) == 1  # rank 1 started none


def test_an_hf_dataset_folder_trains_what_the_same_rows_in_a_data_folder_train(
        runs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """hf_dataset with a local folder, read by mlx-lm with the datasets package: its chat rows under
    another key (chat_feature), its splits named by datasets' rules, the weights of one-lora's."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder = tmp_path / "pirate-hf"
    folder.mkdir()
    for name in ("train.jsonl", "valid.jsonl"):
        rows = [json.loads(line) for line in (runs / "data" / name).read_text().splitlines()]
        (folder / name).write_text("".join(json.dumps({"conversation": r["messages"]}) + "\n" for r in rows))
    entry = {"path": str(folder), "train_split": "train", "valid_split": "validation",
             "chat_feature": "conversation"}
    out = runs / "hf"
    ours(runs, out, "--hf-dataset", json.dumps(entry), "--data", str(tmp_path / "unused"))
    diff = max_difference(runs / "one-lora", out)
    assert diff < 1e-6, diff
    assert json.loads((out / "adapter_config.json").read_text())["hf_dataset"] == entry
    # A resume checks the dataset's files, not a train.jsonl the run never read.
    resumed = interrupted_copy(out, runs / "hf-resumed", at_step=4)
    (folder / "valid.jsonl").write_text("".join((folder / "valid.jsonl").read_text().splitlines(True)[:-1]))
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()) as err:
        code = ft.main(args(runs, resumed, "--resume", "--hf-dataset", json.dumps(entry)), environ={})
    assert code == 2 and "hf_dataset's files are not the ones the run was trained on" in err.getvalue()
