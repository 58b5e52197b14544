"""Fine-tuning on every rank of the cluster, as `mlx_lm lora` does it, built on mlx-lm's trainer:
`python -m training.finetune --config FILE`, the same command on every rank (invoke train builds
the launch: mlxcluster/launch/builder.py).

`main` is the story of a run, one step per module: the settings (training/config.py), a loud
distributed start (training/distributed.py), the model and data (training/loading.py), mlx-lm's
loop with our progress, checkpoints and watchdog (training/loop/), and the summary on rank 0. mlx-lm
averages the gradients across ranks itself: never average them again. What a run does and how to
drive it is told once, in docs/training.md.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.optimizers as optim
import yaml
from mlx.utils import tree_flatten
from mlx_lm.tuner import trainer
from mlx_lm.tuner.datasets import CacheDataset
from mlx_lm.utils import save_config
from rich.console import Console

from training.command_line import build_parser, cli_values
from training.config import (
    DEFAULT_CONFIG,
    BatchPlan,
    ConfigError,
    FinetuneConfig,
    adapter_config,
    batch_plan,
    check_inputs,
    merge_config,
    older_names_said,
    validate_config,
)
from training.config_file import load_config_file
from training.data.batches import SharedBatches, summed_loss_with
from training.distributed import (
    DistributedError,
    RankChecks,
    check_ranks,
    init_distributed,
    rank_prefix,
    wait_for_every_rank,
)
from training.loading import Loaded, check_datasets_package, data_sha256, load_model_and_data
from training.loop import checkpoint, heartbeat, optimizers, report
from training.loop.metrics import MetricsCallback, ResumePoint
from training.loop.progress import ProgressDisplay, done_line
from training.loop.reporting import finish_reporting, missing_packages_problem, reporting_callback
from training.loop.resume import Checkpointer, resume_point
from training.loop.watchdog import StallWatchdog
from training.parallel_rules import pipeline_micro_batches
from training.sharding import pipeline, tensor_parallel
from training.sharding.stage_layout import PipelineLayout

Layout = tensor_parallel.Layout | PipelineLayout

# What rank 0 leaves in adapter_path, besides the checkpoints/ directory.
OUTPUT_FILES = (
    "adapters.safetensors",
    "adapter_config.json",
    "config.yaml",
    "metrics.jsonl",
    "loss.png",
    "summary.json",
)


# --- load: training/loading.py -------------------------------------------------------------------


def write_settings(config: FinetuneConfig, validates: bool) -> None:
    """Rank 0, before training: the resolved settings (config.yaml) and mlx-lm's adapter_config.json."""
    out = Path(config.adapter_path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(asdict(config), sort_keys=False))
    save_config(adapter_config(config), out / "adapter_config.json")
    if not validates:
        print(f"warning: {config.data} has no valid.jsonl examples: training without validation", flush=True)


# --- train -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _replaced(owner: object, name: str, value: object) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


# How much later a rank's own watchdog acts when the controller watches its beats: the controller
# acts first (15 s past the run's slowest step: mlxcluster/launch/liveness.py), tests the links and
# names the cause while every rank is still there; the rank's watchdog is then its backstop.
WATCHED_EXTRA = 30


def watchdog_for(config: FinetuneConfig, group: Any, display: ProgressDisplay,
                 watched: bool = False) -> StallWatchdog:
    """A watchdog that every finished step or validation batch on the display keeps at bay
    (`watched`: the controller reads this rank's beats, and acts before it)."""
    prefix = rank_prefix(group)
    # Compiling and the first step can take minutes on a big model; after that, the run's pace.
    alone = group.size() == 1
    timeout = config.stall_timeout + (WATCHED_EXTRA if watched else 0)
    watchdog = StallWatchdog(
        timeout, first_timeout=max(600, 10 * config.stall_timeout), describe=lambda: prefix,
        cause=("this single process is stuck (there is no other rank to wait for)" if alone
               else "another rank is gone or the cluster link is down"),
    )
    display.step_hooks.append(watchdog.step)
    display.progress_hooks.append(watchdog.pet)
    return watchdog


def training_args(
    config: FinetuneConfig, first_step: int, adapter_file: Path, micro: int = 1
) -> trainer.TrainingArgs:
    """mlx-lm's arguments. With `micro` micro-batches per batch, mlx-lm counts micro-batches: its
    iterations, reports, validations and validation batches are `micro` times ours, and it
    accumulates `micro` gradients per batch, times grad_accumulation_steps batches per update
    (MicroSteps turns its counts back into iterations)."""
    return trainer.TrainingArgs(
        batch_size=config.batch_size,
        iters=(config.iters - first_step) * micro,
        val_batches=_batches(config.val_batches, micro),
        steps_per_report=config.steps_per_report * micro,
        steps_per_eval=config.steps_per_eval * micro,
        # The trainer's own saves are off: checkpoints are the Checkpointer's.
        steps_per_save=(config.iters + 1) * micro,
        max_seq_length=config.max_seq_length,
        adapter_file=str(adapter_file),
        grad_checkpoint=config.grad_checkpoint,
        grad_accumulation_steps=config.grad_accumulation_steps * micro,
        clear_cache_threshold=config.clear_cache_threshold,
    )


def _batches(count: int, micro: int) -> int:
    """A number of batches (-1: all) in the trainer's micro-batches."""
    return count * micro if count > 0 else count


class MicroSteps(trainer.TrainingCallback):
    """The callback mlx-lm reports to when it counts micro-batches: its reports, in steps."""

    def __init__(self, callback: trainer.TrainingCallback, micro: int):
        self.callback, self.micro = callback, micro

    def on_train_loss_report(self, info: dict[str, Any]) -> None:
        self.callback.on_train_loss_report(
            info | {"iteration": info["iteration"] // self.micro,
                    "iterations_per_second": info["iterations_per_second"] / self.micro}
        )

    def on_val_loss_report(self, info: dict[str, Any]) -> None:
        # mlx-lm validates before micro-batch it, after (it - 1) of them: (it - 1) // micro steps.
        self.callback.on_val_loss_report(info | {"iteration": info["iteration"] // self.micro})


def _averaging(layout: Layout) -> Any:
    """The gradient averaging for mlx-lm's step. Its own averages across every rank: right when the
    ranks split the batch, wrong when they hold different parts of the parameters: in tensor
    parallelism each rank's gradients are already the whole batch's, and in pipeline parallelism a
    stage's are averaged among its replicas alone."""
    if isinstance(layout, PipelineLayout):
        return layout.average
    return (lambda gradients: gradients) if layout.split_parameters else trainer.average_gradients


def _keep_final_adapters(loaded: Loaded, group: Any, final_partial: Path) -> None:
    """Rank 0 puts the trainer's final adapters in place; sharded ones (or stages') are gathered first
    (every rank takes part), so that the file is one process's."""
    if not loaded.layout.split_parameters:
        if group.rank() == 0:
            os.replace(final_partial, final_partial.parent / "adapters.safetensors")
        return
    whole = loaded.layout.whole(dict(tree_flatten(loaded.model.trainable_parameters())))
    if group.rank() == 0:
        final_partial.unlink()  # rank 0's shards alone
        checkpoint.save_safetensors(final_partial.parent / "adapters.safetensors", whole)


def train(
    config: FinetuneConfig,
    group: Any,
    loaded: Loaded,
    optimizer: optim.Optimizer,
    callback: trainer.TrainingCallback,
    display: ProgressDisplay,
    first_step: int,
    cut: BatchPlan,
) -> Trained:
    """mlx-lm's training loop from `first_step` to `iters`, then a validation of the final weights
    and (test: true) the test split's loss."""
    out = Path(config.adapter_path)
    # The trainer's final save goes to a partial file that is renamed once complete.
    final_partial = out / ".adapters.partial.safetensors"
    layout = loaded.layout
    batches = SharedBatches(config.seed, cut.shares, cut.micro_batches, skip=first_step,
                            data_group=layout.data_group)
    stages = _pipeline_step(config, layout)
    loss = stages.loss if stages else summed_loss_with(layout.cross_entropy, counted=layout.counts_tokens)
    args = training_args(config, first_step, final_partial, cut.micro_batches)
    # mlx-lm's train has no argument for its display, its averaging or (pipeline) its gradients: they
    # are swapped for the call (tests/unit/training/test_mlx_lm_seams.py checks the pinned mlx-lm
    # still looks them up).
    with _replaced(trainer, "TrainUI", lambda *_, **__: display), \
            _replaced(trainer, "average_gradients", _averaging(layout)), \
            _pipelined(stages, args):
        trainer.train(
            model=loaded.model,
            optimizer=optimizer,
            train_dataset=CacheDataset(loaded.train_set),
            val_dataset=loaded.valid,
            args=args,
            loss=loss,
            iterate_batches=batches,
            training_callback=MicroSteps(callback, cut.micro_batches) if cut.micro_batches > 1 else callback,
        )
    _keep_final_adapters(loaded, group, final_partial)
    # mlx-lm's last validation runs before the last step: validate the weights it saved.
    if loaded.valid is not None:
        tic = time.perf_counter()
        val_loss = _evaluate(loaded, loaded.valid, config, args.val_batches, batches, display, loss)
        # The callback counts the trainer's iterations, which start at the resumed step.
        callback.on_val_loss_report({"iteration": config.iters - first_step, "val_loss": val_loss,
                                     "val_time": time.perf_counter() - tic})
    test_loss = None
    if config.test:
        test_loss = _evaluate(loaded, CacheDataset(loaded.test), config,
                              _batches(config.test_batches, cut.micro_batches), batches, display, loss)
        display.print(f"Test loss {test_loss:.3f}, Test ppl {math.exp(test_loss):.3f}.")
    return Trained(batches.trained_tokens, test_loss, stages.counters if stages else None)


def _pipeline_step(config: FinetuneConfig, layout: Layout) -> pipeline.PipelineStep | None:
    """The stages' step (parallel pipeline), agreed with the neighbours; None in any other mode."""
    if not isinstance(layout, PipelineLayout):
        return None
    micro = pipeline_micro_batches(config, layout.stage.stages)
    return pipeline.PipelineStep(layout.stage, layout.group, micro)


@contextlib.contextmanager
def _pipelined(stages: pipeline.PipelineStep | None, args: trainer.TrainingArgs) -> Iterator[None]:
    """mlx-lm's trainer with the stages' step for its `value_and_grad`, uncompiled (the step sends
    and receives, which a compiled function cannot), and its grad_checkpoint left to the stage's
    loading, which set it on every layer before the stage's edge layers were made."""
    if stages is None:
        yield
        return
    args.grad_checkpoint = False
    mx.disable_compile()
    try:
        with _replaced(trainer, "nn", pipeline.TrainerNN(stages)):
            yield
    finally:
        if not os.environ.get("MLX_DISABLE_COMPILE"):  # as this process started
            mx.enable_compile()


@dataclass(frozen=True)
class Trained:
    tokens: int  # the target tokens this rank trained on
    test_loss: float | None  # the test split's loss (test: true)
    pipeline_counters: dict[str, Any] | None = None  # this stage's (PipelineStep.counters); None: no stages


def _evaluate(loaded: Loaded, dataset: Any, config: FinetuneConfig, num_batches: int,
              batches: SharedBatches, display: ProgressDisplay, loss: Any) -> float:
    """mlx-lm's evaluate of the trained weights on `dataset`, over this run's ranks and batches."""
    return trainer.evaluate(
        loaded.model,
        dataset,
        config.batch_size,
        num_batches,
        max_seq_length=config.max_seq_length,
        loss=loss,
        iterate_batches=batches,
        clear_cache_threshold=config.clear_cache_threshold,
        progress_callback=display.progressed,
    )


# --- summarize -------------------------------------------------------------------------------------


def write_summary(
    config: FinetuneConfig,
    records: Sequence[Mapping[str, Any]],
    wall_time: float,
    model_load: float,
    checks: RankChecks,
    resumed: ResumePoint | None,
    cut: BatchPlan,
    test_loss: float | None = None,
) -> dict[str, Any]:
    """Rank 0, at the end: summary.json and (where matplotlib is) loss.png; the summary."""
    out = Path(config.adapter_path)
    first_step = resumed.step if resumed else 0
    summary = report.summarize(records, wall_time=wall_time)
    summary["max_weight_difference_across_ranks"] = checks.weight_spread
    summary["ranks_with_openblas"] = checks.ranks_with_openblas
    summary["resumed_from_step"] = first_step if resumed else None
    summary["time_split"] = report.time_split(
        records, model_load, checks.gradient_sync_seconds, steps=config.iters - first_step
    )
    summary["parallel"] = config.parallel
    summary["fine_tune_type"] = config.fine_tune_type
    summary["optimizer"] = config.optimizer
    if test_loss is not None:  # as mlx_lm lora --test reports it
        summary["test_loss"] = test_loss
        summary["test_ppl"] = math.exp(test_loss)
    summary["peak_memory_gb_per_rank"] = checks.peak_memory_gb
    summary["base_weights_per_rank"] = checks.base_weights  # quantized, dequantized at load, or float
    if checks.pipeline is not None:  # each stage's recv waits, bytes sent, micro-batches and steps
        summary["pipeline_per_rank"] = checks.pipeline
    # In tensor parallelism the ranks compute the batch together, as one data rank.
    summary["batch"] = report.batch_split(
        cut.shares, cut.micro_batches, checks.rank_tokens[:len(cut.shares)], summary.get("tokens_per_second"),
        cut.limits,
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    try:
        report.plot_losses(records, out / "loss.png")
    except ImportError:
        print(
            f"note: no matplotlib on this node, so no loss.png yet: invoke train draws it on the controller "
            f"(or run python -m training.loop.report {out} where matplotlib is)",
            flush=True,
        )
    return summary


def write_rank_weights(out: Path, group: Any, weights: Mapping[str, mx.array]) -> Path:
    """save_rank_weights: this rank's own copy of the weights every rank must hold alike, at
    <out>/ranks/rank<N>.safetensors on its node, for a check that does not trust the run's own
    figure (the lab tests compare the files of every node)."""
    path = out / "ranks" / f"rank{group.rank()}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    checkpoint.save_safetensors(path, weights)
    return path


# --- the run ---------------------------------------------------------------------------------------


def run(
    config: FinetuneConfig, group: Any, console: Console | None = None, resume: bool = False
) -> dict[str, Any] | None:
    """Train on this rank; rank 0 writes the outputs and returns the summary.

    resume: continue the run in adapter_path from its latest checkpoint (if it has one).
    """
    rank0 = group.rank() == 0
    started = time.monotonic()
    loaded = load_model_and_data(config, group)
    if rank0:
        write_settings(config, validates=loaded.valid is not None)
    optimizer = optimizers.make(config)
    data_digest = data_sha256(config) if rank0 else ""
    resumed = resume_point(config, loaded.layout, loaded.model, optimizer, data_digest) if resume else None
    first_step = resumed.step if resumed else 0

    out = Path(config.adapter_path)
    cut = batch_plan(config, group.size())  # each rank's share of every batch, in micro-batches
    display = ProgressDisplay(
        config.iters,
        (console or Console()) if rank0 else None,
        first_iteration=first_step,
        micro_batches=cut.micro_batches,
    )
    metrics = MetricsCallback(group, out / "metrics.jsonl", display, resumed=resumed)
    checkpointer = Checkpointer(
        config, loaded.layout, loaded.model, optimizer, metrics, display, first_step, data_digest
    )
    beats = heartbeat.Heartbeat.from_env(group.rank(), os.environ)
    if beats is not None:
        display.step_hooks.append(lambda: beats.stepped(display.iteration))
        display.progress_hooks.append(beats.progressed)
        checkpointer.busy = beats.busy
    if (hang_step := heartbeat.hang_at(group.rank(), os.environ)) is not None and first_step == 0:
        display.step_hooks.append(lambda: display.iteration >= hang_step and heartbeat.hang_for_ever())
    metrics.report_hooks.append(checkpointer.after_report)
    # report_to: rank 0 also sends what metrics.jsonl records to wandb / swanlab.
    callback = reporting_callback(config.report_to, config.project_name, out, asdict(config), group.rank(),
                                  metrics)
    watchdog = watchdog_for(config, group, display, watched=beats is not None)
    watchdog.start()
    if beats is not None:
        beats.start()
    try:
        trained = train(config, group, loaded, optimizer, callback, display, first_step, cut)
        if beats is not None:
            beats.finish()
        checks = check_ranks(loaded.model, group, trained.tokens, loaded.layout, loaded.base_weights,
                             trained.pipeline_counters)
    finally:
        watchdog.stop()
        if beats is not None:
            beats.finish()  # beating on until the process ends: its last words are its exit record
        finish_reporting(callback)
    if config.save_rank_weights:
        write_rank_weights(out, group, loaded.layout.replicated(loaded.model))
    if not rank0:
        return None
    wall_time = time.monotonic() - started
    summary = write_summary(config, metrics.records, wall_time, loaded.seconds, checks, resumed, cut,
                            trained.test_loss)
    display.print(done_line(summary, out))
    return summary


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    environ = os.environ if environ is None else environ
    # Piped stdout (mpirun, mlx-cluster-launch or mlx.launch) is block-buffered: progress must stream
    # back line by line.
    if reconfigure := getattr(sys.stdout, "reconfigure", None):
        reconfigure(line_buffering=True)
    prefix, group = "", None
    try:
        # No settings file given: the demo's (invoke train's default), as the controller reads it.
        settings_file = args.config or DEFAULT_CONFIG
        file_values = load_config_file(settings_file)
        config = merge_config(file_values, cli_values(args), source=str(settings_file))
        group = init_distributed(environ, args.expected_world_size)
        prefix = rank_prefix(group)
        if group.rank() == 0:
            for note in older_names_said(file_values, cli_values(args)):
                print(f"note: {note}", flush=True)
        validate_config(config, group.size())
        check_inputs(config)
        if problem := missing_packages_problem(config.report_to):
            raise ConfigError(problem)
        check_datasets_package(config)
        if config.parallel == "tensor":
            tensor_parallel.check_collectives(group, environ)
        run(config, group, resume=args.resume)
        code = 0
    except ConfigError as error:
        print(f"{prefix}error: {error}", file=sys.stderr, flush=True)
        code = 2
    except OSError as error:
        if error.errno != errno.ENOSPC:
            raise
        # A checkpoint and every output file are written aside and renamed: what is there is whole.
        print(f"{prefix}error: no space left on this node's disk ({error.filename or error}): the "
              "checkpoints written before are whole; free space there, then go on with invoke train "
              "--resume", file=sys.stderr, flush=True)
        code = 1
    except DistributedError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        if error.group is not None and error.group.size() > 1:
            wait_for_every_rank(error.group)
        code = 1
    # How this rank ended, for the controller (a rank that raised leaves none: it failed).
    if group is not None and (beats := heartbeat.Heartbeat.from_env(group.rank(), environ)):
        beats.exit_record(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
