"""`invoke train` on a provisioned 2-node lab cluster, as a user runs it.

A tiny llama trains for a few steps on both nodes through mpirun pinned to the
Thunderbolt-like link; the artifacts must arrive in runs/ on the controller.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcluster import lab
from tests.cluster.conftest import TEST_LAB_ID, LabCluster
from training import model as model_tools
from training.prepare import prepare

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
INVOKE = str(Path(sys.executable).parent / "invoke")


@pytest.fixture(scope="module")
def provisioned(tmp_path_factory: pytest.TempPathFactory):
    lab.prepare_offline_cache()
    lab.down(TEST_LAB_ID)
    inventory = lab.up(2, TEST_LAB_ID)
    facts = tmp_path_factory.mktemp("facts")
    cluster = LabCluster(lab.Lab(TEST_LAB_ID), inventory, facts)
    try:
        run = cluster.playbook()
        assert run.returncode == 0, json.dumps(run.failures, indent=1)
        yield cluster
    finally:
        lab.down(TEST_LAB_ID)


def test_train_runs_on_both_nodes_over_the_link_and_brings_results_back(provisioned, tmp_path):
    from tests.unit.test_model import tiny_model

    tiny_model(tmp_path / "tiny-src")
    model_dir = model_tools.fetch(str(tmp_path / "tiny-src"), tmp_path / "tiny", dtype="float32")
    data_dir = tmp_path / "pirate"
    prepare(REPO / "training/data/pirate.jsonl", data_dir)
    link_bytes = "cat /sys/class/net/bridge0/statistics/rx_bytes"
    before = int(provisioned.ssh(2, link_bytes).stdout)

    proc = subprocess.run(
        [INVOKE, "train", "-i", str(provisioned.inventory), "--model", str(model_dir),
         "--data", str(data_dir), "--iters", "8", "--batch-size", "2", "--extra",
         "--steps-per-report 2 --steps-per-eval 4 --val-batches 2 --num-layers 2 "
         "--learning-rate 1e-3 --max-seq-length 512"],
        cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "training on 2 ranks (mpi)" in proc.stdout
    run_dir = REPO / "runs" / next(line.split()[-1] for line in proc.stdout.splitlines()
                                   if line.strip().startswith("run 2"))
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["world_size"] == 2
        # The LoRA weights after training are identical on both ranks.
        assert summary["max_weight_difference_across_ranks"] == 0.0
        assert summary["final_train_loss"] < summary["first_train_loss"]
        for name in ("adapters.safetensors", "adapter_config.json", "metrics.jsonl", "loss.png",
                     "config.yaml", "run.json"):
            assert (run_dir / name).exists(), name
        # The ranks talked over bridge0 (the model fan-out and MPI), not only the management link.
        after = int(provisioned.ssh(2, link_bytes).stdout)
        assert after - before > 100_000
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def test_ring_backend_trains_with_mlx_launch_and_the_rendered_hosts_json(provisioned, tmp_path):
    from tests.unit.test_model import tiny_model

    tiny_model(tmp_path / "tiny-src")
    model_dir = model_tools.fetch(str(tmp_path / "tiny-src"), tmp_path / "tiny", dtype="float32")
    prepare(REPO / "training/data/pirate.jsonl", tmp_path / "pirate")
    proc = subprocess.run(
        [INVOKE, "train", "-i", str(provisioned.inventory), "--backend", "ring", "--model",
         str(model_dir), "--data", str(tmp_path / "pirate"), "--iters", "4", "--batch-size", "2",
         "--extra", "--steps-per-report 2 --steps-per-eval 4 --val-batches 1 --num-layers 1 "
         "--max-seq-length 512"],
        cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = REPO / "runs" / next(line.split()[-1] for line in proc.stdout.splitlines()
                                   if line.strip().startswith("run 2"))
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["world_size"] == 2
        assert summary["max_weight_difference_across_ranks"] == 0.0
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def test_dry_run_touches_no_host(provisioned):
    listing = "ls -A /opt/mlx-cluster/runs 2>/dev/null | wc -l"
    before = provisioned.ssh(1, listing).stdout
    proc = subprocess.run([INVOKE, "train", "-i", str(provisioned.inventory), "--dry-run"],
                          cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert "--hostfile /opt/mlx-cluster/hostfile -np 2" in proc.stdout
    assert provisioned.ssh(1, listing).stdout == before
