"""Pipeline-parallel training for real (a tiny llama of 5 layers, local ranks on MLX's ring backend):
stages of uneven runs of whole layers train one process's weights, report its losses, and save and
resume as one process's files, for LoRA, DoRA, full fine-tuning with a whole-matrix optimizer and
QLoRA on a packed 4-bit base; then the rules that cut the layers and the batch, and the refusals."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.unit import rings
from tests.unit.training.sharding.test_tensor_parallel import single_run
from tests.unit.training.test_finetune import run_launcher, training_args
from tests.unit.training.test_shares_training import losses, max_difference, uneven_inputs
from training.config import ConfigError, FinetuneConfig, config_problems
from training.parallel_rules import pipeline_micro_batches
from training.sharding.pipeline import micro_rows, stage_layers

LAYERS = 5


def mpi_launch(ranks: int) -> list[str]:
    """`ranks` local ranks under Open MPI (MLX's mpi backend), as the cluster's nodes run them, in
    this test process's environment as Python holds it: a one-process run in it made it an MPI
    singleton, whose variables (set behind Python's back) would make mpirun exit 1 without a word."""
    environment = {**os.environ, "MLX_MPI_LIBNAME": "libmpi.so.40"}
    return ["env", "-i", *(f"{name}={value}" for name, value in environment.items()), "mpirun",
            "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(ranks)]


def pipeline_run(root: Path, out: str, ranks: int, *extra: str, launch: list[str] | None = None) -> str:
    args = training_args(root / "model", root / "data", root / out, "--expected-world-size", str(ranks),
                         "--parallel", "pipeline", *extra)
    launcher = launch or rings.launch(ranks)
    result = run_launcher([*launcher, sys.executable, "-m", "training.finetune", *args], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def assert_one_process(root: Path, single: str, stages: str) -> None:
    """The adapters within 1e-4 of one process's, and every train and validation loss, report by
    report, within 1e-4 of its size (or 1e-4, whichever is larger): the stages sum a batch's float32
    terms in another order than one process, and ten steps of that leave a validation loss of 2.59
    1.4e-4 apart on some CPUs' BLAS kernels (a dropped micro-batch moves it by more than 1e-2)."""
    assert max_difference(root / single, root / stages) < 1e-4
    for key in ("train_loss", "val_loss"):
        expected = losses(root / single, key)
        found = losses(root / stages, key)
        assert len(expected) >= 4 and found == pytest.approx(expected, rel=1e-4, abs=1e-4), key


@pytest.fixture(scope="module")
def five_layers(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = uneven_inputs(tmp_path_factory.mktemp("pipeline"), num_hidden_layers=LAYERS)
    single_run(root, "single")
    return root


def test_two_stages_train_one_process_s_lora_and_its_checkpoint_resumes_in_one_process(five_layers: Path):
    root = five_layers
    out = pipeline_run(root, "two", 2)
    assert "done: 10 iterations on 2 ranks" in out
    assert_one_process(root, "single", "two")
    # A checkpoint the stages wrote is one process's: one process resumes it to the same adapters.
    shutil.copytree(root / "two", root / "resumed")
    shutil.rmtree(root / "resumed" / "checkpoints" / "0000010")
    single_run(root, "resumed", "--resume")
    assert max_difference(root / "single", root / "resumed") < 1e-4


def test_three_uneven_stages_train_one_process_s_dora_with_adamw_in_micro_batches(five_layers: Path):
    root, settings = five_layers, ("--fine-tune-type", "dora", "--optimizer", "adamw")
    single_run(root, "dora-single", *settings)
    # 1, 3 and 1 layers; the batch of 4 in 4 micro-batches (the default: at most twice the stages).
    pipeline_run(root, "dora-three", 3, *settings, "--pipeline-layers", "1,3,1")
    assert_one_process(root, "dora-single", "dora-three")
    # Its checkpoint (one process's files) resumes on two stages cut otherwise, to the same adapters.
    shutil.copytree(root / "dora-three", root / "dora-resumed")
    shutil.rmtree(root / "dora-resumed" / "checkpoints" / "0000010")
    pipeline_run(root, "dora-resumed", 2, *settings, "--pipeline-layers", "4,1", "--resume")
    assert max_difference(root / "dora-three", root / "dora-resumed") < 1e-5


def test_four_uneven_stages_train_one_process_s_lora(five_layers: Path):
    # Two middle stages, which both receive and send each way; one of them two layers.
    pipeline_run(five_layers, "four", 4, "--pipeline-layers", "1,2,1,1", "--pipeline-micro-batches", "2")
    assert_one_process(five_layers, "single", "four")


def test_a_first_stage_with_no_trained_layer_trains_one_process_s_lora_of_the_last_layers(five_layers: Path):
    # The last 2 of 5 layers trained, all on the second stage of 3 and 2: the first stage has no
    # parameter to train (its gradients an empty tree, which the optimizer once indexed and died on:
    # bench.plan's SmolLM2 run with lora.yaml's last 8 of 30 layers on 2 stages of 15).
    root = five_layers
    single_run(root, "last-two-single", "--num-layers", "2")
    pipeline_run(root, "last-two", 2, "--num-layers", "2", "--pipeline-layers", "3,2")
    assert_one_process(root, "last-two-single", "last-two")


def test_full_fine_tuning_with_muon_on_two_stages_trains_one_process_s_weights(five_layers: Path):
    # Muon orthogonalizes each whole matrix, which a stage holds (tensor parallelism cannot).
    root = five_layers
    settings = ("--fine-tune-type", "full", "--optimizer", "muon", "--learning-rate", "1e-4")
    single_run(root, "full-single", *settings)
    pipeline_run(root, "full-two", 2, *settings, "--pipeline-micro-batches", "2")
    assert_one_process(root, "full-single", "full-two")


def test_two_stages_times_two_replicas_with_shares_train_one_process_s_lora(five_layers: Path):
    # Pipeline and data together: ranks 0-1 and 2-3 each run the stages (2 and 3 layers) on their
    # share of every batch (3 and 1 examples); a stage's replicas average its gradients
    # (training.sharding.stage_layout; on the ring backend, stage by stage over every rank).
    root = five_layers
    out = pipeline_run(root, "two-by-two", 4, "--pipeline-stages", "2", "--pipeline-layers", "2,3",
                       "--batch-shares", "3,1")
    assert "done: 10 iterations on 4 ranks" in out
    assert_one_process(root, "single", "two-by-two")
    # Under MPI the replicas of a stage average in a group of their own (MPI splits the run's), let
    # go of before MPI finalizes (or the finished run would abort at exit): the same adapters.
    pipeline_run(root, "two-by-two-mpi", 4, "--pipeline-stages", "2", "--pipeline-layers", "2,3",
                 "--batch-shares", "3,1", launch=mpi_launch(4))
    assert_one_process(root, "single", "two-by-two-mpi")


def test_two_uneven_stages_train_one_process_s_qlora_on_the_packed_4_bit_base(tmp_path: Path):
    root = uneven_inputs(tmp_path, quantized=True, num_hidden_layers=4)
    single_run(root, "single")
    pipeline_run(root, "two", 2, "--pipeline-layers", "1,3")
    assert_one_process(root, "single", "two")
    # The second stage dequantizes its layers (a node with model_dequantize: room to spare, float
    # kernels faster); the first keeps them packed. Float sums round otherwise than the packed
    # kernels: the losses within 1e-4 of their value, as tensor parallelism's dequantizing rank.
    pipeline_run(root, "mixed", 2, "--pipeline-layers", "1,3", "--dequantize-ranks", "1")
    assert max_difference(root / "single", root / "mixed") < 1e-4
    held = json.loads((root / "mixed" / "summary.json").read_text())["base_weights_per_rank"]
    assert held[0].startswith("4-bit") and held[1].startswith("dequantized from 4-bit"), held


def test_a_micro_batch_s_work_past_the_watchdog_s_margin_is_said_once_with_what_to_do(tmp_path: Path,
                                                                                      capsys):
    # Metal ends GPU work past about 45-60 s (mlx #3402): each micro-batch's forward and backward are
    # evaluated apart, timed; here every one is past a margin of 0 s, and it is said once.
    import mlx.core as mx
    from mlx_lm import load

    from training.sharding.pipeline import PipelineStep, make_stage

    root = uneven_inputs(tmp_path, num_hidden_layers=2)
    model, _ = load(str(root / "model"))
    step = PipelineStep(make_stage(model, 0, [(0, 2)]), mx.distributed.init(), micro=2, warn_seconds=0.0)
    batch = mx.array([[1, 2, 3, 4, 5, 6, 7, 8, 9]] * 2)
    lengths = mx.array([[1, 8], [1, 8]])
    for _ in range(2):
        (loss, tokens), gradients = step.loss_and_gradients(model, batch, lengths, mx.array(1.0))
    assert tokens.item() == 16 and loss.item() > 0 and gradients
    said = capsys.readouterr().out
    assert said.count("warning") == 1
    assert "rank 0: warning: one micro-batch's work on this stage (layers 1-2)" in said
    assert "make the micro-batches smaller (a larger pipeline_micro_batches)" in said
    assert 0 < step.counters["longest_eval_seconds"] < step.counters["step_seconds"]


# --- the rules ---------------------------------------------------------------------------------------


def test_the_layers_are_cut_in_rank_order_by_count_by_weight_or_evenly():
    assert stage_layers(5, 2) == [(0, 3), (3, 5)]
    assert stage_layers(30, 3, weights=[192, 64, 64]) == [(0, 18), (18, 24), (24, 30)]
    assert stage_layers(5, 3, counts=[1, 3, 1]) == [(0, 1), (1, 4), (4, 5)]
    with pytest.raises(ConfigError, match="the model has only 5 layers"):
        stage_layers(5, 6)
    for wrong in ([1, 3], [0, 4, 1], [2, 2, 2]):
        with pytest.raises(ConfigError, match="add up to the model's 5 layers"):
            stage_layers(5, 3, counts=wrong)


def test_a_batch_is_cut_into_micro_batches_of_whole_rows_none_empty():
    assert micro_rows(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert micro_rows(5, 2) == [(0, 3), (3, 5)]
    assert micro_rows(2, 6) == [(0, 1), (1, 2)]
    assert pipeline_micro_batches(FinetuneConfig(parallel="pipeline", batch_size=16), 3) == 6
    assert pipeline_micro_batches(FinetuneConfig(parallel="pipeline", batch_size=4), 3) == 4


@pytest.mark.parametrize("settings, ranks, said", [
    ({}, 1, "parallel pipeline needs at least 2 ranks"),
    ({"pipeline_layers": "2,3"}, 3, "pipeline_layers 2,3: give 3 whole numbers"),
    ({"pipeline_layers": "2,x"}, 2, "pipeline_layers 2,x: give 2 whole numbers"),
    ({"pipeline_micro_batches": 8}, 2, "pipeline_micro_batches 8 is more than the 4 examples"),
    ({"max_micro_batch": "2"}, 2, "max_micro_batch with parallel pipeline: every stage trains on its"),
    ({"pipeline_stages": 3}, 4, "pipeline_stages 3 does not divide the 4 ranks into replicas of the stages: "
                                "use one of 2, 4"),
    ({"pipeline_stages": 1}, 4, "pipeline_stages must be 0 (one stage per rank) or at least 2, got 1"),
    ({"pipeline_stages": 2, "pipeline_layers": "1,1,1"}, 4, "pipeline_layers 1,1,1: give 2 whole numbers"),
    ({"pipeline_stages": 2, "batch_shares": "3,1"}, 2,
     "batch_shares '3,1' gives 2 replicas a value, but the run has 1: give one per replica"),
], ids=["one-rank", "layers-count", "layers-word", "micro-batches", "micro-cap", "stages-divide",
        "one-stage", "stages-layers", "shares-one-replica"])
def test_what_a_pipeline_cannot_take_is_refused_saying_what_would_work(settings, ranks, said):
    config = FinetuneConfig(model="m", data="d", parallel="pipeline", batch_size=4, **settings)
    assert any(said in problem for problem in config_problems(config, ranks)), config_problems(config, ranks)


def test_the_pipeline_keys_are_refused_in_another_mode():
    problems = config_problems(FinetuneConfig(model="m", data="d", pipeline_layers="1,1"), 2)
    assert "pipeline_layers is for parallel pipeline; this run is parallel data" in problems


def test_the_controller_refuses_a_pipeline_run_before_syncing_anything(tmp_path: Path):
    from types import SimpleNamespace

    from mlxcluster.errors import UserError
    from mlxcluster.launch import parallel

    (tmp_path / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 2}')
    one, two, three = (SimpleNamespace(world_size=n) for n in (1, 2, 3))
    assert "this cluster trains on 1" in parallel.problems(one, tmp_path, "pipeline")[0]  # type: ignore[arg-type]
    assert parallel.problems(two, tmp_path, "pipeline") == []  # type: ignore[arg-type]
    with pytest.raises(UserError) as refused:
        parallel.check(three, tmp_path, "pipeline")  # type: ignore[arg-type]
    assert str(refused.value) == ("cannot train with --parallel pipeline:\n  --parallel pipeline in 3 "
                                  f"stages: {tmp_path} has 2 layers, and each stage holds at least one; use "
                                  "at most 2 stages (pipeline_stages)")
    # Pipeline and data: 2 stages of 2 layers on 4 ranks fit.
    assert parallel.problems(SimpleNamespace(world_size=4), tmp_path, "pipeline", stages=2) == []  # type: ignore[arg-type]
    assert parallel.flags("pipeline") == ["--parallel", "pipeline"]
    said = parallel.line(two, "pipeline")  # type: ignore[arg-type]
    assert said is not None and said.startswith("pipeline parallel: each of the 2 ranks holds a stage")
    said = parallel.line(SimpleNamespace(world_size=6), "pipeline", 3)  # type: ignore[arg-type]
    assert said is not None and said.startswith("pipeline and data parallel: 2 replicas of 3 stages of "
                                                 "whole layers (ranks 0-2, 3-5)")


def test_a_pipeline_on_a_full_mesh_sends_over_jaccl_ring_not_jaccl_s_mesh():
    # mlx #3149: JACCL's mesh gives wrong data for back-to-back sends of different shapes.
    from mlxcluster.describe.backends import Choice
    from mlxcluster.errors import UserError
    from mlxcluster.launch import parallel

    mesh = Choice("jaccl", "a cable joins every two nodes and every cabled port has RDMA")
    taken = parallel.pipeline_backend(mesh, None)
    assert taken.backend == "jaccl-ring" and "mlx #3149" in taken.why and taken.why.startswith(mesh.why)
    with pytest.raises(UserError, match="use --backend jaccl-ring"):
        parallel.pipeline_backend(mesh, "jaccl")
    for other in ("jaccl-ring", "ring", "mpi"):
        assert parallel.pipeline_backend(Choice(other, "why"), other) == Choice(other, "why")
