"""Batch shares on the controller: each rank's weight from the inventory, split into whole examples
of the run's global batch and passed to every rank (training/data/shares.py does the splitting, on both
sides alike).

A node's `batch_share` is the weight of each of its ranks: a number (relative: 3 beside 1 gives
three times the examples), or `auto`, which takes the node's tokens/s from the latest calibration
(`invoke bench.calibrate`) of the same model and sequence length. `max_micro_batch` caps the
examples a rank of that node runs at once; what values they may take is the inventory's rule
(mlxcluster/describe/inventory.py), checked before anything changes. A config that sets
batch_shares itself (or a resumed run's, which recorded them) is left as it is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxcluster.describe.cluster import Cluster, Node
from mlxcluster.describe.inventory import AUTO
from mlxcluster.errors import UserError
from training.config import FinetuneConfig
from training.data import shares
from training.model.manifest import manifest_sha256
from training.parallel_rules import pipeline_stage_count

# --- calibration -----------------------------------------------------------------------------------


def calibration_key(model: Path, settings: FinetuneConfig) -> dict[str, Any]:
    """What a calibration is valid for: the model (its manifest digest; a model without one, by
    its path) and the sequence length. Its speed depends on both."""
    digest = manifest_sha256(model.resolve())
    return {"model_id": digest or f"path:{model.resolve()}", "max_seq_length": settings.max_seq_length}


def latest_calibration(path: Path, key: Mapping[str, Any]) -> dict[str, Any] | None:
    """The newest calibration in `path` (build/<inventory>/calibration.json) made for `key`."""
    try:
        runs = json.loads(path.read_text()).get("calibrations", [])
    except (OSError, ValueError):
        return None
    matching = [r for r in runs if all(r.get(k) == v for k, v in key.items())]
    return max(matching, key=lambda r: r.get("date", ""), default=None)


def add_calibration(path: Path, entry: Mapping[str, Any]) -> None:
    """Keep `entry` in calibration.json, beside the earlier ones (written whole, then renamed)."""
    try:
        kept = json.loads(path.read_text()).get("calibrations", [])
    except (OSError, ValueError):
        kept = []
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"calibrations": [*kept, dict(entry)]}, indent=2) + "\n")
    partial.replace(path)


# --- the shares of a run ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Shares:
    shares: list[int]  # examples per rank, in rank order
    limits: list[int]  # max_micro_batch per rank (0: none)
    why: str
    weights: list[float] = field(default_factory=list, compare=False)  # each rank's, as split

    @property
    def step_times(self) -> list[float]:
        """Each rank's expected time for its part of a step, relative to the fastest rank's."""
        return shares.step_times(self.shares, self.weights) if self.weights else []

    @property
    def args(self) -> list[str]:
        """The flags every rank gets (before the user's own, which win)."""
        args = ["--batch-shares", ",".join(map(str, self.shares))]
        if any(self.limits):
            args += ["--max-micro-batch", ",".join(map(str, self.limits))]
        return args


def _ranks(cluster: Cluster) -> list[Node]:
    return [node for node in cluster.training_nodes for _ in range(node.slots)]


def weights(cluster: Cluster, calibration: Mapping[str, Any] | None) -> tuple[list[float], str]:
    """Each rank's weight, and where the weights come from."""
    ranks = _ranks(cluster)
    if not any(n.batch_share == AUTO for n in ranks):
        given = [float(n.batch_share) if n.batch_share is not None else 1.0 for n in ranks]
        return given, "batch_share in the inventory"
    return calibrated_weights(cluster, calibration)


def calibrated_weights(cluster: Cluster, calibration: Mapping[str, Any] | None) -> tuple[list[float], str]:
    """Each rank's weight from its node's calibrated speed (a node's ranks share it), and which
    calibration that was."""
    ranks = _ranks(cluster)
    if calibration is None:
        raise UserError("batch_share is auto, but no calibration of this model and max_seq_length "
                        "was found: run invoke bench.calibrate (with the same --model and settings) "
                        "first, or give each node a number")
    speeds = calibration.get("nodes", {})
    missing = sorted({n.name for n in ranks if not (speeds.get(n.name) or {}).get("tokens_per_second")})
    if missing:
        raise UserError(f"the calibration of {calibration.get('date')} has no speed for "
                        f"{', '.join(missing)}: run invoke bench.calibrate again")
    return ([speeds[n.name]["tokens_per_second"] / n.slots for n in ranks],
            f"the calibration of {calibration.get('date')} ("
            + ", ".join(f"{name} {speeds[name]['tokens_per_second']:,.0f} tok/s"
                        for name in dict.fromkeys(n.name for n in ranks)) + ")")


def inventory_sets_shares(cluster: Cluster) -> bool:
    """Whether any node that trains sets a batch_share or a max_micro_batch."""
    return any(n.batch_share is not None or n.max_micro_batch for n in cluster.training_nodes)


def for_run(cluster: Cluster, settings: FinetuneConfig,
            calibration: Mapping[str, Any] | None) -> Shares | None:
    """The shares to give the ranks of a run with these settings (None: no node asks
    for any, the config sets them itself, or every rank gets an equal share and no cap, which is
    what training does by itself)."""
    if not inventory_sets_shares(cluster):
        return None
    if settings.batch_shares or settings.parallel == "tensor":  # tensor: all ranks take the whole batch
        return None
    if settings.parallel == "pipeline":
        return replica_shares(cluster, settings, calibration)
    ranks = _ranks(cluster)
    given, source = weights(cluster, calibration)
    limits = [0 if settings.max_micro_batch else int(n.max_micro_batch or 0) for n in ranks]
    if len(set(given)) == 1 and not any(limits):
        return None
    try:
        cut = shares.split(settings.batch_size, given)
    except shares.ShareError as error:
        raise UserError(str(error)) from None
    return Shares(cut, limits, f"from {source}", given)


def replica_shares(cluster: Cluster, settings: FinetuneConfig,
                   calibration: Mapping[str, Any] | None) -> Shares | None:
    """A pipeline run's shares: one per replica of the stages (consecutive runs of ranks), each
    weighed as its slowest rank, since its micro-batches go through every one of its stages (None:
    one replica, or equal weights)."""
    stages = pipeline_stage_count(settings, cluster.world_size)
    replicas = cluster.world_size // stages
    if replicas < 2:
        return None
    given, source = weights(cluster, calibration)
    slowest = [min(given[replica * stages:(replica + 1) * stages]) for replica in range(replicas)]
    if len(set(slowest)) == 1:
        return None
    try:
        cut = shares.split(settings.batch_size, slowest)
    except shares.ShareError as error:
        raise UserError(str(error)) from None
    return Shares(cut, [0] * replicas, f"from {source}, each replica of the stages as its slowest rank",
                  slowest)
