"""`invoke train` going on when a Mac drops out, on the session's three lab nodes: each fault comes
just after a checkpoint, and each run is held to one process trained on the controller on the same
global batches (its config.yaml: what an uninterrupted run equals, tests/cluster/conftest.py).

- tensor parallelism: node3 killed, the checkpoint's whole arrays re-sharded over node1 and node2;
  then node2 killed, and node1 goes on alone: one rank is data parallelism;
- mixed Macs (batch_share 1, 2, 3): node3 killed, the same global batch split 1:2 over the two left;
- a frozen node (SIGSTOP of node2's rank): named frozen, left out, the run ends on node1 and node3
  (their shares 1:3).

The nodes are those test_site.py provisioned (it adds a fourth, stopped here and brought back
after): the lab's own inventory, of three nodes with batch shares, recorded by a `--tags hostfile`
run. So this module runs after test_site.py, which wants fresh nodes (conftest.py's LABS).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from mlxcluster import paths
from mlxcluster.lab import hosts
from tests.cluster.conftest import TEST_LAB_ID, LabCluster, assert_trains_as_one_process, one_process_run
from tests.cluster.test_train import INVOKE, REPO, finetune_pids
from training.loop import report

pytestmark = pytest.mark.cluster

# Each node's weight (mixed Macs: node3 three times as fast as node1): a global batch of 6 is 1, 2, 3
# on the three nodes and 2, 4 on node1 and node2; one of 4 is 1, 1, 2, and 1, 3 on node1 and node3.
SHARES = {"node1": 1, "node2": 2, "node3": 3}
# Few short steps and a checkpoint every 4. A fault comes as the controller reads the line of a
# checkpoint; a validation after every step keeps the run from ending before it lands. It validates
# on the same steps as one process only so: a resumed run starts its cadence again at its step.
SETTINGS = ("--num-layers 1 --max-seq-length 256 --learning-rate 1e-3 --steps-per-report 1 --save-every 4 "
            "--steps-per-eval 1 --val-batches 2 --stall-timeout 8")
# A restart sums the same gradients over fewer ranks in another order: float rounding, as between
# an uninterrupted run and one process (measured: at most 9.3e-6 on the adapters and losses, 3.3e-6
# on the loss of the first step after a restart). Adam can blow a rounding up where a gradient is
# near zero: with --max-seq-length 128 the uninterrupted 3 ranks of the shares test once ended
# 5.9e-4 from one process in a single element.
TOLERANCE = 1e-4
TIMEOUT = 900  # s, for a whole `invoke train` and its restarts


@pytest.fixture(scope="module")
def three(lab_cluster: LabCluster) -> Iterator[LabCluster]:
    """The session's lab as its three nodes on the bridge, weighted by SHARES, as provisioned: a
    fourth node (test_site.py's) is stopped and its record dropped by a `--tags hostfile` run. All
    of it is put back after (the fourth node, the inventory, the hostfiles, the record), and the
    nodes left out by the tests are let back in."""
    lab, inventory = lab_cluster.lab, lab_cluster.inventory
    build = paths.build_dir_for(inventory)
    if any(lab_cluster.ssh(n, "test -e /opt/mlx-cluster/hostfile").returncode for n in (1, 2, 3)):
        # Alone (fresh nodes; a record in build/ may be an earlier lab's): provisioned here.
        run = lab_cluster.playbook()
        assert run.returncode == 0, json.dumps(run.failures, indent=1)
    extra = [n for n in lab.nodes() if n > 3]
    text, record = inventory.read_text(), (build / "cluster.json").read_text()
    for node in extra:
        hosts.stop_node(lab, node)
    hosts.up(3, TEST_LAB_ID)  # the inventory of nodes 1 to 3
    weighted = yaml.safe_load(inventory.read_text())
    for name, node in weighted["cluster"]["children"]["linux"]["hosts"].items():
        node["batch_share"] = SHARES[name]
    inventory.write_text(yaml.safe_dump(weighted, sort_keys=False))
    try:
        run = lab_cluster.playbook("--tags", "hostfile")
        assert run.returncode == 0, json.dumps(run.failures, indent=1)
        yield lab_cluster
    finally:
        (build / "drained.json").unlink(missing_ok=True)
        if extra:
            hosts.up(max(extra), TEST_LAB_ID)
        inventory.write_text(text)
        if extra:  # the hostfiles on the nodes list the fourth again
            run = lab_cluster.playbook("--tags", "hostfile")
            assert run.returncode == 0, json.dumps(run.failures, indent=1)
        (build / "cluster.json").write_text(record)


@pytest.fixture
def drained(three: LabCluster) -> Iterator[Path]:
    """build/<inventory>/drained.json, where a restart records the node it left out: removed after
    the test (every node is healthy again), so that the next run has them all without checking."""
    path = paths.build_dir_for(three.inventory) / "drained.json"
    yield path
    path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def six_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stand-in whose 6 heads (and key-value heads) shard over 3 ranks, and over 2."""
    from training.model import folder, stand_in

    tmp = tmp_path_factory.mktemp("six-heads")
    stand_in.make(tmp / "source", **stand_in.shape_for(6))
    return folder.fetch(str(tmp / "source"), tmp / "six-heads", "float32")


@dataclass
class Faulted:
    """An `invoke train` that went through faults: its exit status and output, and the training
    processes still on the nodes once it had returned (by node; none: nothing was left)."""

    code: int | None
    stdout: str
    stderr: str
    left_running: dict[int, list[int]]

    @property
    def run(self) -> Path:
        """The run's folder in runs/, whether it finished or not (removed by the test)."""
        found = re.search(r"/runs/(\d{8}-\d{6}(?:-\d+)?)/", self.stdout + self.stderr)
        assert found, self.stdout[-3000:] + self.stderr[-3000:]
        return paths.RUNS / found[1]


def faults_at_checkpoints(cluster: LabCluster, model: Path, data: Path,
                          faults: Sequence[tuple[int, int, int]], *flags: str) -> Faulted:
    """`invoke train` of SETTINGS and `flags`; each fault (step, node, signal) sent in turn to the
    node's rank (its python) as soon as the checkpoint of that step is saved, the next one only after
    the restart the one before caused. Every rank signalled is SIGKILLed after (a stopped one stays
    stopped)."""
    train = subprocess.Popen(
        [INVOKE, "train", "-i", str(cluster.inventory), "--model", str(model), "--data", str(data), *flags,
         "--extra", SETTINGS],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    assert train.stdout is not None
    overdue = threading.Timer(TIMEOUT, train.kill)
    overdue.start()
    seen: list[str] = []
    signalled: list[int] = []
    pending = list(faults)
    try:
        restarted = True
        for line in train.stdout:
            seen.append(line)
            restarted = restarted or " is left out (" in line
            if not (pending and restarted):
                continue
            step, node, sig = pending[0]
            if "saved" in line and line.rstrip().endswith(f"checkpoints/{step:07d}"):
                ranks = hosts.processes(cluster.lab, node, b"training.finetune")
                assert ranks, f"no rank on node{node} at step {step}"
                for pid in ranks:  # as a kill -9 or a debugger would
                    os.kill(pid, sig)
                signalled += ranks
                pending.pop(0)
                restarted = False
        stdout, stderr = train.communicate(timeout=60)
        deadline = time.monotonic() + 20  # the teardown of the last launch may still be ending
        while (left := {n: pids for n in (1, 2, 3) if (pids := finetune_pids(cluster, n))}) \
                and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        overdue.cancel()
        train.kill()
        for pid in signalled:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    faulted = Faulted(train.returncode, "".join(seen) + stdout, stderr, left)
    if pending:
        shutil.rmtree(faulted.run, ignore_errors=True)
        raise AssertionError(f"the run ended before the checkpoints of {pending}: "
                             f"{faulted.stdout[-3000:]}{stderr[-3000:]}")
    return faulted


def held_to_one_process(run: Path, model: Path, data: Path, out: Path, restarted_at: Sequence[int]) -> str:
    """The run against one process on the same global batches: the loss of the first step after
    each restart, the adapters and every reported loss within TOLERANCE; the differences, said."""
    reference = one_process_run(run, model, data, out)

    def losses(folder: Path) -> dict[int, float]:
        records = report.read_metrics(folder / "metrics.jsonl")
        return {r["iteration"]: r["train_loss"] for r in records if "train_loss" in r}

    ours, one = losses(run), losses(reference)
    first = [abs(ours[step + 1] - one[step + 1]) for step in restarted_at]
    assert max(first) < TOLERANCE, first
    difference = assert_trains_as_one_process(run, reference, tolerance=TOLERANCE)
    firsts = ", ".join(f"{d:.2g}" for d in first)
    return f"first step after each restart {firsts}; adapters and losses {difference:.2g}"


def left_out(run: Path) -> list[tuple[str, str, int]]:
    """run.json's nodes the run went on without: (node, cause, step) each."""
    return [(d["node"], d["cause"], d["step"]) for d in json.loads((run / "run.json").read_text())["drained"]]


def test_a_tensor_parallel_run_re_shards_over_the_nodes_left_then_goes_on_alone_as_data(
        three, drained, six_heads, tiny_inputs, tmp_path):
    """Three ranks each hold a third of every layer; node3 killed after step 4: the checkpoint's
    whole arrays are re-sharded in halves over node1 and node2; node2 killed after step 8: node1
    holds the whole model and trains alone. Every rank took the whole batch all along (the shares
    of the inventory do not apply): one process's training."""
    data = tiny_inputs[1]
    faulted = faults_at_checkpoints(three, six_heads, data, [(4, 3, signal.SIGKILL), (8, 2, signal.SIGKILL)],
                                    "--parallel", "tensor", "--batch-size", "4", "--iters", "12")
    out, run = faulted.stdout, faulted.run
    try:
        assert faulted.code == 0, out[-3000:] + faulted.stderr[-3000:]
        for ranks in (3, 2):
            said = f"==> tensor parallel: each of the {ranks} ranks holds 1/{ranks} of every layer"
            assert said in out, out[-3000:]
        assert "==> batch shares" not in out
        assert "==> node3 is left out (killed); restarting run " in out
        assert "from its checkpoint at step 4 on 2 ranks (node1, node2), restart 1 of at most 3" in out
        assert "==> node2 is left out (killed); restarting run " in out
        assert "from its checkpoint at step 8 on 1 rank (node1), restart 2 of at most 3" in out
        assert "==> node1 alone holds the whole model: no tensor parallelism on one rank\n" in out
        assert "resuming run " + run.name + " on 1 rank (one process, no launcher)" in out, out[-3000:]
        summary = json.loads((run / "summary.json").read_text())
        assert summary["world_sizes"] == [3, 2, 1] and summary["iterations"] == 12
        info = json.loads((run / "run.json").read_text())
        assert (info["status"], info["attempts"], info["parallel"]) == ("finished", 3, "data")
        assert left_out(run) == [("node3", "killed", 4), ("node2", "killed", 8)]
        assert faulted.left_running == {}
        print("tensor 3 -> 2 -> 1 ranks against 1 process: "
              + held_to_one_process(run, six_heads, data, tmp_path / "one", [4, 8]))
    finally:
        shutil.rmtree(run, ignore_errors=True)


def test_mixed_macs_keep_their_proportions_among_the_nodes_left(three, drained, tiny_inputs, tmp_path):
    """batch_share 1, 2, 3: a global batch of 6 is 1, 2, 3; node3 killed after step 4, the same 6
    are 2 and 4 on node1 and node2 (1:2 still), and the run trains as one process on all 6."""
    model, data = tiny_inputs
    faulted = faults_at_checkpoints(three, model, data, [(4, 3, signal.SIGKILL)], "--batch-size", "6",
                                    "--iters", "8")
    out, run = faulted.stdout, faulted.run
    try:
        assert faulted.code == 0, out[-3000:] + faulted.stderr[-3000:]
        said = "(from batch_share in the inventory); each rank's part of a step"
        assert f"==> batch shares 1,2,3 {said} 1.00, 1.00, 1.00x the fastest's" in out, out[-3000:]
        assert f"==> batch shares 2,4 {said} 1.00, 1.00x the fastest's" in out, out[-3000:]
        assert "==> node3 is left out (killed); restarting run " in out
        assert "from its checkpoint at step 4 on 2 ranks (node1, node2)" in out
        summary = json.loads((run / "summary.json").read_text())
        assert summary["world_sizes"] == [3, 2] and summary["batch"]["shares"] == [2, 4]
        info = json.loads((run / "run.json").read_text())
        assert (info["status"], info["attempts"]) == ("finished", 2)
        assert (info["batch_shares"], info["layout_settings"]) == ([2, 4], ["batch_shares"])
        assert left_out(run) == [("node3", "killed", 4)]
        assert json.loads(drained.read_text())[0]["node"] == "node3"
        assert faulted.left_running == {}
        print("shares 1,2,3 -> 2,4 against 1 process: "
              + held_to_one_process(run, model, data, tmp_path / "one", [4]))
    finally:
        shutil.rmtree(run, ignore_errors=True)


def test_a_frozen_node_is_named_left_out_and_the_run_goes_on_on_the_others(three, drained, tiny_inputs,
                                                                            tmp_path):
    """SIGSTOP of node2's rank just after step 4's checkpoint: the other ranks wait for it until
    the controller, reading their beats, calls the run stuck (8 s past its slowest step: a stall
    timeout of 8 s), finds node2's rank stopped and stops every rank,
    and the run goes on from step 4 on node1 and node3 (a global batch of 4: 1, 1, 2 on the three,
    1, 3 on the two), nothing left running on any node, the frozen rank included."""
    model, data = tiny_inputs
    faulted = faults_at_checkpoints(three, model, data, [(4, 2, signal.SIGSTOP)], "--batch-size", "4",
                                    "--iters", "8")
    out, run = faulted.stdout, faulted.run
    try:
        assert faulted.code == 0, out[-3000:] + faulted.stderr[-3000:]
        assert "==> stuck: no rank progressed for " in out, out[-3000:]  # the controller saw it first
        assert "==> node2 is left out (frozen); restarting run " in out, out[-3000:]
        assert "from its checkpoint at step 4 on 2 ranks (node1, node3)" in out
        assert "==> batch shares 1,1,2 (" in out and "==> batch shares 1,3 (" in out, out[-3000:]
        summary = json.loads((run / "summary.json").read_text())
        assert summary["world_sizes"] == [3, 2] and summary["batch"]["shares"] == [1, 3]
        info = json.loads((run / "run.json").read_text())
        assert (info["status"], info["attempts"], info["batch_shares"]) == ("finished", 2, [1, 3])
        assert left_out(run) == [("node2", "frozen", 4)]
        [entry] = json.loads(drained.read_text())
        assert (entry["node"], entry["cause"], entry["run"]) == ("node2", "frozen", run.name)
        assert "frozen: a rank's process on node2 was stopped" in entry["why"], entry
        assert faulted.left_running == {}  # the launcher's teardown ended the stopped rank
        print("node2 frozen, 3 -> 2 ranks against 1 process: "
              + held_to_one_process(run, model, data, tmp_path / "one", [4]))
    finally:
        shutil.rmtree(run, ignore_errors=True)

