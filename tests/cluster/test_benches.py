"""The benches' own runs end to end on the training lab: `invoke bench.links`, `bench.scaling` and
`bench.train`'s parts, each briefly. They are measurements, so they are not CI's (marked `bench`;
`invoke test` leaves them out): `invoke test --benches` runs them, as before reporting a bench's
figures. What the benches compute from their runs has unit tests (tests/unit/mlxcluster/bench/)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.cluster.test_train import INVOKE, REPO

pytestmark = [pytest.mark.cluster, pytest.mark.bench]

NODES = ["node1", "node2"]


def test_bench_links_measures_every_node_pair_and_all_reduce_on_both_backends(provisioned, tmp_path):
    output = tmp_path / "links.json"
    proc = subprocess.run([INVOKE, "bench.links", "-i", str(provisioned.inventory),
                           "--max-size", "4MB", "--output", str(output)],
                          cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=600)  # a launcher may leave an inherited stdin non-blocking
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(output.read_text())
    assert result["nodes"] == NODES
    sizes = [4096 * 4**k for k in range(6)]  # 4 KB .. 4 MB
    for backend in ("mpi", "ring"):
        run = result["backends"][backend]
        # One rank per node, on the node itself (the lab hosts' own host names).
        assert run["world_size"] == 2 and run["hostnames"] == NODES
        assert sorted((p["src"], p["dst"]) for p in run["pairs"]) == [(0, 1), (1, 0)], backend
        assert all(p["latency_us"] > 0 and p["bandwidth_gb_per_s"] > 0 for p in run["pairs"])
        assert [e["bytes"] for e in run["all_reduce"]] == sizes
        assert all(e["time_us"] > 0 and e["busbw_gb_per_s"] > 0 for e in run["all_reduce"])
    assert output.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
    assert "node2 -> node1" in proc.stdout and "4 MB" in proc.stdout  # the tables
    print(proc.stdout[proc.stdout.index("node pairs"):])


def test_bench_scaling_runs_on_one_node_and_on_all_and_reports_the_speedup(provisioned, tiny_inputs,
                                                                           tmp_path):
    model_dir, data_dir = tiny_inputs
    output = tmp_path / "scaling.json"
    proc = subprocess.run([INVOKE, "bench.scaling", "-i", str(provisioned.inventory),
                           "--model", str(model_dir), "--data", str(data_dir), "--iters", "6",
                           "--extra", "--num-layers 1 --max-seq-length 512 --val-batches 1",
                           "--output", str(output)],
                          cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(output.read_text())
    rows = result["rows"]
    assert [(r["nodes"], r["ranks"]) for r in rows] == [(1, 1), (2, 2)]
    assert result["global_batch_size"] % 2 == 0  # the same global batch on 1 and on 2 ranks
    assert rows[0]["speedup"] == 1.0 and rows[0]["efficiency"] == 1.0
    assert rows[1]["speedup"] > 0 and rows[1]["efficiency"] == round(rows[1]["speedup"] / 2, 3)
    for r in rows:
        assert r["iterations"] == 6 and r["tokens_per_second"] > 0
        assert set(r["time_split_s"]) == {"sync", "model_load", "training", "evaluation"}
        assert r["time_split_s"]["training"] > 0 and r["time_split_s"]["sync"] > 0
    assert rows[1]["gradient_sync_estimate_s"] > 0 == rows[0]["gradient_sync_estimate_s"]
    assert output.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
    assert "efficiency" in proc.stdout
    for run in result["runs"].values():
        shutil.rmtree(run, ignore_errors=True)


def test_every_part_of_bench_train_runs_and_reports(provisioned, tiny_inputs):
    """invoke bench.train's parts, each briefly, on the provisioned pair (bench.train itself
    provisions a fresh lab first, as the session's lab was)."""
    from mlxcluster.bench import train as bench_train
    from mlxcluster.describe.cluster import recorded

    model_dir, data_dir = tiny_inputs
    parts = bench_train.Parts(iters=5, rounds=1, batch_size=2, blas_iters=2, quality_iters=2,
                              overhead_iters=15, overhead_rounds=1)
    inventory = str(provisioned.inventory)
    result = bench_train.measure(recorded(inventory).cluster, inventory, data_dir, model_dir, parts)
    made = [Path(p) for runs in result["scaling"]["runs"].values() for p in runs]
    made.append(Path(result["quality"]["run"]))
    try:
        assert sorted(result) == ["blas", "overhead", "quality", "scaling"]
        overhead = result["overhead"]
        assert overhead["ours_tokens_per_second"] > 0 and overhead["stock_tokens_per_second"] > 0
        assert overhead["ours_over_stock"] > 0 and overhead["rounds"][0]["window_tokens"] > 0
        scaling = result["scaling"]
        assert scaling["one_rank_tokens_per_second"] > 0 and scaling["two_over_one"] > 0
        assert scaling["matmul_gflops_one_node_alone"] > 0
        blas = result["blas"]
        assert blas["openblas_tokens_per_second"] > 0 and blas["stock_mlx_cpu_tokens_per_second"] > 0
        quality = result["quality"]
        assert quality["summary"]["world_size"] == 2 and quality["prompts"] == 20
        assert len(quality["examples"]) == 3
        for run_dir in made:
            assert (run_dir / "summary.json").exists(), run_dir
    finally:
        for run_dir in made:
            shutil.rmtree(run_dir, ignore_errors=True)
