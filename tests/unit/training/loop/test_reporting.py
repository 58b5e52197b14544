"""training.loop.reporting: `report_to` through mlx-lm's callbacks, on rank 0, after our metrics.

The trackers run for real, offline: wandb in its offline mode, swanlab in its offline mode (its
"local" mode needs the swanboard dashboard package besides). Their files are read back to check the
steps they logged, with HOME, and so every tracker's own folders, inside the test's tmp_path.
"""

from __future__ import annotations

import json
import struct
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.tuner import callbacks as mlx_callbacks
from mlx_lm.tuner.callbacks import TrainingCallback

from tests.unit.training.conftest import tracker_processes
from tests.unit.training.loop.test_metrics import report_a_run, train_info
from tests.unit.training.test_distributed import FakeGroup
from training.loop import reporting
from training.loop.metrics import MetricsCallback, ResumePoint

REPO = Path(__file__).resolve().parents[4]
SETTINGS = {"iters": 200, "learning_rate": 1e-4, "adapter_path": Path("runs/demo/adapters")}


def wandb_history(log_dir: Path, wait: float = 60) -> tuple[Any, dict[int, dict[str, Any]]]:
    """The run record and the logged rows by step of the one offline wandb run under log_dir.

    wandb-core writes the file in a process of its own, after wandb.finish has returned: on a
    loaded machine its records came seconds later (CI read a file without even the run's), so the
    file is read again until it holds the run's end (its exit record), for at most `wait` seconds."""
    deadline = time.monotonic() + wait
    records = wandb_records(log_dir)
    while not any(record.HasField("exit") for record in records) and time.monotonic() < deadline:
        time.sleep(0.5)
        records = wandb_records(log_dir)
    (run,) = [record.run for record in records if record.HasField("run")]
    rows = {
        record.history.step.num: {
            item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
        }
        for record in records
        if record.HasField("history")
    }
    return run, rows


def wandb_records(log_dir: Path) -> list[Any]:
    """The records of the one offline wandb run under log_dir, as far as they are written.

    A run-*.wandb file is a LevelDB log (32 KiB blocks of records, each with a 7-byte header) of
    wandb's protobuf records, after a 7-byte file header; wandb 0.31 has no Python reader of it."""
    from wandb.proto import wandb_internal_pb2

    files = list(log_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) <= 1, files
    data = files[0].read_bytes() if files else b""
    if len(data) < 7:  # not begun yet
        return []
    assert data[:7] == b":W&B" + struct.pack("<HB", 0xBEE1, 0)
    records, pending, position = [], b"", 7
    while position + 7 <= len(data):
        if (left := 32768 - position % 32768) < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if position + 7 + length > len(data):  # a record still being written
            break
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def swanlab_scalars(log_dir: Path) -> dict[tuple[str, int], float]:
    """The scalars of the one offline swanlab run under log_dir, by key and step, read with swanlab's
    own reader of its run file."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    (path,) = log_dir.glob("swanlog/run-*/run-*.swanlab")
    reader = DataStoreReader()
    reader.open(path)
    try:
        records = [Record.FromString(data) for data in reader]
    finally:
        reader.close()
    return {
        (record.scalar.key, record.scalar.step): record.scalar.value.number
        for record in records
        if record.HasField("scalar")
    }


def resumed_metrics(log_dir: Path) -> MetricsCallback:
    # Resumed at step 100: the trainer counts from 0 again, our metrics from the run's start.
    return MetricsCallback(FakeGroup(0, 2), log_dir / "metrics.jsonl", resumed=ResumePoint(step=100))


def test_rank_0_reports_our_metrics_to_both_trackers_at_our_steps(offline: Path):
    log_dir = offline / "runs" / "demo" / "adapters"
    metrics = resumed_metrics(log_dir)
    callback = reporting.reporting_callback("wandb, SwanLab", "demo-project", log_dir, SETTINGS, 0, metrics)

    report_a_run(callback)
    reporting.finish_reporting(callback)

    # The inner callback got every report, and wrote them.
    assert [record["iteration"] for record in metrics.records] == [100, 110, 115, 115]
    assert len((log_dir / "metrics.jsonl").read_text().splitlines()) == 4

    # What both trackers hold at each step: a step's reports merged, the first one's values kept
    # (the final validation comes at the step of the last train report, both with a wall_time).
    expected: dict[int, dict[str, Any]] = {}
    for record in metrics.records:
        expected[record["iteration"]] = record | expected.get(record["iteration"], {})

    run, rows = wandb_history(log_dir)
    assert (run.project, run.display_name) == ("demo-project", "adapters")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert (config["iters"], config["adapter_path"]) == (200, "runs/demo/adapters")
    assert sorted(rows) == sorted(expected) == [100, 110, 115]
    for step, values in expected.items():
        assert rows[step] | values == rows[step], step

    scalars = swanlab_scalars(log_dir)
    assert sorted({step for _key, step in scalars}) == [100, 110, 115]
    for step, values in expected.items():
        assert {key: scalars[(key, step)] for key in values} == pytest.approx(values), step


def test_other_ranks_start_no_tracker_and_write_nothing(offline: Path):
    import swanlab
    import wandb

    metrics = MetricsCallback(FakeGroup(1, 2), offline / "adapters" / "metrics.jsonl")

    callback = reporting.reporting_callback("wandb,swanlab", None, offline / "adapters", SETTINGS, 1, metrics)
    report_a_run(callback)
    reporting.finish_reporting(callback)

    assert callback is metrics
    assert len(metrics.records) == 4
    assert wandb.run is None and not swanlab.has_run()
    assert list(offline.rglob("*")) == []
    assert tracker_processes() == []


@pytest.mark.parametrize("report_to", [None, "", " , "])
def test_without_report_to_the_inner_callback_reports_alone(offline: Path, report_to: str | None):
    import wandb

    metrics = resumed_metrics(offline / "adapters")

    callback = reporting.reporting_callback(report_to, None, offline / "adapters", SETTINGS, 0, metrics)
    assert callback is metrics
    assert wandb.run is None


class Recorder(TrainingCallback):
    """An inner callback that is not our metrics: the trackers get the trainer's reports as they are."""

    def __init__(self, calls: list[tuple[str, int]]):
        self.calls = calls

    def on_train_loss_report(self, train_info: dict[str, Any]) -> None:
        self.calls.append(("inner", train_info["iteration"]))

    def on_val_loss_report(self, val_info: dict[str, Any]) -> None:
        self.calls.append(("inner", val_info["iteration"]))


def test_inner_goes_first_and_a_failing_tracker_is_dropped_while_the_others_go_on(
    offline: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    calls: list[tuple[str, int]] = []
    inner = Recorder(calls)
    callback = reporting.reporting_callback("wandb,swanlab", None, offline / "a", SETTINGS, 0, inner)
    # After the runs start: wandb.init binds wandb.log to its run.
    real_wandb_log, real_swanlab_log = mlx_callbacks.wandb.log, mlx_callbacks.swanlab.log

    def wandb_log(data: dict[str, Any], step: int) -> None:
        calls.append(("wandb", step))
        if step == 20:
            raise ConnectionError("the tracker is gone")
        real_wandb_log(data, step=step)

    def swanlab_log(data: dict[str, Any], step: int) -> None:
        calls.append(("swanlab", step))
        real_swanlab_log(data, step=step)

    monkeypatch.setattr(mlx_callbacks.wandb, "log", wandb_log)
    monkeypatch.setattr(mlx_callbacks.swanlab, "log", swanlab_log)

    for iteration in (10, 20, 30):
        callback.on_train_loss_report(train_info(iteration, 2.0, 1000 * iteration))
    reporting.finish_reporting(callback)

    assert calls == [
        ("inner", 10), ("wandb", 10), ("swanlab", 10),
        ("inner", 20), ("wandb", 20), ("swanlab", 20),
        ("inner", 30), ("swanlab", 30),
    ]  # fmt: skip
    assert "warning: report_to wandb: ConnectionError: the tracker is gone" in capsys.readouterr().err
    assert sorted(wandb_history(offline / "a")[1]) == [10]


def test_a_tracker_that_cannot_start_leaves_no_run_open(offline: Path, monkeypatch: pytest.MonkeyPatch):
    import wandb

    class Unstartable(TrainingCallback):
        def __init__(self, **_: Any):
            raise RuntimeError("no API key")

    monkeypatch.setitem(mlx_callbacks.SUPPORT_CALLBACK, "swanlab", Unstartable)

    with pytest.raises(RuntimeError, match="no API key"):
        reporting.reporting_callback("wandb,swanlab", None, offline / "a", SETTINGS, 0, Recorder([]))
    assert wandb.run is None


@pytest.mark.parametrize("rank", [0, 1])
def test_an_unknown_tracker_fails_every_rank_alike(rank: int, tmp_path: Path):
    with pytest.raises(ValueError, match="no tracker called tensorboard; choose from wandb, swanlab"):
        reporting.reporting_callback("wandb,tensorboard", None, tmp_path, SETTINGS, rank, Recorder([]))
    assert list(tmp_path.iterdir()) == []


def test_missing_packages_are_those_mlx_lm_could_not_import(monkeypatch: pytest.MonkeyPatch):
    assert reporting.missing_packages("wandb,swanlab") == []
    assert reporting.missing_packages(None) == []
    assert reporting.missing_packages_problem("wandb,swanlab") is None

    monkeypatch.setattr(mlx_callbacks, "wandb", None)
    assert reporting.missing_packages("swanlab, WandB") == ["wandb"]
    assert reporting.missing_packages_problem("wandb") == (
        "report_to wandb: the wandb package is not installed in the nodes' venv; add [\"wandb==0.31.0\"] "
        "to python_env_extra_packages in the inventory's vars and provision again "
        "(for a run on this machine: .venv/bin/pip install -e '.[report]')"
    )
    monkeypatch.setattr(mlx_callbacks, "swanlab", None)
    problem = reporting.missing_packages_problem("wandb,swanlab")
    assert problem is not None
    assert problem.startswith("report_to wandb,swanlab: the wandb and swanlab packages are not installed")
    assert '["wandb==0.31.0", "swanlab==0.10.3"]' in problem


def test_the_requirements_named_are_the_report_extra_of_pyproject():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert sorted(reporting.TRACKER_REQUIREMENTS.values()) == sorted(extras["report"])
