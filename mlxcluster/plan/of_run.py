"""The plan of one run as it launches: each rank's peak under the run's own layout (its parallelism,
its shares, its stages), which the memory preflight judges and summary.json keeps beside the peak
each rank measured (`ranks`), so that every run says how good its plan was.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcluster.describe.cluster import Cluster
from mlxcluster.launch import batch_shares
from mlxcluster.launch import settings as run_settings
from mlxcluster.paths import build_dir_for
from mlxcluster.plan import ranks, speed
from mlxcluster.plan.job import compiled_on, job_for
from mlxcluster.plan.memory import Terms
from mlxcluster.plan.ranks import Job, Layout
from mlxcluster.provision import inputs
from training.config import FinetuneConfig
from training.data import shares as share_rules
from training.parallel_rules import pipeline_layer_counts, pipeline_micro_batches, pipeline_stage_count


def layout_of(settings: FinetuneConfig, world: int, shares: Sequence[int] | None,
              limits: Sequence[int] | None, stages: Sequence[int] | None) -> Layout:
    """The layout a run's settings and its controller-given shares and stages make."""
    if settings.parallel == "pipeline" and world > 1:
        count = pipeline_stage_count(settings, world)
        layers = tuple(stages or pipeline_layer_counts(settings) or ())
        replicas = world // count
        equal = tuple(share_rules.split(settings.batch_size, [1.0] * replicas)) if replicas > 1 else ()
        given = tuple(shares or ()) or equal
        return Layout("pipeline", given, stages=layers, micro_batches=pipeline_micro_batches(settings, count))
    if settings.parallel == "tensor" and world > 1:
        return Layout("tensor")
    return Layout("data", tuple(shares or ()), tuple(limits or ()))


@dataclass(frozen=True)
class Planned:
    """A run's plan: each rank's peak (bytes, rank order) and a step's seconds (None: no calibration
    of this model and sequence length)."""

    peaks: tuple[int, ...]
    step_s: float | None = None


def planned_peaks(cluster: Cluster, settings: FinetuneConfig, model: Path, data: Path | None, *,
                  shares: Sequence[int] | None = None, limits: Sequence[int] | None = None,
                  stages: Sequence[int] | None = None) -> list[Terms] | None:
    """Each rank's planned peak, in rank order (None: the model's files are not on the controller)."""
    found = _job_and_layout(cluster, settings, model, data, shares, limits, stages)
    return ranks.peaks(found[0], found[1], cluster.world_size) if found else None


def _job_and_layout(cluster: Cluster, settings: FinetuneConfig, model: Path, data: Path | None,
                    shares: Sequence[int] | None, limits: Sequence[int] | None,
                    stages: Sequence[int] | None) -> tuple[Job, Layout] | None:
    job = job_for(settings, model, data, compiled=compiled_on(cluster))
    if job is None:
        return None
    layout = layout_of(settings, cluster.world_size, shares, limits, stages)
    if layout.parallel == "pipeline" and not layout.stages:  # the ranks split the layers equally
        count = pipeline_stage_count(settings, cluster.world_size)
        equal = tuple(share_rules.split(job.shape.layers, [1.0] * count))
        layout = Layout("pipeline", layout.shares, stages=equal, micro_batches=layout.micro_batches)
    return job, layout


def plan_run(cluster: Cluster, settings: FinetuneConfig, model: Path, data: Path | None, inventory: str, *,
             shares: Sequence[int] | None = None, limits: Sequence[int] | None = None,
             stages: Sequence[int] | None = None) -> Planned | None:
    """The plan of a run as it launches: each rank's peak, and its step's time from the
    inventory's latest calibration of this model and sequence length (mlxcluster/plan/speed.py)."""
    found = _job_and_layout(cluster, settings, model, data, shares, limits, stages)
    if found is None:
        return None
    job, layout = found
    peaks = ranks.peaks(job, layout, cluster.world_size)
    calibration = batch_shares.latest_calibration(build_dir_for(inventory) / "calibration.json",
                                                  batch_shares.calibration_key(model, settings))
    measures = speed.measured(cluster, calibration, inventory=inventory)
    step = speed.step_seconds(job, layout, cluster, peaks, measures) if measures else None
    return Planned(tuple(t.total for t in peaks), round(step, 4) if step is not None else None)


def ranks_record(cluster: Cluster, planned: Planned, summary: Mapping[str, Any]) -> list[dict[str, Any]]:
    """summary.json's `ranks`: each rank's node, planned and measured peak (bytes), and step time
    (seconds: a step past the first report, which compiles, and which every rank takes together;
    planned: from the calibration, None without one)."""
    measured = summary.get("peak_memory_gb_per_rank") or []
    step_s = summary.get("step_seconds")
    if step_s is None:  # one report only: every step's time, the first's compiling with it
        steps = (summary.get("iterations") or 0) - (summary.get("resumed_from_step") or 0)
        step_s = summary["train_time"] / steps if steps > 0 and summary.get("train_time") else None
    step_s = round(step_s, 4) if step_s is not None else None
    peaks = planned.peaks
    return [{"rank": rank, "node": node, "planned_peak_bytes": peaks[rank] if rank < len(peaks) else None,
             "peak_bytes": round(measured[rank] * 1e9) if rank < len(measured) else None,
             "planned_step_s": planned.step_s, "step_s": step_s}
            for rank, node in enumerate(cluster.rank_nodes())]


def default_run_peaks(cluster: Cluster, model: Path, parallel: str,
                      stages: Sequence[int] | None = None) -> list[int] | None:
    """Each rank's planned peak for the default settings (training/configs/lora.yaml) in `parallel`
    mode on the demo data where it is prepared (else examples of max_seq_length): what `invoke
    doctor` checks each node's memory against (None: the model's files are not here)."""
    settings = run_settings.read(None, ["--parallel", parallel])
    data = inputs.DEMO_DATA_DIR if (inputs.DEMO_DATA_DIR / "train.jsonl").is_file() else None
    peaks = planned_peaks(cluster, settings, model, data, stages=stages)
    return [t.total for t in peaks] if peaks else None

