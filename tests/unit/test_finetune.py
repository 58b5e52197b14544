"""training.finetune and training.report: settings, the distributed start, metrics, plot, and real
training of a tiny llama on one process and on two (MLX ring backend, two local processes)."""

from __future__ import annotations

import contextlib
import dataclasses
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
import yaml
from mlx_lm import load
from mlx_lm.tuner.utils import build_schedule
from rich.console import Console

from tests.unit.test_model import tiny_model
from training import finetune as ft
from training import report

REPO = Path(__file__).resolve().parents[2]


class FakeGroup:
    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


# --- settings ---------------------------------------------------------------------------------------


def test_shipped_lora_yaml_holds_every_default_each_with_a_comment():
    text = ft.DEFAULT_CONFIG.read_text()
    assert yaml.safe_load(text) == dataclasses.asdict(ft.FinetuneConfig())
    lines = text.splitlines()
    for number, line in enumerate(lines):
        if line and not line.startswith(("#", " ")):
            assert lines[number - 1].startswith("#"), f"{line.split(':')[0]} has no comment above it"


def test_command_line_wins_over_the_file_which_wins_over_the_defaults():
    args = ft.build_parser().parse_args(["--iters", "7", "--grad-checkpoint", "--learning-rate", "3e-4"])
    config = ft.merge_config({"iters": 50, "batch_size": 8, "grad_checkpoint": False}, ft.cli_values(args))

    assert (config.iters, config.batch_size, config.grad_checkpoint) == (7, 8, True)
    assert config.learning_rate == 3e-4
    assert config.lora_rank == ft.FinetuneConfig().lora_rank
    assert ft.cli_values(ft.build_parser().parse_args([])) == {}
    assert ft.cli_values(ft.build_parser().parse_args(["--no-mask-prompt"])) == {"mask_prompt": False}


def test_unknown_key_in_the_file_is_an_error_naming_it():
    with pytest.raises(
        ft.ConfigError, match=r"lora.yaml: unknown key 'lora_rnk' \(did you mean 'lora_rank'\?\)"
    ):
        ft.merge_config({"lora_rnk": 4, "iters": 3}, {}, source="lora.yaml")


def test_values_are_checked_against_their_types():
    # PyYAML reads 1e-5 without a dot as a string; a learning rate may still be written so.
    assert ft.merge_config(yaml.safe_load("learning_rate: 1e-5"), {}).learning_rate == 1e-5
    assert ft.merge_config({"resume_adapter_file": None}, {}).resume_adapter_file is None
    with pytest.raises(ft.ConfigError, match=r"my\.yaml: iters must be an integer, got 'ten'"):
        ft.merge_config({"iters": "ten"}, {}, source="my.yaml")
    with pytest.raises(ft.ConfigError, match="grad_checkpoint must be true or false, got 'yes please'"):
        ft.merge_config({"grad_checkpoint": "yes please"}, {})
    with pytest.raises(ft.ConfigError, match="batch_size must be an integer, got True"):
        ft.merge_config({"batch_size": True}, {})


def test_global_batch_must_be_divisible_by_the_world_size():
    config = ft.FinetuneConfig(batch_size=6)
    ft.validate_config(config, world_size=3)
    with pytest.raises(ft.ConfigError, match=r"batch_size 6 is not divisible by the world size 4.*e\.g\. 8"):
        ft.validate_config(config, world_size=4)


def test_every_problem_is_reported_at_once():
    config = ft.FinetuneConfig(
        iters=10, warmup_steps=10, lora_dropout=1.0, lr_schedule="linear", num_layers=0, learning_rate=0
    )
    problems = ft.config_problems(config)
    assert [p.split()[0] for p in problems] == [
        "num_layers",
        "learning_rate",
        "lr_schedule",
        "warmup_steps",
        "lora_dropout",
    ]
    assert ft.config_problems(ft.FinetuneConfig()) == []


def test_learning_rate_schedules():
    assert ft.lr_schedule_config(ft.FinetuneConfig(learning_rate=1e-3)) is None

    cosine = build_schedule(
        ft.lr_schedule_config(
            ft.FinetuneConfig(learning_rate=1e-3, lr_schedule="cosine", iters=110, warmup_steps=10)
        )
    )
    assert cosine(0).item() == 0
    assert cosine(10).item() == pytest.approx(1e-3)
    assert cosine(60).item() == pytest.approx(5e-4, rel=0.05)
    assert cosine(110).item() < 1e-3 / 1000

    warm_then_constant = build_schedule(
        ft.lr_schedule_config(ft.FinetuneConfig(learning_rate=1e-3, warmup_steps=4))
    )
    assert [round(warm_then_constant(step).item(), 6) for step in (0, 2, 4, 50)] == [0, 5e-4, 1e-3, 1e-3]


# --- distributed start -------------------------------------------------------------------------------


def test_world_size_check_names_both_numbers_and_the_likely_cause():
    assert ft.world_size_problem(FakeGroup(0, 2), 2) is None
    assert ft.world_size_problem(FakeGroup(0, 1), None) is None

    alone = ft.world_size_problem(FakeGroup(0, 1), 3)
    assert alone is not None
    assert "rank 0: MLX joined 1 process(es) but 3 were expected" in alone
    assert "MLX_MPI_LIBNAME" in alone
    fewer = ft.world_size_problem(FakeGroup(1, 2), 3)
    assert fewer is not None and "rank 1: MLX joined 2 process(es) but 3" in fewer and "hostfile" in fewer
    with pytest.raises(ft.DistributedError, match="but 3 were expected"):
        ft.check_world_size(FakeGroup(0, 2), 3)


def test_launchers_are_told_apart_by_the_environment_they_set(tmp_path: Path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(json.dumps([["10.0.0.1:5000"], ["10.0.0.2:5000"], ["10.0.0.3:5000"]]))
    single = tmp_path / "single"
    single.write_text("\n")

    assert ft.detect_launch({}) is None
    assert ft.detect_launch({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "0"}) == ft.Launch("mpi", 4)
    assert ft.detect_launch({"MLX_RANK": "1", "MLX_HOSTFILE": str(hostfile)}) == ft.Launch("ring", 3)
    assert ft.detect_launch({"MLX_RANK": "0", "MLX_HOSTFILE": str(single)}) == ft.Launch("ring", 1)


class FakeInit:
    def __init__(self, group: FakeGroup | None = None, error: str | None = None):
        self.group, self.error, self.calls = group, error, []

    def __call__(self, **kwargs: Any) -> FakeGroup:
        self.calls.append(kwargs)
        if self.error:
            raise RuntimeError(self.error)
        assert self.group is not None
        return self.group


def test_init_is_strict_under_a_launcher_and_checks_the_size():
    mpi = {"OMPI_COMM_WORLD_SIZE": "2"}
    init = FakeInit(FakeGroup(1, 2))
    assert ft.init_distributed(mpi, 2, init=init).size() == 2
    assert init.calls == [{"strict": True, "backend": "mpi"}]

    # The launcher's own count is expected when the launch code does not say.
    with pytest.raises(
        ft.DistributedError, match=r"MLX joined 1 process.* but 2 were expected \(the ranks mpi started\)"
    ):
        ft.init_distributed(mpi, None, init=FakeInit(FakeGroup(0, 1)))
    with pytest.raises(
        ft.DistributedError, match=r"could not join the 2 ranks mpi started: Cannot init.*libmpi"
    ):
        ft.init_distributed(mpi, 2, init=FakeInit(error="Cannot initialize MPI"))


def test_without_a_launcher_a_single_process_unless_more_are_expected():
    init = FakeInit(FakeGroup(0, 1))
    assert ft.init_distributed({}, None, init=init).size() == 1
    assert ft.init_distributed({}, 1, init=init).size() == 1
    assert init.calls == [{}, {}]
    with pytest.raises(ft.DistributedError, match=r"1 process.* but 2 were expected.*not started by mpirun"):
        ft.init_distributed({}, 2, init=init)


def test_main_stops_on_a_batch_the_ranks_cannot_share_before_loading_the_model(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    monkeypatch.setattr(ft, "init_distributed", lambda environ, expected: FakeGroup(0, 4))
    monkeypatch.setattr(ft, "load", lambda *a, **k: pytest.fail("the model was loaded"))

    assert ft.main(["--batch-size", "6"], environ={}) == 2
    assert "rank 0: error: invalid settings:\n  batch_size 6 is not divisible by the world size 4" in (
        capsys.readouterr().err
    )


def test_main_reports_an_unknown_key_in_the_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    config = tmp_path / "my.yaml"
    config.write_text("iters: 3\nlearnig_rate: 1e-4\n")
    assert ft.main(["--config", str(config)], environ={}) == 2
    assert capsys.readouterr().err.startswith(f"error: {config}: unknown key 'learnig_rate' (did you mean")


# --- metrics and progress ----------------------------------------------------------------------------


def train_info(iteration: int, loss: float, tokens: int) -> dict[str, Any]:
    # As mlx-lm reports it, with its tokens/s over the steps since the last report.
    return {
        "iteration": iteration,
        "train_loss": loss,
        "learning_rate": 1e-4,
        "iterations_per_second": 5.0,
        "tokens_per_second": 1000.0,
        "trained_tokens": tokens,
        "peak_memory": 1.5,
    }


def report_a_run(callback: ft.MetricsCallback) -> None:
    callback.on_val_loss_report({"iteration": 0, "val_loss": 3.0, "val_time": 0.5})
    callback.on_train_loss_report(train_info(10, 2.5, 2000))
    callback.on_train_loss_report(train_info(15, 2.0, 3000))  # a last, shorter report
    callback.on_val_loss_report({"iteration": 15, "val_loss": 2.2, "val_time": 0.4})


def test_rank_0_writes_one_json_line_per_report(tmp_path: Path):
    ticks = iter([100.0, 101.0, 102.0, 103.0, 104.0])
    callback = ft.MetricsCallback(
        FakeGroup(0, 2),
        tmp_path / "run" / "metrics.jsonl",
        clock=lambda: next(ticks),
        peak_memory_gb=lambda: 1.25,
    )
    report_a_run(callback)

    records = report.read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert records == callback.records
    assert [(r["iteration"], "val_loss" in r) for r in records] == [
        (0, True),
        (10, False),
        (15, False),
        (15, True),
    ]
    assert records[0] == {
        "iteration": 0,
        "val_loss": 3.0,
        "val_time": 0.5,
        "peak_memory_gb": 1.25,
        "world_size": 2,
        "wall_time": 1.0,
    }
    assert records[2] == {
        "iteration": 15,
        "train_loss": 2.0,
        "learning_rate": 1e-4,
        "tokens_per_second": 1000.0,
        "iterations_per_second": 5.0,  # 5 steps in 1 s (1000 tokens at 1000 tok/s), not mlx-lm's 10 / 1 s
        "trained_tokens": 3000,
        "train_time": 1.0,
        "peak_memory_gb": 1.5,
        "world_size": 2,
        "wall_time": 3.0,
    }
    assert (records[1]["train_time"], records[1]["iterations_per_second"]) == (2.0, 5.0)


def test_other_ranks_write_nothing(tmp_path: Path):
    callback = ft.MetricsCallback(FakeGroup(1, 2), tmp_path / "run" / "metrics.jsonl")
    report_a_run(callback)
    assert not (tmp_path / "run").exists()


def test_progress_is_plain_lines_off_a_terminal_and_nothing_on_other_ranks(tmp_path: Path):
    out = io.StringIO()
    ticks = iter([0.0, 0.0, *[10.0] * 20])
    display = ft.ProgressDisplay(
        40, Console(file=out, force_terminal=False, width=60), clock=lambda: next(ticks)
    )
    callback = ft.MetricsCallback(
        FakeGroup(0, 1), tmp_path / "metrics.jsonl", display, peak_memory_gb=lambda: 1.0
    )
    with display:
        report_a_run(callback)
        display.report_save(Path("adapters/0000015_adapters.safetensors"))

    assert out.getvalue().splitlines() == [
        "iter  0/40  val_loss 3.000  (0.5 s)",
        "iter 10/40  loss 2.500  lr 1.00e-04  1,000 tok/s  5.00 it/s  peak 1.50 GB  eta 0:00:30",
        "iter 15/40  loss 2.000  lr 1.00e-04  1,000 tok/s  5.00 it/s  peak 1.50 GB  eta 0:00:16",
        "iter 15/40  val_loss 2.200  (0.4 s)",
        "iter  0/40  saved adapters/0000015_adapters.safetensors",
    ]
    assert "\x1b[" not in out.getvalue()

    silent = ft.ProgressDisplay(40, None)
    with silent, silent.val_task(3) as advance:
        advance()
        silent.show_train(callback.records[1])
        silent.advance()


def test_progress_bar_on_a_terminal(tmp_path: Path):
    out = io.StringIO()
    display = ft.ProgressDisplay(20, Console(file=out, force_terminal=True, width=150))
    callback = ft.MetricsCallback(
        FakeGroup(0, 1), tmp_path / "metrics.jsonl", display, peak_memory_gb=lambda: 1.0
    )
    with display:
        for _ in range(15):
            display.advance()
        with display.val_task(2) as advance:
            advance()
        report_a_run(callback)
    assert display.progress is not None
    assert display.progress.tasks[0].completed == 15
    assert "15/20" in out.getvalue() and "2.000" in out.getvalue() and "2.200" in out.getvalue()


# --- the report ---------------------------------------------------------------------------------------


def test_plot_and_summary_from_a_metrics_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    run = tmp_path / "run"
    report_a_run(ft.MetricsCallback(FakeGroup(0, 2), run / "metrics.jsonl", peak_memory_gb=lambda: 1.0))

    assert report.main([str(run)]) == 0
    assert capsys.readouterr().out == f"{run / 'loss.png'}\n"
    assert (run / "loss.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")

    summary = report.summarize(report.read_metrics(run / "metrics.jsonl"), wall_time=9.0)
    assert summary == {
        "iterations": 15,
        "world_size": 2,
        "first_train_loss": 2.5,
        "final_train_loss": 2.0,
        "first_val_loss": 3.0,
        "final_val_loss": 2.2,
        "trained_tokens": 3000,
        "train_time": 3.0,
        "tokens_per_second": 1000.0,
        "tokens_per_second_overall": 1000.0,
        "peak_memory_gb": 1.5,
        "wall_time": 9.0,
    }


def test_report_errors_name_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert report.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'metrics.jsonl'}: no such file\n"
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 1, "train_loss": 2.0}\nnot json\n')
    assert report.main([str(tmp_path)]) == 2
    assert "metrics.jsonl: line 2: not JSON" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("")
    assert report.main([str(tmp_path)]) == 2
    assert "no train_loss or val_loss records to plot" in capsys.readouterr().err


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
    again = ft.merge_config(ft.load_config_file(out / "config.yaml"), {})
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
    # mlx.launch makes stdin non-blocking, which would stay so for pytest and later ansible runs.
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
    launch = [str(Path(sys.executable).parent / "mlx.launch"), "--backend", "ring", "-n", "2", "--"]
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
    launch = [str(Path(sys.executable).parent / "mlx.launch"), "--backend", "ring", "-n", "2", "--"]
    args = training_args(root / "model", root / "data", root / "three", "--expected-world-size", "3")
    result = run_launcher([*launch, sys.executable, "-m", "training.finetune", *args], timeout=120)

    for rank in (0, 1):
        assert f"rank {rank}: MLX joined 2 process(es) but 3 were expected" in result.stderr
    # mlx.launch itself exits with 0 whatever its ranks do; it stops the others once one fails.
    assert "exited with code 1" in result.stderr
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
