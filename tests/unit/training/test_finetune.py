"""training.finetune: the command line, and real training of a tiny llama on one process and on two
(MLX ring backend, two local processes), interrupted and resumed."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load

from tests.unit import rings
from tests.unit.training.model.test_folder import tiny_model
from tests.unit.training.test_distributed import FakeGroup
from training import config as tc
from training import finetune as ft
from training import loading
from training.config_file import load_config_file
from training.loop import report

REPO = Path(__file__).resolve().parents[3]


# --- the command line -------------------------------------------------------------------------------


def test_main_stops_on_a_batch_the_ranks_cannot_share_before_loading_the_model(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    monkeypatch.setattr(ft, "init_distributed", lambda environ, expected: FakeGroup(0, 4))
    monkeypatch.setattr(loading, "load", lambda *a, **k: pytest.fail("the model was loaded"))

    assert ft.main(["--batch-size", "3"], environ={}) == 2
    assert (
        "rank 0: error: invalid settings: a global batch of 3 cannot give each of 4 ranks an example"
        in capsys.readouterr().err
    )


def test_main_reports_an_unknown_key_in_the_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    config = tmp_path / "my.yaml"
    config.write_text("iters: 3\nlearnig_rate: 1e-4\n")
    assert ft.main(["--config", str(config)], environ={}) == 2
    assert capsys.readouterr().err.startswith(f"error: {config}: unknown key 'learnig_rate' (did you mean")


# --- real training of a tiny llama --------------------------------------------------------------------


def chat(i: int) -> dict[str, Any]:
    # Every example the same length in tokens (the tokenizer is byte-level): mlx-lm averages the
    # ranks' per-token mean losses, which equals the global mean only when ranks see equal counts.
    return {
        "messages": [
            {"role": "user", "content": f"count {i:03d}"},
            {"role": "assistant", "content": f"answer {i * 7 % 1000:03d}"},
        ]
    }


def training_args(model: Path, data: Path, adapters: Path, *extra: str) -> list[str]:
    return [
        "--model", str(model), "--data", str(data), "--adapter-path", str(adapters),
        "--iters", "10", "--batch-size", "4", "--learning-rate", "1e-3", "--num-layers", "-1",
        "--steps-per-report", "2", "--steps-per-eval", "5", "--save-every", "5", "--val-batches", "-1",
        "--lora-dropout", "0", "--seed", "3", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny llama, chat data, and one single-process training run over them."""
    root = tmp_path_factory.mktemp("finetune")
    tiny_model(root / "model")
    (root / "data").mkdir()
    (root / "data" / "train.jsonl").write_text("".join(json.dumps(chat(i)) + "\n" for i in range(24)))
    (root / "data" / "valid.jsonl").write_text("".join(json.dumps(chat(i)) + "\n" for i in range(500, 508)))
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = ft.main(training_args(root / "model", root / "data", root / "single"), environ={})
    return {"root": root, "code": code, "stdout": stdout.getvalue()}


def test_single_process_training_lowers_the_loss_and_leaves_every_output(tiny_run: dict[str, Any]):
    root = tiny_run["root"]
    out = root / "single"
    assert tiny_run["code"] == 0

    assert {p.name for p in out.iterdir()} == {*ft.OUTPUT_FILES, "checkpoints"}
    # A checkpoint at the first report (every 2 steps) after every 5 steps, each whole: nothing
    # partial is left behind.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["0000006", "0000010"]
    for step in ("0000006", "0000010"):
        assert sorted(p.name for p in (out / "checkpoints" / step).iterdir()) == [
            "adapters.safetensors",
            "optimizer.safetensors",
            "state.json",
        ]
    last = mx.load(str(out / "checkpoints" / "0000010" / "adapters.safetensors"))
    final = mx.load(str(out / "adapters.safetensors"))
    assert isinstance(last, dict) and isinstance(final, dict)
    assert all(mx.array_equal(last[name], final[name]).item() for name in final)
    records = report.read_metrics(out / "metrics.jsonl")
    train = [r for r in records if "train_loss" in r]
    val = [r for r in records if "val_loss" in r]
    assert [r["iteration"] for r in train] == [2, 4, 6, 8, 10]
    assert [r["iteration"] for r in val] == [0, 4, 9, 10]  # mlx-lm validates before steps 1, 5, 10
    assert train[-1]["train_loss"] < train[0]["train_loss"] - 1
    assert val[-1]["val_loss"] < val[0]["val_loss"] - 1
    assert all(r["world_size"] == 1 for r in records)

    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_val_loss"] == val[-1]["val_loss"]
    assert summary["time_split"]["gradient_sync_estimate"] == 0.0  # one rank syncs nothing
    assert summary["world_size"] == 1 and summary["tokens_per_second"] > 0
    assert (out / "loss.png").read_bytes().startswith(b"\x89PNG")
    lines = tiny_run["stdout"].splitlines()
    assert "iter  2/10  loss " in tiny_run["stdout"] and lines[-1].startswith(
        "done: 10 iterations on 1 rank in "
    )

    # config.yaml runs the same again; adapter_config.json is what mlx-lm needs to load the adapters.
    again = tc.merge_config(load_config_file(out / "config.yaml"), {})
    assert (again.iters, again.seed, again.learning_rate, again.adapter_path) == (10, 3, 1e-3, str(out))
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert adapter_config["lora_parameters"] == {"rank": 8, "scale": 20.0, "dropout": 0.0}
    model, tokenizer = load(str(root / "model"), adapter_path=str(out))
    prompt = tokenizer.apply_chat_template(chat(500)["messages"][:1], add_generation_prompt=True)
    assert model(mx.array([prompt])).shape == (1, len(prompt), 260)


def test_training_resumes_from_saved_adapters(tiny_run: dict[str, Any], capsys: pytest.CaptureFixture[str]):
    root = tiny_run["root"]
    resumed = root / "resumed"
    extra = ["--iters", "2", "--resume-adapter-file", str(root / "single" / "adapters.safetensors")]
    with contextlib.redirect_stdout(io.StringIO()):
        assert ft.main(training_args(root / "model", root / "data", resumed, *extra), environ={}) == 0

    before = report.read_metrics(root / "single" / "metrics.jsonl")[-1]
    after = report.read_metrics(resumed / "metrics.jsonl")[0]
    assert after["iteration"] == 0
    assert after["val_loss"] == pytest.approx(before["val_loss"], abs=1e-5)

    misfit = training_args(root / "model", root / "data", root / "misfit", *extra, "--lora-rank", "4")
    with contextlib.redirect_stdout(io.StringIO()):
        assert ft.main(misfit, environ={}) == 2
    assert "adapters.safetensors does not fit (other lora_rank or num_layers?)" in capsys.readouterr().err
    assert not (root / "misfit").exists()


def run_launcher(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    # In its own process group: on a timeout the ranks go down with the launcher. Its own stdin:
    # a launcher may leave it non-blocking (mlx.launch did), and so pytest's and later ansible runs'.
    with subprocess.Popen(
        command,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            pytest.fail(f"{command[0]} timed out after {timeout} s:\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def test_two_ranks_train_the_same_adapters_as_one_process(tiny_run: dict[str, Any]):
    root = tiny_run["root"]
    launch = rings.launch(2)
    args = training_args(root / "model", root / "data", root / "two", "--expected-world-size", "2")
    result = run_launcher([*launch, sys.executable, "-m", "training.finetune", *args], timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr

    # Only rank 0 reports: one line per report, not two.
    assert result.stdout.count("iter  2/10  loss") == 1
    assert "done: 10 iterations on 2 ranks" in result.stdout
    single = mx.load(str(root / "single" / "adapters.safetensors"))
    two = mx.load(str(root / "two" / "adapters.safetensors"))
    assert isinstance(single, dict) and isinstance(two, dict)
    assert single.keys() == two.keys()
    diff = max(mx.abs(single[name] - two[name]).max().item() for name in single)
    assert diff < 1e-4, diff
    assert max(mx.abs(w).max().item() for w in single.values()) > 1e-2  # the adapters did move
    summary = json.loads((root / "two" / "summary.json").read_text())
    assert summary["world_size"] == 2
    split = summary["time_split"]
    assert split["model_load"] > 0 and split["training"] > 0 and split["evaluation"] > 0
    assert 0 < split["gradient_sync_estimate"] < split["training"]
    assert summary["final_train_loss"] == pytest.approx(
        json.loads((root / "single" / "summary.json").read_text())["final_train_loss"], abs=1e-4
    )
    print(f"max abs difference between the adapters of 1 and 2 ranks: {diff:.3g}")


def test_a_launch_with_fewer_ranks_than_expected_stops_every_rank(tiny_run: dict[str, Any]):
    root = tiny_run["root"]
    launch = rings.launch(2)
    args = training_args(root / "model", root / "data", root / "three", "--expected-world-size", "3")
    result = run_launcher([*launch, sys.executable, "-m", "training.finetune", *args], timeout=120)

    for rank in (0, 1):
        assert f"rank {rank}: MLX joined 2 process(es) but 3 were expected" in result.stderr
    # The launcher stops the others once one fails, and exits with its status (tests/unit/rings.py).
    assert result.returncode == 1, result.stderr[-2000:]
    assert not (root / "three").exists()


# --- checkpoints and --resume -------------------------------------------------------------------------


def max_difference(a: Path, b: Path) -> float:
    first, second = mx.load(str(a)), mx.load(str(b))
    assert isinstance(first, dict) and isinstance(second, dict) and first.keys() == second.keys()
    return max(mx.abs(first[name] - second[name]).max().item() for name in first)


def interrupted_copy(run: Path, to: Path, at_step: int) -> Path:
    """`run` as it was when a crash stopped it after its checkpoint at `at_step` (metrics went on)."""
    shutil.copytree(run, to)
    for later in (to / "checkpoints").iterdir():
        if int(later.name) > at_step:
            shutil.rmtree(later)
    shutil.copy(to / "checkpoints" / f"{at_step:07d}" / "adapters.safetensors", to / "adapters.safetensors")
    for name in ("summary.json", "loss.png"):
        (to / name).unlink()
    return to


def test_a_resumed_run_ends_with_the_adapters_of_an_uninterrupted_one(tiny_run: dict[str, Any]):
    root = tiny_run["root"]
    resumed = interrupted_copy(root / "single", root / "interrupted", at_step=6)
    # Validating every step on resume does not change what trains: the batch order is the seed's.
    args = training_args(root / "model", root / "data", resumed, "--resume", "--steps-per-eval", "1")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert ft.main(args, environ={}) == 0
    assert f"resuming from {resumed}/checkpoints/0000006 (step 6 of 10)" in stdout.getvalue()
    assert "iter  6/10  loss" not in stdout.getvalue()  # steps 1-6 are not trained again

    diff = max_difference(root / "single" / "adapters.safetensors", resumed / "adapters.safetensors")
    assert diff < 1e-6, diff
    print(f"max abs difference, resumed at step 6 vs uninterrupted: {diff:.3g}")
    # The metrics read as one run: the reports before the checkpoint, then the resumed ones.
    records = report.read_metrics(resumed / "metrics.jsonl")
    assert [r["iteration"] for r in records if "train_loss" in r] == [2, 4, 6, 8, 10]
    single = report.read_metrics(root / "single" / "metrics.jsonl")
    for mine, theirs in zip(
        [r for r in records if "train_loss" in r], [r for r in single if "train_loss" in r], strict=True
    ):
        assert mine["train_loss"] == pytest.approx(theirs["train_loss"], abs=1e-5)
        assert mine["trained_tokens"] == theirs["trained_tokens"]
        assert mine["learning_rate"] == pytest.approx(theirs["learning_rate"])
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["resumed_from_step"] == 6 and summary["iterations"] == 10
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["0000006", "0000010"]


def test_resume_refuses_a_checkpoint_made_with_other_settings_or_data(
    tiny_run: dict[str, Any], capsys: pytest.CaptureFixture[str]
):
    root = tiny_run["root"]
    run = interrupted_copy(root / "single", root / "other-settings", at_step=6)
    before = (run / "metrics.jsonl").read_bytes()
    args = training_args(root / "model", root / "data", run, "--resume", "--learning-rate", "2e-3")
    with contextlib.redirect_stdout(io.StringIO()):
        assert ft.main(args, environ={}) == 2
    err = capsys.readouterr().err
    assert f"cannot resume from {run}/checkpoints/0000006:" in err
    assert "learning_rate: the checkpoint was made with 0.001, this run has 0.002" in err
    assert (run / "metrics.jsonl").read_bytes() == before  # nothing of the run was touched

    other_data = root / "other-data"
    shutil.copytree(root / "data", other_data)
    with (other_data / "train.jsonl").open("a") as extra:
        extra.write(json.dumps(chat(999)) + "\n")
    with contextlib.redirect_stdout(io.StringIO()):
        assert ft.main(training_args(root / "model", other_data, run, "--resume"), environ={}) == 2
    assert "train.jsonl is not the file the run was trained on" in capsys.readouterr().err


def test_resume_without_a_checkpoint_starts_from_the_beginning(tiny_run: dict[str, Any]):
    root = tiny_run["root"]
    fresh = root / "never-saved"
    # A half-written checkpoint (its writer died before the rename) is not a checkpoint.
    (fresh / "checkpoints" / ".0000005.partial").mkdir(parents=True)
    (fresh / "checkpoints" / ".0000005.partial" / "adapters.safetensors").write_bytes(b"\0" * 10)
    args = training_args(root / "model", root / "data", fresh, "--resume", "--iters", "2")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert ft.main(args, environ={}) == 0
    assert "no checkpoint in" in stdout.getvalue() and "starting from step 0" in stdout.getvalue()
    assert json.loads((fresh / "summary.json").read_text())["resumed_from_step"] is None


def test_checkpoints_are_also_made_by_time(tiny_run: dict[str, Any]):
    """save_every_minutes: a checkpoint at the first report after that long since the last (here
    almost no time: every report), on top of save_every's (here none before the end)."""
    root = tiny_run["root"]
    by_time = root / "by-time"
    args = training_args(root / "model", root / "data", by_time, "--iters", "4", "--save-every", "100",
                         "--save-every-minutes", "0.00001")
    with contextlib.redirect_stdout(io.StringIO()):
        assert ft.main(args, environ={}) == 0
    assert sorted(p.name for p in (by_time / "checkpoints").iterdir()) == ["0000002", "0000004"]
    never = root / "by-steps"
    args = training_args(root / "model", root / "data", never, "--iters", "4", "--save-every", "100")
    with contextlib.redirect_stdout(io.StringIO()):
        assert ft.main(args, environ={}) == 0
    assert not (never / "checkpoints").exists() or not list((never / "checkpoints").iterdir())
