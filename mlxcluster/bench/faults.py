"""`invoke bench.faults`: what a run goes through when a Mac drops out, fault by fault, on a lab.

A fresh lab of N nodes on a bridge is provisioned and a stand-in model trains once without a
fault: the reference. Then the same run is trained once per fault, the fault coming to the last
node a few steps after a checkpoint (so that some work is lost, as it would be):

- kill: SIGKILL to the node's rank (a kill -9, a supervisor);
- freeze: SIGSTOP to the node's rank (a debugger, a suspended job);
- unplug: the node's cluster link down (plugged back after the run);
- hang: the node's rank holds still after the fault's step, every thread but training's running
  (injected: MLX_CLUSTER_FAULT, training/loop/heartbeat.py): every rank alive, a collective that
  never completes; the run goes on on every node;
- dead-link: the node's cluster link stays up and carries nothing (a bad cable; carrying again
  after the run);
- disk: the launcher's disk filled mid-run (its runs on a tmpfs of their own, filled up): the run
  stops naming it, the checkpoint before is kept; then, the space freed, `invoke train --resume`;
- controller: the controller's own `invoke train` killed with SIGKILL; then `invoke train
  --resume`, as a user would.

For each: whether the nodes stopped, seconds from the fault to the run called stuck (hang,
dead-link: the controller reads the ranks' beats), to the run resuming (rank 0 loaded the
checkpoint) and to its first step after that, the steps of work lost, the ranks it ended on, and
against the reference: the loss of the first step after the resume (the same training: float
rounding apart), the final loss and the largest difference of the final adapters. kill, freeze and
unplug and dead-link go on without the node, hang on every node (`invoke train` restarts by
itself); disk and controller on every node, from the checkpoint they left, after `invoke train
--resume`.

With `--shares 3,3,1,1` the nodes are mixed Macs (batch_share weights in the inventory): each
global batch is split in those proportions, and after a fault in the proportions of the nodes
left, the global batch the same (the run's shares before and after are reported).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mlxcluster.bench import provision, results
from mlxcluster.describe.cluster import recorded
from mlxcluster.errors import UserError
from mlxcluster.lab import hosts
from mlxcluster.launch import remote, runs
from mlxcluster.launch.parallel import flags as parallel_flags
from mlxcluster.paths import REPO

INVOKE = str(Path(sys.executable).parent / "invoke")
# The modes whose restarts this bench measures (a pipeline run's would re-slice its stages: not yet).
PARALLEL = ("data", "tensor")
FAULTS = ("kill", "freeze", "unplug", "hang", "dead-link", "disk", "controller")
RANK = b"training.finetune"
_STEP = re.compile(r"iter\s+(\d+)/(\d+)\s+loss")
_RESUMED = re.compile(r"resuming from \S+ \(step (\d+) of \d+\)")
_STUCK = "==> stuck: "  # the controller's verdict from the beats (mlxcluster/launch/relay.py)
_INJECTED = "fault injected: this rank holds still"  # training/loop/heartbeat.py
# The loss of the first step trained after a restart against the uninterrupted run's at that step:
# the same batches from the same weights, summed over fewer ranks in another order (float rounding,
# measured 2e-6). Later steps drift apart as those roundings compound (Adam turns a gradient's
# rounding-sized difference into a step-sized one where the gradient is near zero): the final
# adapters and losses are reported, not held to this.
TOLERANCE = 1e-4


@dataclass
class Timeline:
    """What `invoke train` printed, each line with when it arrived (time.monotonic())."""

    lines: list[tuple[float, str]] = field(default_factory=list)

    def steps_before(self, moment: float) -> int:
        """The last step reported before `moment` (0: none)."""
        found = [int(m[1]) for t, line in self.lines if t <= moment and (m := _STEP.search(line))]
        return max(found, default=0)

    def resumed_after(self, moment: float) -> tuple[float, int] | None:
        """(when, from which step) the run resumed after `moment`; None if it did not."""
        for t, line in self.lines:
            if t > moment and (m := _RESUMED.search(line)):
                return t, int(m[1])
        return None

    def first_after(self, moment: float, words: str) -> float | None:
        return next((t for t, line in self.lines if t > moment and words in line), None)

    def first_step_after(self, moment: float) -> float | None:
        return next((t for t, line in self.lines if t > moment and _STEP.search(line)), None)


def measured(timeline: Timeline, fault_at: float, lost_from: int | None = None) -> dict[str, Any]:
    """The figures of one fault from the output of the run (or runs) that went through it."""
    before = timeline.steps_before(fault_at)
    resumed = timeline.resumed_after(fault_at)
    if resumed is None:
        return {"last_step_before_fault": before, "resumed": False}
    when, step = resumed
    first = timeline.first_step_after(when)
    last = lost_from if lost_from is not None else before
    # Ranks that outlived a killed controller may have saved a later checkpoint before they stopped.
    stuck = timeline.first_after(fault_at, _STUCK)
    return {"last_step_before_fault": before, "resumed": True, "resumed_from_step": step,
            "steps_lost": max(0, last - step), "steps_saved_after_fault": max(0, step - last),
            "fault_to_stuck_s": round(stuck - fault_at, 1) if stuck else None,
            "fault_to_resumed_s": round(when - fault_at, 1),
            "fault_to_training_s": round(first - fault_at, 1) if first else None}


def training(inventory: Path, model: Path, data: Path, settings: str, *flags: str,
             fault: str = "") -> subprocess.Popen[str]:
    """`invoke train`, its output followed; `fault`: one its ranks inject (MLX_CLUSTER_FAULT)."""
    return subprocess.Popen(
        [INVOKE, "train", "-i", str(inventory), "--model", str(model), "--data", str(data), *flags,
         "--extra", settings],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
        env={**os.environ, "MLX_CLUSTER_FAULT": fault} if fault else None)


def follow(proc: subprocess.Popen[str], timeline: Timeline,
           until: Callable[[str], bool] | None = None) -> None:
    """Read the process's output into `timeline`, until a line satisfies `until` (or the end)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        timeline.lines.append((time.monotonic(), line.rstrip("\n")))
        if until is not None and until(line):
            return


def at_step(step: int) -> Callable[[str], bool]:
    return lambda line: bool((m := _STEP.search(line)) and int(m[1]) >= step)


def losses(run: Path) -> dict[int, float]:
    """A run's train loss by step, from its metrics.jsonl."""
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return {}
    records = [json.loads(line) for line in lines if line.strip()]
    return {r["iteration"]: r["train_loss"] for r in records if "train_loss" in r}


def against_reference(run: Path, reference: Path, resumed_from: int | None) -> dict[str, Any]:
    """How the run's training compares with the uninterrupted one's: the loss of the first step
    after the resume, the final losses, and the adapters."""
    mine, theirs = losses(run), losses(reference)
    first = (resumed_from or 0) + 1
    final = max(theirs, default=None)
    return {
        "first_step_after_resume": first,
        "first_step_loss_difference": abs(mine[first] - theirs[first])
        if first in mine and first in theirs else None,
        "final_train_loss": mine.get(final) if final else None,
        "final_train_loss_uninterrupted": theirs.get(final) if final else None,
        "max_adapter_difference": adapters_difference(reference, run),
    }


def adapters_difference(a: Path, b: Path) -> float | None:
    import mlx.core as mx

    try:
        first, second = mx.load(str(a / "adapters.safetensors")), mx.load(str(b / "adapters.safetensors"))
    except (OSError, ValueError, RuntimeError):
        return None
    assert isinstance(first, dict) and isinstance(second, dict)
    return max(mx.abs(first[k] - second[k]).max().item() for k in first)


def ranks_left(lab: hosts.Lab, nodes: Sequence[int], timeout: float) -> dict[str, int]:
    """Wait up to `timeout` s for every node's ranks to end: those still running, by node."""
    deadline = time.monotonic() + timeout
    while True:
        left = {f"node{i}": len(hosts.processes(lab, i, RANK)) for i in nodes}
        if not any(left.values()) or time.monotonic() > deadline:
            return {name: n for name, n in left.items() if n}
        time.sleep(0.5)


def launcher_line(inventory: Path, line: str) -> None:
    """A shell line run on the launcher, as root over its ssh (the lab's nodes log in as root)."""
    head = recorded(str(inventory)).cluster.head
    subprocess.run(remote.ssh_command(head, line), check=True, capture_output=True, timeout=120,
                   stdin=subprocess.DEVNULL)


def resume(inventory: Path, timeline: Timeline) -> subprocess.Popen[str]:
    """`invoke train --resume`, as the user types it after a stop, followed to its end."""
    proc = subprocess.Popen([INVOKE, "train", "-i", str(inventory), "--resume"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL)
    follow(proc, timeline)
    proc.wait(timeout=60)
    return proc


def one_fault(fault: str, lab: hosts.Lab, inventory: Path, inputs: tuple[Path, Path], settings: str,
              fault_step: int, reference: Path, nodes: int, flags: Sequence[str] = ()) -> dict[str, Any]:
    """Train with `fault` coming at `fault_step` (invoke train's `flags` added); the figures."""
    victim = 1 if fault == "disk" else nodes  # the launcher's disk; else the last node
    runs_dir = recorded(str(inventory)).cluster.head.runs_dir
    found: dict[str, Any] = {"fault": fault,
                             "node": "controller" if fault == "controller" else f"node{victim}"}
    if fault == "disk":  # a disk of its own for the runs, to fill
        launcher_line(inventory, f"mkdir -p {runs_dir} && mount -t tmpfs -o size=256m tmpfs {runs_dir}")
    timeline = Timeline()
    proc = training(inventory, *inputs, settings, *flags,
                    fault=f"hang:{victim - 1}:{fault_step}" if fault == "hang" else "")
    try:
        follow(proc, timeline, (lambda line: _INJECTED in line) if fault == "hang" else at_step(fault_step))
        fault_at = time.monotonic()
        if fault in ("kill", "freeze"):
            for pid in hosts.processes(lab, victim, RANK):
                os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        elif fault == "unplug":
            hosts.set_link(lab, victim, up=False)
        elif fault == "dead-link":
            hosts.set_carrying(lab, victim, carrying=False)
        elif fault == "controller":
            proc.kill()
        elif fault == "disk":
            launcher_line(inventory, f"dd if=/dev/zero of={runs_dir}/filler bs=1M 2>/dev/null; true")
        follow(proc, timeline)
        proc.wait(timeout=60)
        before = timeline.steps_before(fault_at)
        if fault == "controller":
            left = ranks_left(lab, range(1, nodes + 1), timeout=60)
            found |= {"nodes_stopped": not left, "ranks_still_running": left,
                      "nodes_stopped_s": round(time.monotonic() - fault_at, 1)}
        if fault == "disk":
            said = [line for _, line in timeline.lines if "no space left" in line]
            found |= {"stopped": proc.returncode != 0, "said": said[-1] if said else None}
            launcher_line(inventory, f"rm -f {runs_dir}/filler")
        if fault in ("controller", "disk"):  # the user goes on
            proc = resume(inventory, timeline)
            found |= measured(timeline, fault_at, lost_from=before)
        else:
            found |= measured(timeline, fault_at)
    finally:
        proc.kill()
        if fault == "unplug":
            hosts.set_link(lab, victim, up=True)
        if fault == "dead-link":
            hosts.set_carrying(lab, victim, carrying=True)
        for i in range(1, nodes + 1):  # a frozen rank the teardown missed, a run left behind
            for pid in hosts.processes(lab, i, RANK):
                with_signal(pid, signal.SIGKILL)
        if fault == "disk":
            launcher_line(inventory, f"umount {runs_dir}")
    return found | outcome(timeline, proc.returncode, reference, found.get("resumed_from_step"))


def outcome(timeline: Timeline, code: int | None, reference: Path,
            resumed_from: int | None) -> dict[str, Any]:
    """How a run that went through a fault ended (exit status `code`): the restart it said, the
    ranks it ended on and its shares, and its figures against the reference run's."""
    output = "\n".join(line for _, line in timeline.lines)
    run = runs.named_in(output)
    said = [line for line in output.splitlines() if line.startswith("==> ") and
            (" is left out (" in line or "nothing was lost (a hang)" in line)]
    found: dict[str, Any] = {"finished": code == 0 and run is not None, "exit": code,
                             "restart_said": said[0] if said else None}
    if run is None:
        return found | {"output": output[-1500:]}
    info = _read(run / "run.json")
    return found | {"run": run.name, "world_sizes": _read(run / "summary.json").get("world_sizes"),
                    "attempts": info.get("attempts"), "batch_shares": info.get("batch_shares"),
                    **against_reference(run, reference, resumed_from)}


def with_signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def verdict(result: dict[str, Any]) -> list[str]:
    """What went wrong, a line each (none: every fault was gone through)."""
    wrong = []
    for found in result["faults"]:
        name = found["fault"]
        if not found.get("finished"):
            wrong.append(f"{name}: the run did not finish: {found.get('output', '')[-300:]}")
            continue
        if not found.get("resumed"):
            wrong.append(f"{name}: the run never resumed from a checkpoint")
        diff = found.get("first_step_loss_difference")
        if diff is None or diff > TOLERANCE:
            wrong.append(f"{name}: the first step after the resume has a loss {diff} from the "
                         f"uninterrupted run's (allowed {TOLERANCE}): not the same training")
        expected = {"hang": "nothing was lost (a hang)", "dead-link": "is left out (dead link)"}.get(name)
        if expected and expected not in (found.get("restart_said") or ""):
            wrong.append(f"{name}: the restart did not say {expected!r}: {found.get('restart_said')}")
        if name in ("hang", "dead-link") and found.get("fault_to_stuck_s") is None:
            wrong.append(f"{name}: the controller never called the run stuck")
        if name == "disk" and not (found.get("stopped") and found.get("said")):
            wrong.append("disk: the full disk did not stop the run with its reason")
        if name == "controller" and not found.get("nodes_stopped"):
            wrong.append("controller: ranks ran on after invoke train was killed: "
                         f"{found['ranks_still_running']}")
    return wrong


def with_shares(inventory: Path, shares: Sequence[float]) -> None:
    """The lab's inventory with a batch_share weight per node, in node order (mixed Macs)."""
    data = yaml.safe_load(inventory.read_text())
    nodes = data["cluster"]["children"]["linux"]["hosts"]
    for name, share in zip(sorted(nodes, key=lambda n: int(n.removeprefix("node"))), shares, strict=True):
        nodes[name]["batch_share"] = share
    inventory.write_text(yaml.safe_dump(data, sort_keys=False))


def run(nodes: int = 3, lab_id: int = 8, iters: int = 40, save_every: int = 10,
        faults: Sequence[str] = FAULTS, output: str | None = None, parallel: str = "data",
        shares: Sequence[float] = ()) -> Path:
    """Every fault in `faults` on a fresh lab of `nodes` hosts, training in `parallel` mode (data,
    or tensor: the stand-in's heads divide among every count of ranks a fault leaves), the nodes
    weighted by `shares` if given; the JSON written."""
    parallel_flags(parallel)  # refuses another word
    if parallel not in PARALLEL:  # a restart re-slicing the stages over the nodes left is not there yet
        raise UserError("bench.faults: --parallel data or tensor; a pipeline run's restarts are not "
                        "measured yet")
    if nodes < 2:
        raise UserError("--nodes: a fault on one of them needs at least 2 nodes")
    if shares and (len(shares) != nodes or parallel == "tensor"):
        raise UserError(f"--shares: one weight per node ({nodes}), and data parallelism only (a "
                        "tensor-parallel rank takes the whole batch)")
    if unknown := [f for f in faults if f not in FAULTS]:
        raise UserError(f"--faults: {', '.join(unknown)} unknown; choose from {', '.join(FAULTS)}")
    fault_step = save_every + save_every // 2  # half an interval of work is lost
    if iters <= fault_step + 2:
        raise UserError(f"--iters {iters}: the faults come at step {fault_step}; give at least "
                        f"{fault_step + 3}")
    settings = (f"--iters {iters} --batch-size {2 * nodes} --num-layers 1 --max-seq-length 256 "
                f"--learning-rate 1e-3 --steps-per-report 1 --steps-per-eval {iters} --val-batches 1 "
                f"--save-every {save_every} --stall-timeout 10")
    with tempfile.TemporaryDirectory(prefix="mlx-faults-") as tmp, hosts.fresh(nodes, lab_id) as inventory:
        lab = hosts.Lab(lab_id)
        if shares:
            with_shares(inventory, shares)
        result: dict[str, Any] = {"benchmark": "faults", "date": results.date(), "nodes": nodes,
                                  "parallel": parallel, "shares": list(shares) or None,
                                  "iters": iters, "save_every": save_every,
                                  "fault_at_step": fault_step,
                                  "settings": settings, "provision": provision.twice(inventory, nodes)}
        # Tensor parallel: heads that divide among the nodes, and among the nodes a fault leaves.
        inputs = stand_in(Path(tmp), nodes * (nodes - 1) if parallel == "tensor" else 2)
        flags = ("--parallel", parallel)
        timeline = Timeline()
        proc = training(inventory, *inputs, settings, *flags)
        follow(proc, timeline)
        reference = runs.named_in("\n".join(line for _, line in timeline.lines))
        if proc.wait() != 0 or reference is None:
            said = "\n".join(line for _, line in timeline.lines[-30:])
            raise UserError(f"the uninterrupted run failed:\n{said}")
        took = timeline.lines[-1][0] - timeline.lines[0][0]
        result["reference"] = {"run": reference.name, "seconds": round(took, 1),
                               "batch_shares": _read(reference / "run.json").get("batch_shares")}
        result["faults"] = [one_fault(fault, lab, inventory, inputs, settings, fault_step, reference, nodes,
                                      flags) for fault in faults]
    result["wrong"] = verdict(result)
    summary = "\n".join(summary_line(found, bool(shares)) for found in result["faults"])
    return results.held("faults", result, output, summary, "a fault was not gone through")


def summary_line(found: dict[str, Any], shares: bool) -> str:
    """One fault's figures, as the bench prints them."""
    ranks = f"{found.get('world_sizes')} ranks"
    if shares:
        ranks += f" (shares {found.get('batch_shares')})"
    stuck = f"stuck {found['fault_to_stuck_s']} s after the fault, " if found.get("fault_to_stuck_s") else ""
    return (f"{found['fault']:>10}: {'finished' if found.get('finished') else 'FAILED'} on {ranks}; {stuck}"
            f"training again {found.get('fault_to_training_s')} s after the fault, "
            f"{found.get('steps_lost')} steps lost; against the uninterrupted run: first step's loss "
            f"{found.get('first_step_loss_difference')}, final loss {found.get('final_train_loss')} / "
            f"{found.get('final_train_loss_uninterrupted')}, adapters {found.get('max_adapter_difference')}")


def stand_in(folder: Path, ranks: int = 2) -> tuple[Path, Path]:
    """A small stand-in model that shards across `ranks` (and each count that divides it), with
    its manifest, and the bundled demo data prepared."""
    from training.data.prepare import prepare
    from training.model import folder as model_folder
    from training.model import stand_in as stand_ins

    stand_ins.make(folder / "source", **stand_ins.shape_for(ranks))
    model = model_folder.fetch(str(folder / "source"), folder / "stand-in", "float32")
    prepare(REPO / "training" / "data" / "pirate.jsonl", folder / "pirate")
    return model, folder / "pirate"
