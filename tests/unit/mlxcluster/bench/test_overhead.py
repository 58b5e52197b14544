"""The overhead comparison (mlxcluster/bench/overhead.py): one mlx-lm config file per fine-tune type,
given to both programs; both really run here (ours and stock `mlx_lm lora`, one process each, on a
tiny model) and what is measured is read from their real output; then the figures and the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from mlx_lm.lora import CONFIG_DEFAULTS

from mlxcluster.bench import overhead, results
from mlxcluster.errors import UserError
from mlxcluster.launch import sync
from tests.unit.training.model.test_folder import tiny_model
from training.config import older_names_said
from training.config_file import load_config_file
from training.data.prepare import prepare

REPO = Path(__file__).resolve().parents[4]
ITERS = 15  # reports at 5, 10, 15: the steady window is 5 -> 10
TINY = {**overhead.SETTINGS, "num_layers": 2, "max_seq_length": 256}  # the tiny llama's 2 layers


# --- the one config file ------------------------------------------------------------------------


@pytest.mark.parametrize("fine_tune_type", overhead.FINE_TUNE_TYPES)
def test_the_config_file_has_mlx_lm_keys_only_and_both_programs_get_that_file(tmp_path: Path,
                                                                              fine_tune_type: str):
    config = overhead.config_for(fine_tune_type, model="/m", data="/d", iters=40)
    path = overhead.write_config(config, tmp_path)
    written = yaml.safe_load(path.read_text())
    assert written == config and written["fine_tune_type"] == fine_tune_type
    assert sorted(set(written) - set(CONFIG_DEFAULTS)) == []
    assert set(written["lora_parameters"]) <= set(CONFIG_DEFAULTS["lora_parameters"])
    # Validation before the first step and before the last; one save, at the end.
    assert (written["iters"], written["steps_per_eval"], written["save_every"]) == (40, 40, 40)
    # Our reader takes it as it is, with no note about an older key name.
    assert load_config_file(path) == written and older_names_said(written, {}) == []

    ours = overhead.ours_program(str(path), "/runs/ours")
    stock = overhead.stock_program(str(path), "/runs/stock")
    assert ours == ["python", "-m", "training.finetune", "--config", str(path),
                    "--adapter-path", "/runs/ours"]
    assert stock == ["python", "-m", "mlx_lm", "lora", "--config", str(path), "--train",
                     "--adapter-path", "/runs/stock"]


def test_an_unknown_fine_tune_type_is_refused():
    with pytest.raises(UserError, match="give one of lora, dora, full"):
        overhead.config_for("qlora", model="/m", data="/d", iters=40)
    assert overhead.parse_types(None) == ["lora", "dora", "full"]
    assert overhead.parse_types("full, lora") == ["full", "lora"]
    for wrong in ("lora,qlora", "lora,lora", ","):
        with pytest.raises(UserError, match="--types"):
            overhead.parse_types(wrong)


# --- both programs for real, with that file ---------------------------------------------------


def stamped_run(argv: list[str]) -> list[tuple[float, str]]:
    """The program's output lines, each with the time it was read (as the relay stamps them)."""
    env = {**os.environ, "TTY_COMPATIBLE": "0", "HF_HUB_OFFLINE": "1", "OPENBLAS_NUM_THREADS": "1"}
    argv = [sys.executable, *argv[1:]] if argv[0] == "python" else argv
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return [(float(i), line) for i, line in enumerate(proc.stdout.splitlines())]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("overhead")
    tiny_model(tmp / "tiny")
    prepare(REPO / "training/data/pirate.jsonl", tmp / "data")
    return tmp


@pytest.fixture(scope="module")
def both(inputs: Path) -> dict[str, Any]:
    """Ours and stock, each run with the one config file of LoRA. One fine-tune type is enough here:
    the bench reads every type's output alike, the files differ only by type (each checked above),
    and both programs train every type alike at weight level in tests/unit/training/."""
    tmp = inputs / "lora"
    tmp.mkdir()
    config = overhead.config_for("lora", model=str(inputs / "tiny"), data=str(inputs / "data"),
                                 iters=ITERS, settings=TINY)
    path = overhead.write_config(config, tmp)
    ours = stamped_run(overhead.ours_program(str(path), str(tmp / "ours")))
    stock = stamped_run(overhead.stock_program(str(path), str(tmp / "stock")))
    return {"tmp": tmp, "config": config, "ours": ours, "stock": stock,
            "metrics": (tmp / "ours" / "metrics.jsonl").read_text()}


def test_both_programs_train_what_the_one_file_says(both):
    config = both["config"]
    stock = json.loads((both["tmp"] / "stock" / "adapter_config.json").read_text())
    ours = yaml.safe_load((both["tmp"] / "ours" / "config.yaml").read_text())
    for key in ("fine_tune_type", "num_layers", "batch_size", "iters", "learning_rate", "seed",
                "max_seq_length", "steps_per_report", "steps_per_eval", "val_batches"):
        assert ours[key] == stock[key] == config[key], key
    assert ours["lora_parameters"] == stock["lora_parameters"] == config["lora_parameters"]


def test_both_report_at_the_same_steps_on_the_same_batches_with_the_same_losses(both):
    ours = overhead.our_reports(both["ours"], both["metrics"])
    stock = overhead.stock_reports(both["stock"])
    assert sorted(ours.arrived) == sorted(ours.losses) == sorted(stock.arrived) == [5, 10, 15]
    assert sorted(stock.losses) == sorted(stock.tokens) == [5, 10, 15]
    overhead.check_same_batches(ours, stock)  # raises when the token counts differ
    epoch = overhead.first_epoch_steps(overhead.train_examples(both["tmp"].parent / "data"), 4)
    assert epoch >= ITERS
    result = overhead.compare_round(ours, stock, overhead.window(ITERS), epoch, 123.0)
    assert [row["step"] for row in result["losses"]] == [5, 10, 15]
    assert all(row["first_epoch"] for row in result["losses"])
    # The same losses, to stock's printed 3 decimals.
    assert result["max_loss_difference_first_epoch"] <= overhead.LOSS_TOLERANCE
    assert result["window_tokens"] == ours.tokens[10] - ours.tokens[5] > 0
    assert result["ours_over_stock"] > 0


# --- reading each program's output ----------------------------------------------------------


STOCK_LINES = [
    "Loading configuration file /w/bench-overhead/lora.yaml",
    "  iter   train_loss     tok/s     tokens",
    "     1    \x1b[1mval\x1b[0m 3.210    1.20s",
    "     5    \x1b[1;32m2.345 ▼\x1b[0m    1,234    \x1b[2m  3.4k\x1b[0m",
    "    10    2.400 ▲      987     12.3k",
    "train ████████████████░░░░░ 67% ·    10/15",
]


def test_stock_lines_give_each_reports_loss_tokens_and_arrival():
    reports = overhead.stock_reports([(float(i), line) for i, line in enumerate(STOCK_LINES)])
    assert reports.arrived == {5: 3.0, 10: 4.0}
    assert reports.losses == {5: 2.345, 10: 2.4}
    assert reports.tokens == {5: 3400.0, 10: 12300.0}
    assert reports.speeds == {5: 1234.0, 10: 987.0}


def test_our_lines_give_the_arrival_and_metrics_jsonl_the_exact_figures():
    lines = [(1.0, "note: nothing"), (2.0, "iter  5/15  loss 2.345  lr 1.00e-04  100 tok/s"),
             (3.0, "iter 10/15  val_loss 3.000  (1.0 s)"), (4.0, "iter 10/15  loss 2.400  lr 1.00e-04")]
    metrics = "\n".join(json.dumps(r) for r in (
        {"iteration": 0, "val_loss": 3.2},
        {"iteration": 5, "train_loss": 2.3451, "trained_tokens": 3412, "tokens_per_second": 101.5},
        {"iteration": 10, "train_loss": 2.4003, "trained_tokens": 12288, "tokens_per_second": 120.25}))
    reports = overhead.our_reports(lines, metrics + "\n")
    assert reports.arrived == {5: 2.0, 10: 4.0}
    assert reports.losses == {5: 2.3451, 10: 2.4003}
    assert reports.tokens == {5: 3412, 10: 12288}
    assert reports.speeds == {5: 101.5, 10: 120.25}


# --- the figures -----------------------------------------------------------------------------


def reports(arrived: dict[int, float], losses: dict[int, float], tokens: dict[int, float],
            speeds: dict[int, float] | None = None) -> overhead.Reports:
    return overhead.Reports(arrived, losses, tokens, speeds or {step: 100.0 for step in tokens})


# 10 s from report 5 to report 10, 5 of them inside the steps (500 tokens at mlx-lm's 100 tok/s).
OURS = reports({5: 100.0, 10: 110.0, 15: 120.0}, {5: 2.0, 10: 1.5, 15: 1.2}, {5: 500, 10: 1000, 15: 1500})


def test_the_window_leaves_out_the_first_steps_and_the_final_validation():
    assert overhead.window(40) == (5, 35)
    assert overhead.window(41) == (5, 40)
    with pytest.raises(UserError, match="at least 15 steps"):
        overhead.window(10)


def test_the_first_epoch_is_whole_batches():
    assert overhead.first_epoch_steps(267, 4) == 66
    assert overhead.first_epoch_steps(8, 4) == 2


def test_tokens_per_second_ratio_and_loss_differences_of_a_round():
    # Stock is 25% slower over the window, and reports 3-decimal losses; the last report is past
    # the first epoch (ends at step 12), so its larger difference does not count.
    stock = reports({5: 50.0, 10: 62.5, 15: 75.0}, {5: 2.0004, 10: 1.501, 15: 1.3},
                    {5: 500.0, 10: 1000.0, 15: 1500.0}, {5: 50.0, 10: 50.0, 15: 50.0})
    result = overhead.compare_round(OURS, stock, (5, 10), 12, 48.0)
    assert result["ours_tokens_per_second"] == 50.0 and result["stock_tokens_per_second"] == 40.0
    assert result["ours_over_stock"] == 1.25
    # Where each one's window went: stock's steps took 10 s of its 12.5 (by its own 50 tok/s).
    assert (result["ours_window_seconds"], result["ours_seconds_in_steps"],
            result["ours_seconds_around_steps"]) == (10.0, 5.0, 5.0)
    assert (result["stock_window_seconds"], result["stock_seconds_in_steps"],
            result["stock_seconds_around_steps"]) == (12.5, 10.0, 2.5)
    assert result["ours_reported_tokens_per_second"] == 48.0 and result["window_tokens"] == 500
    assert [(r["step"], r["difference"], r["first_epoch"]) for r in result["losses"]] == [
        (5, 0.0004, True), (10, 0.001, True), (15, 0.1, False)]
    assert result["max_loss_difference_first_epoch"] == 0.001


def test_other_batches_or_missing_reports_are_refused():
    other = reports(OURS.arrived, OURS.losses, {5: 700.0, 10: 1200.0, 15: 1500.0})
    with pytest.raises(UserError, match="other batches"):
        overhead.compare_round(OURS, other, (5, 10), 66, 1.0)
    fewer = reports({5: 1.0}, {5: 2.0}, {5: 500.0})
    with pytest.raises(UserError, match="reported at steps"):
        overhead.compare_round(OURS, fewer, (5, 10), 66, 1.0)
    with pytest.raises(UserError, match="no report for step"):
        overhead.tokens_per_second({5: 1.0}, OURS.tokens, (5, 10))


def test_a_type_summary_takes_the_median_ratio_and_the_largest_loss_difference():
    config = overhead.config_for("dora", model="/m", data="/d", iters=40)
    rounds = [{"ours_tokens_per_second": t, "stock_tokens_per_second": s, "ours_over_stock": t / s,
               "max_loss_difference_first_epoch": d,
               **overhead.time_split("ours", 1000 / t, 8.0), **overhead.time_split("stock", 1000 / s, 9.0)}
              for t, s, d in ((90.0, 100.0, 0.0005), (99.0, 100.0, 0.003), (120.0, 100.0, 0.0))]
    summary = overhead.summarize(config, rounds, (5, 35), 66)
    assert summary["ours_over_stock"] == 0.99 and summary["meets_target"] is True
    assert summary["ours_tokens_per_second"] == 99.0 and summary["stock_tokens_per_second"] == 100.0
    assert (summary["ours_window_seconds"], summary["ours_seconds_around_steps"]) == (10.1, 2.1)
    assert (summary["stock_seconds_in_steps"], summary["stock_seconds_around_steps"]) == (9.0, 1.0)
    assert summary["max_loss_difference_first_epoch"] == 0.003 and summary["same_losses"] is False
    assert summary["fine_tune_type"] == "dora" and summary["config"] == config
    slow = overhead.summarize(config, rounds[:1], (5, 35), 66)
    assert slow["ours_over_stock"] == 0.9 and slow["meets_target"] is False and slow["same_losses"] is True


# --- the whole comparison, with the node faked ---------------------------------------------


class FakeNode:
    """What the comparison did to the node, and the layout and data it is given."""

    def __init__(self, layout: Any, data: Path):
        self.layout, self.data = layout, data
        self.launched: list[list[str]] = []
        self.configs: list[dict[str, Any]] = []
        self.removed: list[str] = []


def our_lines() -> list[str]:
    return [f"iter {step}/15  loss 2.000  lr 1.00e-04" for step in (5, 10, 15)]


def stock_lines() -> list[str]:
    return [f"  {step:>4}    2.000 ▼    250    {step * 0.1:>5.1f}k" for step in (5, 10, 15)]


METRICS = "\n".join(json.dumps({"iteration": step, "train_loss": 2.0, "trained_tokens": step * 100,
                                "tokens_per_second": 300.0}) for step in (5, 10, 15))


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeNode:
    """The node faked where overhead.py reaches it: placing inputs and the config, launching,
    reading files, removing the runs. Ours reports every 2 s, stock every 2.5 s."""
    head = type("Head", (), {"runs_dir": "/n/runs", "work_dir": "/n/work", "name": "node1"})()
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("{}\n" * 267)
    node = FakeNode(type("Layout", (), {"head": head})(), data)
    placed = sync.Placed(data="/n/work/data/d", model="/n/models/m", config=None)
    monkeypatch.setattr(overhead, "_put_inputs", lambda *_: placed)

    def put_config(_head: Any, config: dict[str, Any]) -> str:
        node.configs.append(config)
        return f"/n/work/bench-overhead/{config['fine_tune_type']}.yaml"

    def run(_layout: Any, program: list[str], _run_dir: str) -> list[tuple[float, str]]:
        node.launched.append(program)
        ours = program[2] == "training.finetune"
        every = 2.0 if ours else 2.5
        return [(every * i, line) for i, line in enumerate(our_lines() if ours else stock_lines(), 1)]

    def on_head(_head: Any, command: list[str]) -> str:
        return METRICS if command[-1].endswith("metrics.jsonl") else json.dumps({"tokens_per_second": 49.0})

    monkeypatch.setattr(overhead, "_put_config", put_config)
    monkeypatch.setattr(overhead, "_run", run)
    monkeypatch.setattr(overhead, "_on_head", on_head)
    monkeypatch.setattr(overhead, "_remove", lambda _head, dirs: node.removed.extend(dirs))
    return node


def test_compare_alternates_both_programs_on_the_one_file_and_removes_their_runs(fake: FakeNode):
    summary = overhead.compare(fake.layout, fake.data, Path("/m"), iters=15, rounds=2,
                               fine_tune_type="full")
    assert [p[2] for p in fake.launched] == ["training.finetune", "mlx_lm"] * 2
    files = {p[p.index("--config") + 1] for p in fake.launched}
    assert files == {"/n/work/bench-overhead/full.yaml"}
    assert fake.configs == [summary["config"]]
    assert summary["config"]["model"] == "/n/models/m" and summary["config"]["data"] == "/n/work/data/d"
    assert len(fake.removed) == 4 and all(d.startswith("/n/runs/bench-") for d in fake.removed)
    # 500 tokens from step 5 to 10: 2 s for ours, 2.5 s for stock.
    assert summary["ours_tokens_per_second"] == 250.0 and summary["stock_tokens_per_second"] == 200.0
    assert summary["ours_over_stock"] == 1.25 and summary["max_loss_difference_first_epoch"] == 0.0
    assert summary["first_epoch_steps"] == 66 and summary["window_reports"] == [5, 10]
    # 500 tokens at mlx-lm's 300 tok/s: 1.67 s inside the steps, the rest around them.
    assert (summary["ours_seconds_in_steps"], summary["ours_seconds_around_steps"]) == (1.67, 0.33)
    assert (summary["stock_seconds_in_steps"], summary["stock_seconds_around_steps"]) == (2.0, 0.5)


def test_the_json_has_each_types_figures_and_a_summary_of_them(fake: FakeNode, tmp_path: Path):
    by_type = {t: overhead.compare(fake.layout, fake.data, Path("/m"), iters=15, rounds=1,
                                   fine_tune_type=t) for t in overhead.FINE_TUNE_TYPES}
    found = overhead.result(inventory="inv.yml", node="node1", model=Path("/m"), data=fake.data,
                            iters=15, rounds=1, by_type=by_type)
    read = json.loads(results.write("overhead", found, tmp_path / "overhead.json").read_text())
    assert read["benchmark"] == "overhead" and read["target"] == overhead.TARGET
    assert sorted(read["types"]) == sorted(overhead.FINE_TUNE_TYPES)
    assert read["ours_over_stock"] == {"lora": 1.25, "dora": 1.25, "full": 1.25}
    assert read["max_loss_difference_first_epoch"] == {"lora": 0.0, "dora": 0.0, "full": 0.0}
    lora = read["types"]["lora"]
    for key in ("ours_tokens_per_second", "stock_tokens_per_second", "ours_over_stock", "meets_target",
                "max_loss_difference_first_epoch", "same_losses", "config", "rounds",
                "ours_seconds_around_steps", "stock_seconds_around_steps"):
        assert key in lora, key
    assert {"step", "ours", "stock", "difference", "first_epoch"} == set(lora["rounds"][0]["losses"][0])
    assert read["types"]["full"]["config"]["fine_tune_type"] == "full"
