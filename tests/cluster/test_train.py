"""`invoke train` on two provisioned lab nodes, as a user runs it.

A tiny llama trains for a few steps on both nodes through mpirun pinned to the
Thunderbolt-like link; the artifacts must arrive in runs/ on the controller.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import yaml

from mlxcluster import paths
from mlxcluster.lab import cache, hosts
from mlxcluster.launch import runs
from tests.cluster.conftest import (
    LabCluster,
    assert_equal_across_ranks,
    assert_tensor_qlora_is_one_process,
    assert_trains_as_one_process,
    one_process_run,
    rank_weights,
)
from training.data import shares as share_rules
from training.model import stand_in

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
INVOKE = str(Path(sys.executable).parent / "invoke")


def finished_run(proc: subprocess.CompletedProcess[str]) -> Path:
    """The run directory of an `invoke train` that must have succeeded."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir_of(proc.stdout)


def run_dir_of(stdout: str) -> Path:
    """The runs/<id> directory named in the summary table `invoke train` prints."""
    found = runs.named_in(stdout)
    assert found is not None, stdout[-3000:]
    return found


def test_train_runs_on_both_nodes_over_the_link_and_brings_results_back(provisioned, tiny_inputs, tmp_path):
    model_dir, data_dir = tiny_inputs
    link_bytes = "cat /sys/class/net/bridge0/statistics/rx_bytes"
    before = int(provisioned.ssh(2, link_bytes).stdout)

    proc = invoke_train(provisioned, "--model", str(model_dir), "--data", str(data_dir), "--iters", "8",
                        "--batch-size", "2", "--extra",
                        "--steps-per-report 2 --steps-per-eval 4 --val-batches 2 --num-layers 2 "
                        "--learning-rate 1e-3 --max-seq-length 512 --save-rank-weights")
    run_dir = finished_run(proc)
    assert "training on 2 ranks (mpi)" in proc.stdout
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["world_size"] == 2
        # The LoRA weights after training are identical on both ranks: the run says so, and each
        # node's own file of its rank's weights shows it, equal to the adapters that came back.
        assert summary["max_weight_difference_across_ranks"] == 0.0
        weights = rank_weights(provisioned, run_dir, [1, 2])
        assert_equal_across_ranks([*weights, mx.load(str(run_dir / "adapters.safetensors"))])
        # And they are one process's adapters on the same global batches, report by report.
        reference = one_process_run(run_dir, model_dir, data_dir, tmp_path / "one")
        print(f"2 ranks against 1 process: {assert_trains_as_one_process(run_dir, reference):.3g}")
        # Every rank ran with the OpenBLAS that provisioning preloads, not mlx[cpu]'s own BLAS.
        assert summary["ranks_with_openblas"] == 2
        assert summary["final_train_loss"] < summary["first_train_loss"]
        for name in ("adapters.safetensors", "adapter_config.json", "metrics.jsonl", "loss.png",
                     "config.yaml", "run.json"):
            assert (run_dir / name).exists(), name
        # The ranks talked over bridge0 (the model fan-out and MPI), not only the management link.
        after = int(provisioned.ssh(2, link_bytes).stdout)
        assert after - before > 100_000
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def test_an_mlx_lm_config_file_trains_across_the_nodes_as_it_is(provisioned, tiny_inputs, tmp_path):
    """A user's `mlx_lm lora` config, its model a stock mlx-lm folder (no manifest) and its data a
    folder with a test split, given to invoke train alone: the model is fetched once, DoRA trains
    with AdamW, a cosine schedule with warmup and gradient accumulation on both nodes, the test
    split is evaluated, and stock mlx_lm generate takes the run folder."""
    model_dir, data_dir = tiny_inputs
    stock_model = model_dir.parent / f"{model_dir.name}-src"  # as mlx_lm lora takes it: no manifest.json
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    (data / "test.jsonl").write_text("".join((data / "valid.jsonl").read_text().splitlines(True)[:8]))
    settings = {
        "model": str(stock_model), "train": True, "fine_tune_type": "dora", "optimizer": "adamw",
        "optimizer_config": {"adamw": {"weight_decay": 0.01}}, "data": str(data), "seed": 0, "num_layers": 2,
        "batch_size": 2, "iters": 6, "val_batches": 2, "learning_rate": 1e-3, "steps_per_report": 2,
        "steps_per_eval": 3, "save_every": 100, "test": True, "test_batches": 2, "max_seq_length": 512,
        "grad_accumulation_steps": 2, "clear_cache_threshold": "1GB",
        "lr_schedule": {"name": "cosine_decay", "arguments": [1e-3, 6, 1e-5], "warmup": 2,
                        "warmup_init": 0.0},
        "lora_parameters": {"keys": ["self_attn.q_proj", "self_attn.v_proj"], "rank": 4, "scale": 10.0,
                            "dropout": 0.0},
    }  # fmt: skip
    config = tmp_path / "lora.yaml"
    config.write_text(yaml.safe_dump(settings))
    fetched = paths.MODELS / stock_model.name
    proc = invoke_train(provisioned, "--config", str(config))
    run_dir = finished_run(proc)
    try:
        assert f"fetching it once into {fetched}" in proc.stdout
        assert "training on 2 ranks (mpi)" in proc.stdout and "Test loss " in proc.stdout
        summary = json.loads((run_dir / "summary.json").read_text())
        said = (summary["fine_tune_type"], summary["optimizer"], summary["world_size"])
        assert said == ("dora", "adamw", 2)
        assert summary["test_loss"] > 0
        adapter_config = json.loads((run_dir / "adapter_config.json").read_text())
        assert adapter_config["fine_tune_type"] == "dora"
        assert adapter_config["lora_parameters"]["keys"] == ["self_attn.q_proj", "self_attn.v_proj"]
        assert {k for k in mx.load(str(run_dir / "adapters.safetensors")) if k.endswith(".m")}  # DoRA's
        generated = subprocess.run([sys.executable, "-m", "mlx_lm", "generate", "--model", str(stock_model),
                                    "--adapter-path", str(run_dir), "--prompt", "Ahoy", "--max-tokens", "4"],
                                   capture_output=True, text=True, timeout=300)
        assert generated.returncode == 0, generated.stderr[-2000:]
        # Once per model: a second run reuses the copy.
        again = invoke_train(provisioned, "--config", str(config), "--dry-run")
        assert again.returncode == 0 and "fetching" not in again.stdout, again.stdout[-2000:]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(fetched, ignore_errors=True)


def test_ring_backend_trains_a_sharded_model_with_mlx_launch_and_the_rendered_hosts_json(provisioned,
                                                                                      tiny_inputs, tmp_path):
    # Tensor parallelism (each node half of every layer) over MLX's ring backend, as a user asks.
    model_dir, data_dir = tiny_inputs
    proc = invoke_train(
        provisioned, "--backend", "ring", "--parallel", "tensor", "--model", str(model_dir), "--data",
        str(data_dir), "--iters", "4", "--batch-size", "2", "--extra",
        "--steps-per-report 2 --steps-per-eval 4 --val-batches 1 --num-layers 1 --max-seq-length 512 "
        "--learning-rate 1e-3 --save-rank-weights")
    run_dir = finished_run(proc)
    assert "==> tensor parallel: each of the 2 ranks holds 1/2 of every layer" in proc.stdout
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["parallel"] == "tensor"
        # The LoRA matrices every rank holds whole are equal on both: the run's figure, and the
        # files each node wrote of its rank's.
        assert summary["max_weight_difference_across_ranks"] == 0.0
        assert_equal_across_ranks(rank_weights(provisioned, run_dir, [1, 2]))
        # The gathered adapters and the losses are one process's on the same global batches.
        reference = one_process_run(run_dir, model_dir, data_dir, tmp_path / "one")
        difference = assert_trains_as_one_process(run_dir, reference)
        print(f"2 tensor-parallel ranks against 1 process: {difference:.3g}")
        assert len(summary["peak_memory_gb_per_rank"]) == 2
        # Each ring rank sourced its env.sh: venv python, OpenBLAS preloaded.
        assert summary["ranks_with_openblas"] == 2
        # The adapters came back gathered: one process's file, every matrix whole.
        adapters = mx.load(str(run_dir / "adapters.safetensors"))
        hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]
        assert {w.shape for name, w in adapters.items() if name.endswith("o_proj.lora_a")} == {(hidden, 8)}
        assert {w.shape for name, w in adapters.items() if name.endswith("q_proj.lora_b")} == {(8, hidden)}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def test_pipeline_stages_on_both_nodes_train_one_process_s_adapters_over_mpi(provisioned, tiny_inputs,
                                                                             tmp_path):
    # Each node a stage of the tiny llama's layers (one each), the batch in micro-batches through them.
    model_dir, data_dir = tiny_inputs
    proc = invoke_train(
        provisioned, "--parallel", "pipeline", "--model", str(model_dir), "--data", str(data_dir),
        "--iters", "4", "--batch-size", "4", "--extra",
        "--steps-per-report 2 --steps-per-eval 4 --val-batches 1 --num-layers -1 --max-seq-length 512 "
        "--learning-rate 1e-3")
    run_dir = finished_run(proc)
    assert "==> pipeline parallel: each of the 2 ranks holds a stage of whole layers" in proc.stdout
    # The controller probed both nodes and sized the stages from their free memory (the split by
    # memory itself: tests/unit/mlxcluster/launch/test_stages.py); every rank got them.
    sized = (r"==> pipeline stages 1,1 layers \(from each node's free memory: node1 [\d.]+, node2 [\d.]+ GB"
             r"; the embeddings and the head counted where they are held\)")
    assert re.search(sized, proc.stdout), proc.stdout
    try:
        info = json.loads((run_dir / "run.json").read_text())
        assert info["pipeline_layers"] == [1, 1], info
        assert info["pipeline_layers_why"].startswith("from each node's free memory"), info
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["parallel"] == "pipeline"
        reference = one_process_run(run_dir, model_dir, data_dir, tmp_path / "one")
        difference = assert_trains_as_one_process(run_dir, reference)
        print(f"2 pipeline stages against 1 process: {difference:.3g}")
        assert_served_in_its_stages(provisioned, model_dir, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def test_pipeline_stages_train_over_the_ring_backend_between_the_nodes(provisioned, tiny_inputs, tmp_path):
    # MLX's ring backend sends only to neighbours, and its recv has failed in multi-node pipelines
    # (mlx #4276): the stages' activations and gradients cross the link between the nodes here.
    model_dir, data_dir = tiny_inputs
    proc = invoke_train(
        provisioned, "--backend", "ring", "--parallel", "pipeline", "--model", str(model_dir), "--data",
        str(data_dir), "--iters", "4", "--batch-size", "4", "--extra",
        "--steps-per-report 2 --steps-per-eval 4 --val-batches 1 --num-layers -1 --max-seq-length 512 "
        "--learning-rate 1e-3 --pipeline-micro-batches 4")
    run_dir = finished_run(proc)
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        assert (summary["world_size"], summary["parallel"]) == (2, "pipeline")
        assert json.loads((run_dir / "run.json").read_text())["backend"] == "ring"
        reference = one_process_run(run_dir, model_dir, data_dir, tmp_path / "one")
        difference = assert_trains_as_one_process(run_dir, reference)
        print(f"2 pipeline stages over the ring against 1 process: {difference:.3g}")
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def assert_served_in_its_stages(cluster, model_dir: Path, run_dir: Path) -> None:
    """`invoke serve` of a pipeline run: a rank on each node, each its recorded stage; the greedy
    answer is stock mlx_lm generate's with the run's adapters."""
    import openai

    from tests.unit.training.serve.test_server import stock_answer

    expected = stock_answer(model_dir, run_dir, "Ahoy?", 8)
    with serving(cluster, "--run", run_dir.name) as server:
        assert rank_pids(cluster, 1) and rank_pids(cluster, 2)
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{serve_port(cluster)}/v1", api_key="unused",
                            max_retries=0, timeout=120)
        asked = api.chat.completions.create(model=run_dir.name, max_tokens=8, temperature=0,
                                            messages=[{"role": "user", "content": "Ahoy?"}])
        assert asked.choices[0].message.content == expected.text
        server.send_signal(signal.SIGTERM)
        _, stderr = server.communicate(timeout=60)
    assert server.returncode == 130, stderr[-2000:]
    wait_until_gone(serve_pids, cluster, (1, 2))


def test_two_nodes_each_holding_packed_shards_of_a_4_bit_model_train_one_process_s_qlora(
        provisioned, tiny_quantized_model, tiny_inputs, tmp_path):
    assert_tensor_qlora_is_one_process(provisioned, tiny_quantized_model, tiny_inputs[1], tmp_path / "one", 2)


def test_dry_run_touches_no_host(provisioned):
    listing = "ls -A /opt/mlx-cluster/runs 2>/dev/null | wc -l"
    before = provisioned.ssh(1, listing).stdout
    proc = subprocess.run([INVOKE, "train", "-i", str(provisioned.inventory), "--dry-run"],
                          cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert "--hostfile /opt/mlx-cluster/hostfile -np 2" in proc.stdout
    assert provisioned.ssh(1, listing).stdout == before


def test_invoke_run_starts_any_command_on_every_slot(provisioned):
    base = [INVOKE, "run", "-i", str(provisioned.inventory), "--"]
    proc = subprocess.run([*base, "hostname"], cwd=REPO, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(line for line in proc.stdout.splitlines() if not line.startswith("==>")) \
        == ["node1", "node2"]

    # The smallest data-parallel MLX program, over the cluster link.
    proc = subprocess.run([*base, "python", "-m", "training.examples.logistic_regression"],
                          cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert result["world_size"] == 2 and result["accuracy"] == 1.0
    assert result["max_weight_difference_across_ranks"] == 0.0

    # A failing command fails the task with its exit status.
    proc = subprocess.run([*base, "false"], cwd=REPO, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=120)
    assert proc.returncode == 1


RENDEZVOUS_JOB = """import json, os, socket, sys, time
rank, address, port = int(os.environ["RANK"]), os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
heard = None
if rank == 0:  # a tracker of its own, where the rendezvous says
    with socket.create_server((address, port)) as server:
        server.settimeout(60)
        peer, _ = server.accept()
        heard = peer.recv(64).decode()
else:
    for _ in range(300):
        try:
            peer = socket.create_connection((address, port), timeout=5)
            break
        except OSError:
            time.sleep(0.1)
    peer.sendall(f"rank {rank} of {os.environ['WORLD_SIZE']}".encode())
print(json.dumps({"rank": rank, "argv": sys.argv[1:], "heard": heard, "here": os.path.abspath(__file__)}))
"""


def test_invoke_run_sends_a_script_of_one_s_own_with_its_words_as_typed_and_a_rendezvous(
        provisioned, tmp_path):
    (tmp_path / "job.py").write_text(RENDEZVOUS_JOB)
    words = ["a b", "$HOME", "x; echo no", "'q'"]
    script = str(tmp_path / "job.py")
    command = [INVOKE, "run", "-i", str(provisioned.inventory), "--", "python", script, *words]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = sorted((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")),
                  key=lambda r: r["rank"])
    assert [r["rank"] for r in said] == [0, 1] and all(r["argv"] == words for r in said)
    assert said[0]["heard"] == "rank 1 of 2"  # rank 1 reached rank 0 at MASTER_ADDR:MASTER_PORT
    assert "/shipped/" in said[0]["here"] and said[0]["here"] == said[1]["here"]


def run_example(cluster: LabCluster, *words: str) -> dict[str, Any]:
    """`invoke run [words]` of an example; rank 0's JSON summary."""
    proc = subprocess.run([INVOKE, "run", "-i", str(cluster.inventory), *words], cwd=REPO,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))


def test_the_examples_run_as_the_docs_say_xgboost_mpi4py_and_mlx_over_the_ring(provisioned):
    """training/examples/ as docs/any-job.md runs them: their packages added with
    python_env_extra_packages, then invoke run on the two provisioned nodes."""
    extras = {"python_env_extra_packages": list(cache.EXAMPLE_PACKAGES)}
    run = provisioned.playbook("--tags", "python", "-e", json.dumps(extras))
    assert run.returncode == 0, json.dumps(run.failures, indent=1)

    # XGBoost's own collective, its tracker on rank 0 where the rendezvous says.
    xgb = run_example(provisioned, "--", "python", "-m", "training.examples.xgboost_tracker")
    assert xgb["world_size"] == 2 and xgb["same_model_on_every_rank"] is True, xgb
    assert xgb["accuracy"] >= xgb["accuracy_one_process"] - 0.03, xgb

    # mpi4py on the nodes' Open MPI, started by mpirun.
    mpi = run_example(provisioned, "--", "python", "-m", "training.examples.mpi4py_allreduce")
    assert mpi["world_size"] == 2 and mpi["sum_right"] is True and sorted(mpi["hosts"]) == ["node1", "node2"]
    assert "Open MPI" in mpi["mpi"], mpi

    # An MLX program over MLX's own ring backend: the venv's mlx-cluster-launch starts it, not mpirun.
    ring = run_example(provisioned, "--backend", "ring", "--", "python", "-m",
                       "training.examples.logistic_regression", "--steps", "100")
    assert ring["launcher"] == "mlx" and ring["world_size"] == 2 and ring["accuracy"] == 1.0, ring
    assert ring["max_weight_difference_across_ranks"] == 0.0


def finetune_pids(cluster, node: int) -> list[int]:
    """Training processes of one lab node."""
    return pids_running(cluster, node, b"training.finetune")


def pids_running(cluster, node: int, program: bytes) -> list[int]:
    """The processes of one lab node whose command line holds `program`. The nodes share the
    machine's PID namespace, so pkill on a node would also hit the other node's ranks and the
    controller's ssh: a node's are its network namespace's."""
    pids = subprocess.run(["ip", "netns", "pids", cluster.lab.netns(node)], capture_output=True,
                          text=True, check=True).stdout.split()
    found = []
    for pid in pids:
        with contextlib.suppress(OSError):
            if program in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
    return found


def wait_until_gone(pids_of: Callable[[Any, int], list[int]], cluster, nodes: tuple[int, ...] = (1, 2),
                    timeout: float = 30) -> None:
    """Wait for the nodes' processes to end; fail naming those still running after `timeout` s."""
    deadline = time.monotonic() + timeout
    while any(pids_of(cluster, n) for n in nodes) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert {n: pids_of(cluster, n) for n in nodes} == {n: [] for n in nodes}


def _ctrl_c_as_at_a_terminal() -> None:
    # A command started in the background by a shell without job control (as a CI script may
    # be) ignores SIGINT, and so does everything it starts: give invoke train the default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def training_under_way(cluster, tiny_inputs: tuple[Path, Path], extra: str = "",
                       restarts: str = "0") -> Iterator[subprocess.Popen]:
    """`invoke train` on a long run, handed over once rank 0 has reported step 3; killed after.
    It does not restart without a node that fails (`restarts`): these tests look at the stop."""
    model_dir, data_dir = tiny_inputs
    train = subprocess.Popen(
        [INVOKE, "train", "-i", str(cluster.inventory), "--model", str(model_dir),
         "--data", str(data_dir), "--iters", "5000", "--batch-size", "2", "--max-restarts", restarts,
         "--extra",
         "--steps-per-report 1 --steps-per-eval 5000 --val-batches 1 --num-layers 1 "
         f"--max-seq-length 256 {extra}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        stdin=subprocess.DEVNULL, preexec_fn=_ctrl_c_as_at_a_terminal)
    assert train.stdout is not None and train.stderr is not None
    try:
        for line in train.stdout:
            if line.split()[:2] == ["iter", "3/5000"]:
                break
        else:
            pytest.fail(f"training never reached step 3: {train.stderr.read()[-3000:]}")
        yield train
    finally:
        train.kill()
        train.communicate()  # closes the pipes


def test_a_rank_killed_mid_run_stops_every_rank_and_is_named(provisioned, tiny_inputs):
    with training_under_way(provisioned, tiny_inputs) as train:
        killed = time.perf_counter()
        rank1 = finetune_pids(provisioned, 2)
        assert rank1, "no training process on node2"
        for pid in rank1:
            os.kill(pid, signal.SIGKILL)
        _, stderr = train.communicate(timeout=120)
        stopped = time.perf_counter() - killed
    assert train.returncode != 0
    assert "rank 1 on node2 was killed by signal 9; last step reported: " in stderr, stderr[-2000:]
    # The kernel killed nothing for memory: the cause is said as what it was.
    outside = "killed from outside the run, not for memory"
    assert outside in stderr and "most often" not in stderr, stderr[-2000:]
    assert "not restarted without node2: restarts are off (--max-restarts 0)" in stderr
    # Nothing is left running on either node.
    for node in (1, 2):
        assert finetune_pids(provisioned, node) == []
    print(f"rank killed -> invoke train returned in {stopped:.1f} s")


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_on_the_controller_stops_every_rank(provisioned, tiny_inputs, stop):
    """Without a tty (output piped), ssh hangs nothing up: invoke train stops the run itself, on
    Ctrl-C and on SIGTERM (a `kill`, `timeout` or a CI runner's; it once left the ranks running)."""
    with training_under_way(provisioned, tiny_inputs) as train:
        interrupted = time.perf_counter()
        train.send_signal(stop)
        _, stderr = train.communicate(timeout=90)
        print(f"{stop.name} -> invoke train returned in {time.perf_counter() - interrupted:.1f} s")
    assert train.returncode == 130, stderr[-2000:]
    assert "interrupted: every rank of run" in stderr
    wait_until_gone(finetune_pids, provisioned)


RESUME_SETTINGS = ("--iters 40 --batch-size 2 --num-layers 1 --max-seq-length 512 --learning-rate 1e-3 "
                   "--steps-per-report 5 --save-every 20 --val-batches 1")


def invoke_train(cluster, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([INVOKE, "train", "-i", str(cluster.inventory), *args], cwd=REPO,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout)


def max_adapter_difference(a: Path, b: Path) -> float:
    first, second = mx.load(str(a / "adapters.safetensors")), mx.load(str(b / "adapters.safetensors"))
    assert isinstance(first, dict) and isinstance(second, dict) and first.keys() == second.keys()
    return max(mx.abs(first[k] - second[k]).max().item() for k in first)


@pytest.fixture(scope="module")
def uninterrupted(provisioned, tiny_inputs) -> Iterator[Path]:
    """The run the interrupted ones are held to: RESUME_SETTINGS on both nodes, start to end."""
    model_dir, data_dir = tiny_inputs
    whole = invoke_train(provisioned, "--model", str(model_dir), "--data", str(data_dir), "--extra",
                         RESUME_SETTINGS + " --steps-per-eval 40")
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    reference = run_dir_of(whole.stdout)
    yield reference
    shutil.rmtree(reference, ignore_errors=True)


def killed_at_checkpoint(cluster, tiny_inputs, node: int, *flags: str, step: int = 20,
                         settings: str = RESUME_SETTINGS + " --steps-per-eval 1 --val-batches 8"
                         ) -> tuple[subprocess.Popen, str, str]:
    """`invoke train` with `settings` (RESUME_SETTINGS, validating after every step: slower, and
    it must not change what trains), with `node`'s rank killed as soon as the checkpoint of `step`
    is saved: the finished process and its stdout and stderr."""
    model_dir, data_dir = tiny_inputs
    train = subprocess.Popen(
        [INVOKE, "train", "-i", str(cluster.inventory), "--model", str(model_dir), "--data", str(data_dir),
         *flags, "--extra", settings],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        stdin=subprocess.DEVNULL)
    assert train.stdout is not None
    seen = []
    try:
        for line in train.stdout:
            seen.append(line)
            if "saved" in line and line.rstrip().endswith(f"checkpoints/{step:07d}"):
                # The rank's python, as the out-of-memory killer or a kill -9 of it would.
                for pid in hosts.processes(cluster.lab, node, b"training.finetune"):
                    os.kill(pid, signal.SIGKILL)
                break
        stdout, stderr = train.communicate(timeout=300)
    finally:
        train.kill()
    return train, "".join(seen) + stdout, stderr


def test_an_interrupted_run_resumes_to_the_adapters_of_an_uninterrupted_one(provisioned, tiny_inputs,
                                                                            uninterrupted):
    reference = uninterrupted
    train, _, stderr = killed_at_checkpoint(provisioned, tiny_inputs, 2, "--max-restarts", "0")
    assert train.returncode != 0
    interrupted = REPO / "runs" / re.search(r"invoke train --resume (\S+)", stderr)[1]
    assert "rank 1 on node2 was killed by signal 9" in stderr
    assert f"its checkpoint at step 20 continues with: invoke train --resume {interrupted.name}" \
        in stderr
    assert json.loads((interrupted / "run.json").read_text())["status"] == "failed"

    # By its id, as the hint says: a bare --resume takes the latest run, which a test on another worker
    # may have just started (tests/unit/mlxcluster/launch/test_runs.py covers the latest).
    resumed = invoke_train(provisioned, "--resume", interrupted.name, timeout=300)
    try:
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
        assert f"resuming run {interrupted.name} on 2 ranks" in resumed.stdout
        assert "(step 20 of 40)" in resumed.stdout
        diff = max_adapter_difference(reference, interrupted)
        print(f"resumed at step 20 of 40 vs uninterrupted, 2 ranks over mpirun: max abs "
              f"difference of the adapters {diff:.3g}")
        assert diff < 1e-6
        summary = json.loads((interrupted / "summary.json").read_text())
        assert summary["resumed_from_step"] == 20 and summary["iterations"] == 40
        info = json.loads((interrupted / "run.json").read_text())
        assert info["status"] == "finished" and info["attempts"] == 2
        # Nothing to resume any more.
        again = invoke_train(provisioned, f"--resume={interrupted.name}", timeout=60)
        assert again.returncode != 0 and "finished all its steps: nothing to resume" in again.stderr
    finally:
        shutil.rmtree(interrupted, ignore_errors=True)


def test_a_node_killed_mid_run_is_left_out_and_the_run_ends_on_the_other_as_if_uninterrupted(
        provisioned, tiny_inputs, uninterrupted):
    """kill -9 of node2's rank just after the checkpoint of step 20: invoke train leaves node2
    out and goes on by itself from that checkpoint on node1 alone, with the same global batch (both
    examples on one rank), to the adapters of the run that was never interrupted. node2 is then
    recorded as left out, doctor shows it, and the next run checks it and lets it back in."""
    build = paths.build_dir_for(str(provisioned.inventory))
    train, stdout, stderr = killed_at_checkpoint(provisioned, tiny_inputs, 2)
    run = run_dir_of(stdout)
    try:
        assert train.returncode == 0, stdout[-3000:] + stderr[-3000:]
        assert "==> node2 is left out (killed); restarting run " in stdout
        assert "from its checkpoint at step 20 on 1 rank (node1), restart 1 of at most 3" in stdout
        assert "(step 20 of 40)" in stdout
        assert "note: the checkpoint was made on 2 ranks, this run has 1" in stdout
        diff = max_adapter_difference(uninterrupted, run)
        print(f"node2 killed at step 20 of 40, went on on node1 alone: max abs difference of the adapters "
              f"from the uninterrupted run's {diff:.3g}")
        # The same batches, averaged over one rank instead of two: float rounding, amplified a
        # little by Adam where gradients are near zero (measured: 4.5e-5 on 3 -> 2 ranks).
        assert diff < 5e-4
        info = json.loads((run / "run.json").read_text())
        assert info["status"] == "finished" and info["attempts"] == 2 and info["world_size"] == 1
        [left] = info["drained"]
        assert (left["node"], left["cause"], left["step"]) == ("node2", "killed", 20)
        summary = json.loads((run / "summary.json").read_text())
        assert summary["world_sizes"] == [2, 1] and summary["iterations"] == 40
        assert json.loads((build / "drained.json").read_text())[0]["node"] == "node2"

        doctor = subprocess.run([INVOKE, "doctor", "-i", str(provisioned.inventory)], cwd=REPO,
                                capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
        assert "left out of training" in doctor.stdout and "lets it back in" in doctor.stdout, doctor.stdout

        # node2's checks pass: the next run has it back.
        again = subprocess.run([INVOKE, "train", "-i", str(provisioned.inventory), "--dry-run"], cwd=REPO,
                               capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
        assert "node2 left out since " in again.stdout  # a dry run only shows it
        from mlxcluster.describe.cluster import recorded
        from mlxcluster.jobs import restarts

        assert restarts.rejoined(recorded(str(provisioned.inventory))).world_size == 2
        assert not (build / "drained.json").exists()
    finally:
        (build / "drained.json").unlink(missing_ok=True)
        shutil.rmtree(run, ignore_errors=True)


STUCK = re.compile(r"==> stuck: no rank progressed for (\d+) s after step \d+ \(the slowest step so far took "
                   r"([\d.]+) s; allowed (\d+) s\)")


def test_a_hang_and_a_link_that_carries_nothing_are_each_named_within_the_bound_and_the_run_goes_on(
        provisioned, tiny_inputs, uninterrupted):
    """Two faults of one run, each with every rank alive. Rank 1 holds still after step 12 (a
    collective that never completes, injected): the controller, reading the ranks' beats, calls
    the run stuck 15 s past its slowest step, finds every link carrying data, names a hang, stops
    every rank and restarts on both nodes from step 10. Once step 20's checkpoint is saved, node2's
    link stays up and carries nothing: stuck again, the pairs tested at that moment name the link,
    node2 is left out and the run ends on node1 alone, with the adapters of the uninterrupted run."""
    model_dir, data_dir = tiny_inputs
    build = paths.build_dir_for(str(provisioned.inventory))
    train = subprocess.Popen(
        [INVOKE, "train", "-i", str(provisioned.inventory), "--model", str(model_dir),
         "--data", str(data_dir), "--extra", RESUME_SETTINGS + " --steps-per-eval 40 --save-every 10"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
        env={**os.environ, "MLX_CLUSTER_FAULT": "hang:1:12"})
    assert train.stdout is not None
    seen: list[tuple[float, str]] = []
    cut = False
    try:
        for line in train.stdout:
            seen.append((time.monotonic(), line))
            if (not cut and any("nothing was lost (a hang)" in text for _, text in seen)
                    and "saved" in line and line.rstrip().endswith("checkpoints/0000020")):
                hosts.set_carrying(provisioned.lab, 2, carrying=False)
                cut = True
                seen.append((time.monotonic(), "(test) node2's link carries nothing from here\n"))
        stdout, stderr = train.communicate(timeout=300)
    finally:
        hosts.set_carrying(provisioned.lab, 2, carrying=True)
        train.kill()
    said = "".join(text for _, text in seen) + stdout
    run = run_dir_of(said)
    try:
        assert train.returncode == 0, said[-4000:] + stderr[-3000:]

        def when(words: str, after: float = 0.0) -> float:
            return next(t for t, text in seen if words in text and t >= after)

        # The hang: named within 30 s past the slowest step of the moment it began.
        hung = when("fault injected: this rank holds still")
        first = STUCK.search(said)
        assert first, said[-4000:]
        idle, slowest, allowed = int(first[1]), float(first[2]), int(first[3])
        assert allowed <= slowest + 16 and idle <= allowed + 5, first[0]
        assert when("nothing was lost (a hang); restarting run") - hung <= slowest + 30, said[-4000:]
        assert "hung: every rank was alive and waiting, and every link carries data" in said
        assert "from its checkpoint at step 10 on the same 2 ranks, restart 1 of at most 3" in said
        # The link that carries nothing: node2 left out, the run ends on node1 alone.
        cut_at = when("(test) node2's link carries nothing")
        second = list(STUCK.finditer(said))[1]
        assert when("is left out (dead link)", cut_at) - cut_at <= float(second[2]) + 30, said[-4000:]
        assert "dead link: the link between node1 and node2 is up but carries nothing" in said, said[-4000:]
        assert "==> node2 is left out (dead link); restarting run" in said
        assert "from its checkpoint at step 20 on 1 rank (node1), restart 2 of at most 3" in said
        info = json.loads((run / "run.json").read_text())
        assert (info["status"], info["attempts"]) == ("finished", 3)
        assert [(d["node"], d["cause"], d["step"]) for d in info["drained"]] == [("node2", "dead link", 20)]
        assert json.loads((run / "summary.json").read_text())["iterations"] == 40
        diff = max_adapter_difference(uninterrupted, run)
        print(f"hang at step 12, link dead at step 20: {diff:.3g} from the uninterrupted run; "
              f"named {idle} s after the last progress (allowed {allowed} s, slowest step {slowest} s)")
        assert diff < 5e-4
    finally:
        (build / "drained.json").unlink(missing_ok=True)
        shutil.rmtree(run, ignore_errors=True)


def test_auto_shares_are_the_ones_a_slower_node_s_calibration_gives(provisioned, tiny_inputs, tmp_path):
    """batch_share: auto on both nodes, as a user with a slower Mac sets it. node2 is calibrated at
    half a core (a control group over its processes); each global batch is then shared as the
    calibration's figures say, and the ranks still end with the same weights as one process. The
    cap is lifted before training: the shares come from the calibration, not from the run (how
    fast a capped node trains is bench.calibrate's and bench.shares' to measure)."""
    model_dir, data_dir = tiny_inputs
    inputs = ["--model", str(model_dir), "--data", str(data_dir)]
    tiny = "--steps-per-report 2 --steps-per-eval 6 --val-batches 1 --num-layers 2 --max-seq-length 512"
    original = provisioned.inventory.read_text()
    inventory = yaml.safe_load(original)
    for host in inventory["cluster"]["children"]["linux"]["hosts"].values():
        host["batch_share"] = "auto"
    provisioned.inventory.write_text(yaml.safe_dump(inventory))
    try:
        recorded = provisioned.playbook("--tags", "hostfile")  # the record takes the new setting
        assert recorded.returncode == 0, json.dumps(recorded.failures, indent=1)
        unknown = invoke_train(provisioned, *inputs, "--dry-run", "--extra", tiny)
        assert unknown.returncode != 0 and "run invoke bench.calibrate" in unknown.stderr, unknown.stderr
        hosts.set_limits(provisioned.lab, 2, cpu_percent=50)
        try:
            calibrated = subprocess.run(
                [INVOKE, "bench.calibrate", "-i", str(provisioned.inventory), *inputs, "--iters", "6",
                 "--batch-size", "8", "--extra", tiny, "--output", str(tmp_path / "calibrate.json")],
                cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
        finally:
            hosts.set_limits(provisioned.lab, 2, off=True)
        assert calibrated.returncode == 0, calibrated.stdout[-3000:] + calibrated.stderr[-3000:]
        speeds = json.loads((tmp_path / "calibrate.json").read_text())["nodes"]
        # Each node ran again at half its share, for the plan's line through two steps.
        assert all(speeds[n]["second"]["examples_per_step"] == 2 and speeds[n]["second"]["step_seconds"]
                   and speeds[n]["marginal_tokens_per_second"] > 0 for n in ("node1", "node2")), speeds
        # How much slower node2 measures is the machine's to say (CI's cores are shared): the
        # shares must be the ones its figures give, whatever they are.
        expected = share_rules.split(8, [speeds[n]["tokens_per_second"] for n in ("node1", "node2")])
        run_dir = finished_run(invoke_train(provisioned, *inputs, "--iters", "4", "--batch-size", "8",
                                            "--extra", tiny + " --learning-rate 1e-3 --save-rank-weights"))
        try:
            summary = json.loads((run_dir / "summary.json").read_text())
            shares = summary["batch"]["shares"]
            assert shares == expected, (shares, speeds)
            assert summary["max_weight_difference_across_ranks"] == 0.0
            assert_equal_across_ranks(rank_weights(provisioned, run_dir, [1, 2]))
            # Unequal shares of each global batch train one process's adapters on the whole batch.
            reference = one_process_run(run_dir, model_dir, data_dir, tmp_path / "one")
            difference = assert_trains_as_one_process(run_dir, reference)
            print(f"shares {shares} against 1 process: {difference:.3g}")
            info = json.loads((run_dir / "run.json").read_text())
            assert info["batch_shares"] == shares and info["batch_shares_why"].startswith(
                "from the calibration of ")
            print(f"calibrated tokens/s: {speeds}; shares of 8: {shares}")
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
    finally:
        provisioned.inventory.write_text(original)
        assert provisioned.playbook("--tags", "hostfile").returncode == 0


def canary_home(tmp_path: Path, model_dir: Path, data_dir: Path, canary: str) -> Path:
    """A fake home folder that is also a data set and a model (a user's own mixed-up folder),
    with a private key, a Hugging Face token and a note beside them, each holding `canary`."""
    home = tmp_path / "home"
    for private in (".ssh/id_ed25519", ".cache/huggingface/token", "notes.txt"):
        (home / private).parent.mkdir(parents=True, exist_ok=True)
        (home / private).write_text(f"-----BEGIN OPENSSH PRIVATE KEY----- {canary}\n")
    for source in (data_dir, model_dir):
        for file in source.iterdir():
            shutil.copy(file, home / file.name)
    (home / "my.yaml").write_text("num_layers: 1\nmax_seq_length: 512\n")
    return home


def nodes_holding(cluster: LabCluster, canary: str) -> list[str]:
    """Every file any lab node wrote (its overlays' upper layers, its private /tmp) that holds
    `canary`."""
    found = []
    for i in cluster.lab.nodes():
        upper = cluster.lab.node_dir(i) / "upper"
        grep = subprocess.run(["grep", "-rlF", canary, str(upper)], capture_output=True, text=True)
        found += grep.stdout.split()
        tmp = cluster.ssh(i, f"grep -rlF {canary} /tmp --exclude-dir=mlx || true")
        found += [f"node{i}:{path}" for path in tmp.stdout.split()]
    return found


def test_a_home_folder_given_as_data_model_config_or_run_sends_only_what_the_job_reads(
        provisioned, tiny_inputs, tmp_path):
    model_dir, data_dir = tiny_inputs
    canary = f"canary-{os.urandom(6).hex()}"
    home = canary_home(tmp_path, model_dir, data_dir, canary)
    proc = invoke_train(provisioned, "--data", str(home), "--model", str(home), "--config",
                        str(home / "my.yaml"), "--iters", "2", "--batch-size", "2",
                        "--extra", "--steps-per-report 1 --steps-per-eval 2 --val-batches 1 --save-every 1")
    run_dir = finished_run(proc)
    try:
        # The splits, the model's files and the config went; nothing else of the folder did.
        listing = provisioned.ssh(2, "ls -A /opt/mlx-cluster/work/data/home /opt/mlx-cluster/models/home")
        assert listing.stdout.split() == [
            "/opt/mlx-cluster/models/home:", *sorted(json.loads((model_dir / "manifest.json").read_text())
                                                     ["files"].keys() | {"manifest.json"}),
            "/opt/mlx-cluster/work/data/home:", "train.jsonl", "valid.jsonl"], listing.stdout
        assert nodes_holding(provisioned, canary) == []

        # A resumed run whose checkpoints folder is a link out of it: refused, nothing sent.
        (run_dir / "summary.json").unlink()
        shutil.rmtree(run_dir / "checkpoints")
        (run_dir / "checkpoints").symlink_to(home / ".ssh")
        resumed = invoke_train(provisioned, f"--resume={run_dir.name}", timeout=120)
        assert resumed.returncode != 0
        assert "is not a folder of the run (a link or a file)" in resumed.stderr
        assert "==>" not in resumed.stdout  # nothing ran

        # A split that leads out of the data folder: refused, naming it, before any copy.
        (tmp_path / "elsewhere.jsonl").write_text(canary)
        (home / "valid.jsonl").unlink()
        (home / "valid.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
        refused = invoke_train(provisioned, "--data", str(home), "--iters", "2", timeout=120)
        assert refused.returncode != 0 and "==>" not in refused.stdout
        assert f"valid.jsonl leads out of the folder (to {tmp_path / 'elsewhere.jsonl'})" in refused.stderr
        assert nodes_holding(provisioned, canary) == []
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


# --- invoke serve: what was trained, behind the API, across the same two nodes -----------------------

def serve_port(cluster: LabCluster) -> int:
    """The port `invoke serve` listens on for the tests of a lab: one per lab, so that the labs'
    tests side by side never meet (the API is tunnelled to this machine's loopback)."""
    return 18090 + cluster.lab.lab_id


def serve_pids(cluster, node: int) -> list[int]:
    """The server's processes on one lab node: its ranks, and on the launcher its front."""
    return pids_running(cluster, node, b"training.serve")


def rank_pids(cluster, node: int) -> list[int]:
    """The server's ranks on one lab node (`python -m training.serve`), not its front."""
    return pids_running(cluster, node, b"-m\x00training.serve\x00")


@contextlib.contextmanager
def serving(cluster, *args: str) -> Iterator[subprocess.Popen]:
    """`invoke serve` as a user starts it, handed over once it says where the API is."""
    command = [INVOKE, "serve", "-i", str(cluster.inventory), "--port", str(serve_port(cluster)), *args]
    server = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              stdin=subprocess.DEVNULL, preexec_fn=_ctrl_c_as_at_a_terminal)
    assert server.stdout is not None and server.stderr is not None
    server.said = []  # type: ignore[attr-defined]  # what it printed until the API was up
    try:
        for line in server.stdout:
            server.said.append(line)  # type: ignore[attr-defined]
            if "==> the API is at" in line:
                break
        else:
            pytest.fail(f"the server never started: {server.stderr.read()[-3000:]}")
        yield server
    finally:
        if server.poll() is None:  # a failed test: stop it as a user would (its tunnel and ranks too)
            server.terminate()
            try:
                server.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.communicate()


@pytest.fixture(scope="module")
def two_adapters(provisioned, tiny_inputs) -> Iterator[tuple[Path, Path]]:
    """A tensor-parallel LoRA run and a data-parallel DoRA run of the tiny model on both nodes."""
    model_dir, data_dir = tiny_inputs
    common = ["--model", str(model_dir), "--data", str(data_dir), "--iters", "6", "--batch-size", "2"]
    settings = ("--steps-per-report 3 --steps-per-eval 6 --val-batches 1 --max-seq-length 256 "
                "--num-layers -1 --learning-rate 5e-3")
    lora = finished_run(invoke_train(provisioned, *common, "--parallel", "tensor", "--extra", settings))
    dora = finished_run(invoke_train(provisioned, *common, "--extra", settings + " --fine-tune-type dora"))
    try:
        yield lora, dora
    finally:
        shutil.rmtree(lora, ignore_errors=True)
        shutil.rmtree(dora, ignore_errors=True)


def test_serve_shards_the_base_across_both_nodes_and_answers_each_adapter_as_mlx_lm_generate(
        provisioned, tiny_inputs, two_adapters):
    import openai

    from tests.unit.training.serve.test_server import stock_answer

    model_dir = tiny_inputs[0]
    lora, dora = two_adapters
    prompt = "Where be the treasure?"
    stock = {name: stock_answer(model_dir, folder, prompt, 16)
             for name, folder in ((model_dir.name, None), (lora.name, lora), (dora.name, dora))}
    with serving(provisioned, "--run", lora.name, "--run", dora.name) as server:
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{serve_port(provisioned)}/v1", api_key="unused",
                            max_retries=0, timeout=120)
        assert [m.id for m in api.models.list().data] == [model_dir.name, lora.name, dora.name]
        # Both nodes hold a rank of the server: the base is sharded (the LoRA run trained so).
        assert rank_pids(provisioned, 1) and rank_pids(provisioned, 2)
        for name in (lora.name, dora.name, model_dir.name, lora.name):
            asked = api.chat.completions.create(model=name, max_tokens=16, temperature=0, logprobs=True,
                                                messages=[{"role": "user", "content": prompt}])
            assert asked.choices[0].message.content == stock[name].text, name
            eos = {tiny_eos(model_dir)}
            assert [t.id for t in asked.choices[0].logprobs.content if t.id not in eos] == stock[name].tokens
            streamed = api.chat.completions.create(model=name, max_tokens=16, temperature=0, stream=True,
                                                   messages=[{"role": "user", "content": prompt}])
            said = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
            assert said == stock[name].text, name
        with pytest.raises(openai.BadRequestError):
            api.chat.completions.create(model="nobody", max_tokens=4,
                                        messages=[{"role": "user", "content": "hi"}])
        # A rank that dies ends the server: a client waiting on an answer is told why (mpirun kills
        # rank 0 at once: the front says it), the node is named, the exit is not 0, nothing is left.
        ends = {str(len(stand_in.BYTES) + i): -100 for i in range(len(stand_in.SPECIALS))}  # no early end
        stream = api.chat.completions.create(model=lora.name, max_tokens=20000, temperature=0, stream=True,
                                             logit_bias=ends, messages=[{"role": "user", "content": prompt}])
        time.sleep(1.0)  # under way (its headers came; its text may not: bytes need whole characters)
        dying = serve_pids(provisioned, 2)
        for pid in dying:  # frozen first: the answer cannot end before the rank dies
            os.kill(pid, signal.SIGSTOP)
        killed = time.perf_counter()
        for pid in dying:
            os.kill(pid, signal.SIGKILL)
        # The controller reads which rank and node from mpirun and tells the front, which tells the client.
        with pytest.raises(openai.APIError, match="the server stopped before answering: rank 1 on node2"):
            for _ in stream:
                pass
        _, stderr = server.communicate(timeout=120)
        print(f"a serving rank killed -> invoke serve returned in {time.perf_counter() - killed:.1f} s")
    assert server.returncode not in (0, None)
    assert "node2" in stderr and "the server stopped" in stderr, stderr[-2000:]
    wait_until_gone(serve_pids, provisioned, (1, 2), timeout=15)


def tiny_eos(model_dir: Path) -> int:
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(model_dir).eos_token_id


def test_serve_a_data_parallel_run_in_one_process_on_the_launcher(provisioned, tiny_inputs, two_adapters):
    import openai

    from tests.unit.training.serve.test_server import stock_answer

    _, dora = two_adapters
    expected = stock_answer(tiny_inputs[0], dora, "Ahoy?", 8)
    with serving(provisioned, "--run", dora.name, "--context", "256") as server:
        assert len(rank_pids(provisioned, 1)) == 1 and serve_pids(provisioned, 2) == []
        # The nodes hold the tiny model's request many times over: mlx-lm's 10 prompts' caches.
        assert "==> keeping the caches of up to 10 prompts (what the nodes' memory holds)\n" in server.said
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{serve_port(provisioned)}/v1", api_key="unused",
                            max_retries=0)
        asked = api.chat.completions.create(model=dora.name, max_tokens=8, temperature=0,
                                            messages=[{"role": "user", "content": "Ahoy?"}])
        assert asked.choices[0].message.content == expected.text
        with pytest.raises(openai.BadRequestError, match="over the context of 256 tokens this server takes"):
            api.completions.create(model=dora.name, max_tokens=8, prompt="Ahoy! " * 60)
        server.send_signal(signal.SIGTERM)  # as a service manager stops it
        _, stderr = server.communicate(timeout=60)
    assert server.returncode == 130 and "every rank of the server" in stderr, stderr[-2000:]
    wait_until_gone(serve_pids, provisioned, (1,))


def test_train_stops_before_launching_when_a_node_is_down(provisioned, tiny_inputs):
    """Last in this file: node2 stays down."""
    model_dir, data_dir = tiny_inputs
    hosts.stop_node(provisioned.lab, 2)
    start = time.perf_counter()
    proc = subprocess.run(
        [INVOKE, "train", "-i", str(provisioned.inventory), "--model", str(model_dir),
         "--data", str(data_dir)],
        cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert proc.returncode != 0
    # node2 itself, and node1 -> node2 over the link
    assert "not launching: 2 check(s) failed" in proc.stderr, proc.stderr[-2000:]
    assert "node2" in proc.stderr and "management ssh" in proc.stderr
    assert "training on" not in proc.stdout and "sync code" not in proc.stdout
    print(f"node2 down -> invoke train refused in {time.perf_counter() - start:.1f} s")
