"""invoke train going on when a Mac drops out: the node is left out, the run restarts on the rest.

A run that fails for a node's own cause (mlxcluster/check/faults.py: killed from outside, frozen,
lost, its link dead) is restarted, by default, from its latest checkpoint on the nodes left, with
the same global batch: the batch shares are recomputed for them (mlxcluster/launch/batch_shares.py) and
the batches are the seed's (training/data/batches.py), so the run ends with the adapters an
uninterrupted one would have, within float rounding. A tensor-parallel run re-shards the
checkpoint's whole arrays over the ranks left, once the model's heads divide among them and its
shards fit their memory (the same checks as any launch; else it stops and says why and how much).

A run that hung with nothing lost (every rank alive, every link carrying data: a collective that
never completed) is restarted the same way on the same nodes.

The node is recorded as left out (mlxcluster/describe/drained.py) and stays out until its checks
pass again: every launch first checks the nodes left out and lets the green ones back in.

As torchrun's --max-restarts and --nnodes=MIN:MAX: at most `max_restarts` restarts, never on
fewer than `min_nodes` nodes; --max-restarts 0 turns restarting off.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from mlxcluster.check import doctor
from mlxcluster.check.faults import Fault, TrainFailed
from mlxcluster.describe import drained
from mlxcluster.describe.cluster import Cluster, NotReady, Recorded
from mlxcluster.errors import UserError
from mlxcluster.launch import runs


class Launched(Protocol):
    """What run_with_restarts needs of a plan (mlxcluster/jobs/train.py's Plan): the layout it runs on."""

    @property
    def cluster(self) -> Cluster: ...


RunPlan = TypeVar("RunPlan", bound=Launched)  # train.Plan, or a test's stand-in

DEFAULT_MAX_RESTARTS = 3


@dataclass(frozen=True)
class Policy:
    """How far a run goes on after faults: restarts at most, and nodes at least."""

    max_restarts: int = DEFAULT_MAX_RESTARTS
    min_nodes: int = 1

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise UserError(f"--max-restarts must be 0 (no restart) or more, not {self.max_restarts}")
        if self.min_nodes < 1:
            raise UserError(f"--min-nodes must be 1 or more, not {self.min_nodes}")

    def refusal(self, restarts: int, left: Cluster) -> str:
        """Why the run does not restart after `restarts` restarts on the layout `left` ("": it does)."""
        if self.max_restarts == 0:
            return "restarts are off (--max-restarts 0)"
        if restarts >= self.max_restarts:
            return (f"it was restarted {restarts} time{'s' * (restarts != 1)} already (--max-restarts "
                    f"{self.max_restarts})")
        if (nodes := len(left.training_nodes)) < self.min_nodes:
            return (f"{nodes} node{'s' * (nodes != 1)} would be left, fewer than --min-nodes "
                    f"{self.min_nodes}")
        return ""

    def check_start(self, cluster: Cluster, recorded: Cluster) -> None:
        """Refuse a run that starts on fewer nodes than it may go on with (`cluster`: the nodes
        not left out of the `recorded` one)."""
        if (have := len(cluster.training_nodes)) < self.min_nodes:
            out = len(recorded.training_nodes) - have
            raise UserError(f"--min-nodes {self.min_nodes}, but {have} node{'s' * (have != 1)} can train"
                            + (f" now ({out} left out: invoke doctor says why)" if out else ""))


def rejoined(rec: Recorded, doing: str = "training") -> Cluster:
    """The layout to launch on: the recorded cluster without the nodes left out whose checks are
    still red, each said in a line (`doing` goes on without it); the ones whose checks pass again
    rejoin (said, and removed from the record)."""
    out = drained.read(rec.build)
    if not out:
        return rec.cluster
    print(f"==> checking the node{'s' * (len(out) > 1)} left out: {', '.join(sorted(out))}", flush=True)
    red = doctor.red_node_checks(rec.cluster, None)
    still = {name for name in out if doctor.red_for(name, red)}
    for entry in drained.rejoin(rec.build, set(out) - still):
        print(f"==> {entry.node} rejoins: its checks pass again (it was left out by run {entry.run}: "
              f"{entry.cause})", flush=True)
    for name in sorted(still):
        print(f"==> {out[name].line}; its checks still fail (invoke doctor -i {rec.inventory} shows "
              f"them; it is let back in at the first launch after they pass): {doing} without it",
              flush=True)
    return without(rec, still)


def layout(rec: Recorded, *, dry_run: bool = False, doing: str = "training") -> tuple[Cluster, list[str]]:
    """The layout a launch runs on (`rejoined`), and what a dry run says of it: a dry run touches
    no host, so it leaves out every node recorded as left out, with a note each."""
    if not dry_run:
        return rejoined(rec, doing), []
    out = drained.read(rec.build)
    return without(rec, set(out)), [f"{entry.line}: a run checks it first, and lets it back in if its "
                                    "checks pass" for entry in out.values()]


def without(rec: Recorded, names: set[str]) -> Cluster:
    """The recorded cluster less the nodes left out `names`; when no layout is left (no node that
    trains, no cable between those left), a NotReady that says how they come back."""
    if not names:
        return rec.cluster
    try:
        return rec.cluster.without(names)
    except NotReady as error:
        raise NotReady(f"{error}: {', '.join(sorted(names))} left out after a fault "
                       f"({rec.build / drained.FILE}); invoke doctor -i {rec.inventory} shows what fails "
                       "there, and a launch lets a node back in once its checks pass") from None


def left_out(rec: Recorded, run_id: str, fault_node: str, cause: str, why: str) -> drained.Drained:
    """Record that run `run_id` goes on without `fault_node`: in the cluster's record and run.json."""
    results = runs.RUNS / run_id
    entry = drained.Drained.now(fault_node, cause, why, run_id, runs.latest_checkpoint(results))
    drained.add(rec.build, entry)
    info = runs.read_info(results)
    runs.write_info(results, info | {"drained": [*info.get("drained", []), dataclasses.asdict(entry)]})
    return entry


def restart_everywhere_line(run_id: str, cluster: Cluster, restart: int, policy: Policy) -> str:
    """What a restart after a hang says: every node again, from the latest checkpoint."""
    step = runs.latest_checkpoint(runs.RUNS / run_id)
    where = f"its checkpoint at step {step}" if step is not None else "step 0 (no checkpoint yet)"
    return (f"==> nothing was lost (a hang); restarting run {run_id} from {where} on the same "
            f"{cluster.world_size} rank{'s' * (cluster.world_size != 1)}, restart {restart} of at most "
            f"{policy.max_restarts}")


def restart_line(entry: drained.Drained, left: Cluster, restart: int, policy: Policy) -> str:
    where = f"its checkpoint at step {entry.step}" if entry.step is not None else "step 0 (no checkpoint yet)"
    ranks = left.world_size
    return (f"==> {entry.node} is left out ({entry.cause}); restarting run {entry.run} from {where} on "
            f"{ranks} rank{'s' * (ranks != 1)} ({', '.join(n.name for n in left.training_nodes)}), "
            f"restart {restart} of at most {policy.max_restarts}")


def run_with_restarts(first: RunPlan, execute: Callable[[RunPlan], Path], policy: Policy,
                      again: Callable[[RunPlan, Cluster, Fault, int], RunPlan]) -> Path:
    """`execute` the plan; after a node's fault (a TrainFailed whose fault names it), leave the
    node out and execute the plan `again` makes of the run for the nodes left (restart 1, 2, ...),
    as `policy` allows. Why a run does not go on (past a bound, no layout left, `again`'s
    UserError) is said after the failure's own cause."""
    current = first
    for restart in itertools.count(1):
        try:
            return execute(current)
        except TrainFailed as failed:
            fault = failed.fault
            if fault is None or not (fault.goes_on_everywhere or fault.goes_on_without_node):
                raise
            left: Cluster | None = current.cluster
            try:
                if fault.node is not None and not fault.goes_on_everywhere:
                    left = current.cluster.without({fault.node})
            except UserError as error:
                left, no_layout = None, str(error)
            refusal = policy.refusal(restart - 1, left) if left else no_layout
            if not refusal:
                assert left is not None
                print(f"==> the run stopped: {fault.why}", flush=True)  # before the restart's plan
                try:
                    current = again(current, left, fault, restart)
                    continue
                except UserError as error:
                    refusal = str(error)
            raise failed.adding(f"not restarted {f'without {fault.node}' if fault.node else 'again'}: "
                                f"{refusal}") from None
    raise AssertionError("unreachable")
