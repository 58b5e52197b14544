"""`report_to`: the run's reports sent to Weights & Biases and SwanLab as well, from rank 0 only.

mlx-lm's `lora` takes `report_to` ("wandb", "swanlab" or "wandb,swanlab") and `project_name`, and
reports through its own callbacks (`mlx_lm.tuner.callbacks`): each starts its tracker's run in its
constructor (named after `log_dir`'s last part, its files under `log_dir`, the settings as the
run's config) and logs each report at the report's `iteration`. The same classes are used here,
with three differences a cluster run needs:

- rank 0 alone reports: every rank runs the trainer and calls the callbacks (the `inner` one,
  `MetricsCallback`, must be called on all of them), but one run per tracker is wanted, not one
  per rank;
- the run's own metrics come first: `inner` gets each report before the trackers, and a tracker
  that fails is dropped with a warning while the run goes on. A tracker is a view of the run; if it
  stopped rank 0, the other ranks would wait in their next collective until the stall watchdog;
- the trackers log what `inner` recorded when it is our `MetricsCallback`: its steps, counted from
  the start of a resumed run (the trainer counts from the checkpoint), are the ones metrics.jsonl
  and the progress lines use.

Put the callback returned where the `MetricsCallback` would go, inside anything that changes the
trainer's reports first (finetune's `MicroSteps`); send the final validation through it too, and
end with `finish_reporting`:

    metrics = MetricsCallback(group, out / "metrics.jsonl", display, resumed=resumed)
    callback = reporting_callback(config.report_to, config.project_name, out, asdict(config),
                                  group.rank(), metrics)
    trainer.train(..., training_callback=MicroSteps(callback, micro) if micro > 1 else callback)
    callback.on_val_loss_report(...)
    finish_reporting(callback)

`project_name` None is what mlx-lm passes too: each tracker picks its own default, which mlx-lm's
help calls "the name of the root directory" (wandb: the git repository's folder, or
"uncategorized" outside one; swanlab: the current directory's name).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from mlx_lm.tuner import callbacks as mlx_callbacks
from mlx_lm.tuner.callbacks import TrainingCallback

from training.loop.metrics import MetricsCallback

# What pip installs for each tracker: pyproject.toml's `report` extra (the tests keep the two in
# step), named in the message that asks for a missing one.
TRACKER_REQUIREMENTS = {"wandb": "wandb==0.31.0", "swanlab": "swanlab==0.10.3"}


def trackers_named(report_to: str | None) -> list[str]:
    """The trackers `report_to` names, read as mlx-lm reads it (comma separated, any case), each once."""
    names = [item.strip().lower() for item in (report_to or "").split(",") if item.strip()]
    unknown = [name for name in names if name not in mlx_callbacks.SUPPORT_CALLBACK]
    if unknown:
        raise ValueError(
            f"report_to {report_to}: no tracker called {', '.join(unknown)}; "
            f"choose from {', '.join(mlx_callbacks.SUPPORT_CALLBACK)}"
        )
    return list(dict.fromkeys(names))


def missing_packages(report_to: str | None) -> list[str]:
    """The named trackers' packages that are not importable.

    mlx-lm imports each tracker once, with its callbacks module, and keeps None for one that fails:
    that None is what its callback refuses, so it is the one looked at here. Its refusal would
    only come when rank 0 starts reporting, after the model is loaded on every rank."""
    return [name for name in trackers_named(report_to) if getattr(mlx_callbacks, name) is None]


def missing_packages_problem(report_to: str | None) -> str | None:
    """What a run says when it refuses to start for want of a tracker's package; None if all are there."""
    missing = missing_packages(report_to)
    if not missing:
        return None
    named = " and ".join(missing)
    packages = f"the {named} package is" if len(missing) == 1 else f"the {named} packages are"
    requirements = json.dumps([TRACKER_REQUIREMENTS[name] for name in missing])
    return (
        f"report_to {report_to}: {packages} not installed in the nodes' venv; add {requirements} to "
        f"python_env_extra_packages in the inventory's vars and provision again "
        f"(for a run on this machine: .venv/bin/pip install -e '.[report]')"
    )


def reporting_callback(
    report_to: str | None,
    project_name: str | None,
    log_dir: str | Path,
    settings: Mapping[str, Any],
    rank: int,
    inner: TrainingCallback,
) -> TrainingCallback:
    """The callback for mlx-lm's trainer: on rank 0 with `report_to` set, one that reports to
    `inner` and then to each tracker (their runs start here); otherwise `inner` itself.

    A misspelt tracker raises ValueError on every rank alike. A tracker that cannot start its run
    (wandb online without an API key, say) raises here, before any training."""
    names = trackers_named(report_to)
    if rank != 0 or not names:
        return inner
    # wandb, given a dir that does not exist yet, warns that it is no git root.
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    return Reporting(inner, _start_trackers(names, project_name, str(Path(log_dir)), _plain(settings)))


def finish_reporting(callback: TrainingCallback) -> None:
    """Ends the trackers' runs, once their data is written; nothing for any other callback (other
    ranks, no `report_to`). Without it they end when the process exits."""
    if isinstance(callback, Reporting):
        callback.finish()


class Reporting(TrainingCallback):
    """`inner` first, then each tracker: one of mlx-lm's callbacks, each on its own (not chained
    through `wrapped_callback`) so that one's failure does not keep the report from the others."""

    def __init__(self, inner: TrainingCallback, trackers: Mapping[str, TrainingCallback]):
        self.inner = inner
        self.trackers = dict(trackers)  # those still reported to
        self.started = list(trackers)  # every run started, to finish
        self._step: Any = None  # the step last reported, and the keys sent at it
        self._sent_at_step: set[str] = set()

    def on_train_loss_report(self, train_info: dict[str, Any]) -> None:
        reports = self._recorded_by_inner(self.inner.on_train_loss_report, train_info)
        self._to_trackers("on_train_loss_report", [self._new_at_step(report) for report in reports])

    def on_val_loss_report(self, val_info: dict[str, Any]) -> None:
        reports = self._recorded_by_inner(self.inner.on_val_loss_report, val_info)
        self._to_trackers("on_val_loss_report", [self._new_at_step(report) for report in reports])

    def _recorded_by_inner(
        self, report: Callable[[dict[str, Any]], None], info: dict[str, Any]
    ) -> list[dict[str, Any]]:
        """Hands `info` to `inner`; what the trackers get for it: what our metrics recorded (their
        steps and totals count from the start of the run), or the trainer's `info` for another inner."""
        if not isinstance(self.inner, MetricsCallback):
            report(info)
            return [info]
        before = len(self.inner.records)
        report(info)
        return [dict(record) for record in self.inner.records[before:]]

    def _new_at_step(self, report: dict[str, Any]) -> dict[str, Any]:
        """The report without the keys already sent at its step (the final validation comes at the
        step of the last train report, both with a wall_time): swanlab keeps a key's first value at
        a step and wandb its last, so each key goes once and both show the first. The iteration
        always goes: mlx-lm's callbacks log at it."""
        if report.get("iteration") != self._step:
            self._step, self._sent_at_step = report.get("iteration"), set()
        sent = self._sent_at_step - {"iteration"}
        new = {key: value for key, value in report.items() if key not in sent}
        self._sent_at_step |= new.keys()
        return new

    def _to_trackers(self, method: str, reports: list[dict[str, Any]]) -> None:
        for name, tracker in list(self.trackers.items()):
            try:
                for report in reports:
                    getattr(tracker, method)(report)
            except Exception as error:  # whatever a tracker raises, the training goes on
                del self.trackers[name]
                _warn(f"report_to {name}: {type(error).__name__}: {error}; no more reports go to {name}")

    def finish(self) -> None:
        for name in self.started:
            try:
                _finish_run(name)
            except Exception as error:  # the run's own outputs are written: do not fail it now
                _warn(f"report_to {name}: could not finish its run: {type(error).__name__}: {error}")
        self.trackers, self.started = {}, []


def _start_trackers(
    names: list[str], project_name: str | None, log_dir: str, config: dict[str, Any]
) -> dict[str, TrainingCallback]:
    """mlx-lm's callback for each tracker, its run started; the runs already started are finished
    if a later one cannot start, so that a failed start leaves no run open."""
    trackers: dict[str, TrainingCallback] = {}
    try:
        for name in names:
            tracker_class = mlx_callbacks.SUPPORT_CALLBACK[name]
            trackers[name] = tracker_class(project_name=project_name, log_dir=log_dir, config=config)
    except BaseException:
        for name in trackers:
            _finish_run(name)
        raise
    return trackers


def _finish_run(name: str) -> None:
    module = getattr(mlx_callbacks, name)  # the very module mlx-lm's callback logs through
    # swanlab.finish raises without a run; wandb.finish does nothing then.
    if name == "swanlab" and not module.has_run():
        return
    module.finish()


def _plain(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings as JSON values: trackers store their run's config as JSON or YAML, where a Path
    would be refused or stored as a Python repr."""
    return json.loads(json.dumps(dict(settings), default=str))


def _warn(message: str) -> None:
    # Not warnings.warn: this is for the person watching rank 0's output, printed once per event.
    print(f"warning: {message}", file=sys.stderr, flush=True)
