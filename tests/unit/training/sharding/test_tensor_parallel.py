"""Tensor-parallel LoRA in real training (a tiny llama, two local processes on MLX's ring backend):
two ranks, each holding half of every layer, train the adapters of one process, save them as one
ordinary adapter file, and checkpoint and resume; what cannot be sharded is refused."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import generate, load

from mlxcluster.errors import UserError
from mlxcluster.launch import parallel
from tests.unit import rings
from tests.unit.training.model.test_folder import tiny_model
from tests.unit.training.test_finetune import run_launcher, training_args
from tests.unit.training.test_shares_training import adapters, losses, max_difference
from training import finetune as ft
from training.sharding.parts import bounds
from training.sharding.tensor_parallel import shard_problems

RING = rings.launch(2)


def tensor_run(root: Path, out: str, *extra: str) -> str:
    args = training_args(root / "model", root / "data", root / out, "--expected-world-size", "2",
                         "--parallel", "tensor", *extra)
    result = run_launcher([*RING, sys.executable, "-m", "training.finetune", *args], timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def parameters(stdout: str) -> float:
    """The parameters a rank holds, in millions, from mlx-lm's `Trainable parameters` line."""
    return float(re.search(r"Trainable parameters: .*/([0-9.]+)M\)", stdout)[1])  # type: ignore[index]


def single_run(root: Path, out: str, *extra: str) -> str:
    with contextlib.redirect_stdout(io.StringIO()) as stdout:
        assert ft.main(training_args(root / "model", root / "data", root / out, *extra), environ={}) == 0
    return stdout.getvalue()


@pytest.fixture(scope="module")
def tensor(uneven_run: Path) -> Path:
    (uneven_run / "tensor.out").write_text(tensor_run(uneven_run, "tensor"))
    return uneven_run


def test_two_tensor_parallel_ranks_train_the_adapters_of_one_process(tensor: Path):
    root = tensor
    diff = max_difference(root / "single", root / "tensor")
    assert diff < 1e-4, diff
    assert max(mx.abs(w).max().item() for w in adapters(root / "single").values()) > 1e-2  # they moved
    # The gathered file is one process's: every matrix whole, in its own shape.
    single, gathered = adapters(root / "single"), adapters(root / "tensor")
    assert {k: v.shape for k, v in gathered.items()} == {k: v.shape for k, v in single.items()}
    # The losses agree report by report, and each batch's tokens count once, not once per rank.
    for key in ("train_loss", "val_loss"):
        assert losses(root / "tensor", key) == pytest.approx(losses(root / "single", key), abs=1e-4)
    summary = json.loads((root / "tensor" / "summary.json").read_text())
    one = json.loads((root / "single" / "summary.json").read_text())
    assert summary["parallel"] == "tensor" and summary["world_size"] == 2
    assert summary["batch"]["ranks"][0]["trained_tokens"] == one["batch"]["ranks"][0]["trained_tokens"]
    assert summary["max_weight_difference_across_ranks"] == 0.0  # the replicated LoRA matrices
    assert len(summary["peak_memory_gb_per_rank"]) == 2
    # Each rank holds its half of every layer and of the vocabulary: less than 0.6x of the model.
    model, _ = load(str(root / "model"))
    whole = sum(v.size for _, v in tree_flatten(model.parameters())) / 1e6
    assert parameters((root / "tensor.out").read_text()) < 0.6 * whole
    print(f"max abs difference, 1 process against 2 tensor-parallel ranks: {diff:.3g}")


def test_mlx_lm_generates_with_the_gathered_adapters_what_one_process_s_adapters_generate(tensor: Path):
    prompt = "count 001"
    answers, logits = {}, {}
    for name in ("single", "tensor", None):
        model, tokenizer = load(str(tensor / "model"), adapter_path=str(tensor / name) if name else None)
        tokens = mx.array([tokenizer.encode(prompt)])
        logits[name] = model(tokens)[0, -1]
        answers[name] = generate(model, tokenizer, prompt, max_tokens=8)  # greedy
    # Loaded by stock mlx-lm, the gathered adapters are one process's: the same next-token scores
    # and the same greedy answer, where the base model without them scores otherwise.
    assert mx.abs(logits["tensor"] - logits["single"]).max().item() < 1e-3
    assert answers["tensor"] == answers["single"]
    assert mx.abs(logits[None] - logits["single"]).max().item() > 1e-2


def test_ranks_that_do_not_divide_the_heads_split_them_by_key_value_groups(tensor: Path):
    # 6 query heads in 3 key-value groups over 2 ranks: 2 groups and 1; 125 MLP units: 63 and 62.
    # Dropout on: row-parallel layers see a slice of the features, and draw the whole input's mask.
    root = tensor / "groups"
    tiny_model(root / "model", hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
               intermediate_size=125)
    shutil.copytree(tensor / "data", root / "data")
    single_run(root, "single", "--lora-dropout", "0.3")
    tensor_run(root, "tensor", "--lora-dropout", "0.3")
    assert max_difference(root / "single", root / "tensor") < 1e-4
    for key in ("train_loss", "val_loss"):
        assert losses(root / "tensor", key) == pytest.approx(losses(root / "single", key), abs=1e-4)


def test_a_tensor_parallel_run_resumes_from_its_checkpoint(tensor: Path):
    root = tensor
    for out in ("resumed", "resumed-alone"):
        shutil.copytree(root / "tensor", root / out)
        shutil.rmtree(root / out / "checkpoints" / "0000010")
        (root / out / "adapters.safetensors").unlink()
    tensor_run(root, "resumed", "--resume")
    assert max_difference(root / "tensor", root / "resumed") < 1e-6
    # A checkpoint holds whole arrays: one process resumes it as well.
    output = single_run(root, "resumed-alone", "--resume")
    assert "resuming from" in output and "(step 6 of 10)" in output
    assert max_difference(root / "single", root / "resumed-alone") < 1e-4


def test_dora_with_adamw_on_two_tensor_parallel_ranks_trains_one_process_s_weights_and_resumes(
        tensor: Path):
    """DoRA: its magnitudes cut like the outputs in column-parallel layers, each adapted row's norm
    summed across the ranks in row-parallel ones; AdamW's state cut like the weights; dropout on.
    On uneven parts (key-value groups 2 and 1, MLP units 63 and 62): no part is assumed equal."""
    root = tensor / "dora"
    tiny_model(root / "model", hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
               intermediate_size=125)
    shutil.copytree(tensor / "data", root / "data")
    settings = ("--fine-tune-type", "dora", "--optimizer", "adamw", "--lora-dropout", "0.3")
    single_run(root, "single", *settings)
    tensor_run(root, "tensor", *settings)
    diff = max_difference(root / "single", root / "tensor")
    assert diff < 1e-4, diff
    gathered = adapters(root / "tensor")
    single = adapters(root / "single")
    assert {k: v.shape for k, v in gathered.items()} == {k: v.shape for k, v in single.items()}
    assert any(k.endswith(".m") for k in gathered)  # DoRA's magnitudes, whole
    for key in ("train_loss", "val_loss"):
        assert losses(root / "tensor", key) == pytest.approx(losses(root / "single", key), abs=1e-4)
    shutil.copytree(root / "tensor", root / "resumed")
    shutil.rmtree(root / "resumed" / "checkpoints" / "0000010")
    tensor_run(root, "resumed", *settings, "--resume")
    assert max_difference(root / "tensor", root / "resumed") < 1e-6
    print(f"DoRA, max abs difference, 1 process against 2 tensor-parallel ranks: {diff:.3g}")


def test_one_process_is_refused_tensor_parallelism(tensor: Path, capsys: pytest.CaptureFixture[str]):
    args = training_args(tensor / "model", tensor / "data", tensor / "alone", "--parallel", "tensor")
    assert ft.main(args, environ={}) == 2
    assert "parallel tensor needs at least 2 ranks" in capsys.readouterr().err


def test_a_model_is_refused_when_a_rank_would_get_no_whole_key_value_group():
    smollm2 = {"model_type": "llama", "num_attention_heads": 9, "num_key_value_heads": 3,
               "intermediate_size": 1536, "hidden_size": 576}
    assert shard_problems(smollm2, 3, "smollm2") == []  # the model's own shard()
    assert shard_problems(smollm2, 2, "smollm2") == []  # 2 key-value groups and 1
    [problem] = shard_problems(smollm2, 4, "smollm2")
    assert "num_attention_heads is 9, num_key_value_heads is 3, which 4 ranks do not divide" in problem
    assert problem.endswith("it shards across at most 3 ranks")


def test_a_model_without_shard_is_refused():
    [problem] = shard_problems({"model_type": "gpt2", "num_attention_heads": 12}, 2, "gpt2")
    assert "mlx-lm has no shard() for its architecture" in problem and "--parallel data" in problem
    assert shard_problems({"model_type": "llama", "num_attention_heads": 4}, 2, "llama") == []


def test_the_controller_refuses_before_syncing_anything(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_attention_heads": 9,
                                                      "num_key_value_heads": 1}))
    two, one = SimpleNamespace(world_size=2), SimpleNamespace(world_size=1)
    with pytest.raises(UserError, match="heads is 1, which 2 ranks do not divide, and its attention has one"):
        parallel.check(two, tmp_path, "tensor")  # type: ignore[arg-type]
    assert "this cluster trains on 1" in parallel.problems(one, tmp_path, "tensor")[0]  # type: ignore[arg-type]
    assert parallel.problems(two, tmp_path, "data") == []  # type: ignore[arg-type]
    assert parallel.flags("tensor") == ["--parallel", "tensor"] and parallel.flags(None) == []
    with pytest.raises(UserError, match="--parallel must be data, tensor or pipeline, not 'pipe'"):
        parallel.flags("pipe")


def test_the_vocabulary_is_cut_into_parts_as_equal_as_can_be():
    assert [bounds(10, 3, rank) for rank in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert [bounds(49152, 2, rank) for rank in range(2)] == [(0, 24576), (24576, 49152)]


def fake_run(path: Path, ranks: int, peaks: list[float], tokens_per_second: float,
             losses: list[float]) -> Path:
    path.mkdir()
    (path / "summary.json").write_text(json.dumps({
        "world_size": ranks, "parallel": "tensor" if ranks > 1 else "data", "peak_memory_gb_per_rank": peaks,
        "tokens_per_second": tokens_per_second, "final_train_loss": losses[-1], "final_val_loss": None}))
    (path / "metrics.jsonl").write_text("".join(
        json.dumps({"iteration": 5 * (i + 1), "train_loss": loss}) + "\n" for i, loss in enumerate(losses)))
    return path


def test_the_tensor_benchmark_compares_the_largest_rank_with_one_process(tmp_path: Path):
    from mlxcluster.bench import tensor as bench

    single = bench.measured(fake_run(tmp_path / "one", 1, [0.8], 50.0, [3.0, 2.5]))
    split = bench.measured(fake_run(tmp_path / "three", 3, [0.40, 0.46, 0.40], 30.0, [3.0, 2.5]))
    assert bench.figures(single, split) == {"peak_memory_ratio": 0.575, "tokens_per_second_ratio": 0.6}
    png = bench.plot({"1 rank": tmp_path / "one", "3 ranks": tmp_path / "three"}, tmp_path / "t.png", "t")
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("packed", [False, True], ids=["float", "4-bit"])
def test_answering_a_row_parallel_layer_sums_its_base_and_adapter_at_once(
        monkeypatch: pytest.MonkeyPatch, dora: bool, packed: bool):
    """Serving's path (eval mode) gives training's output with one all-sum where training has two:
    the all-sums are what a token costs across ranks (bench.serve against stock mlx_lm.server)."""
    import mlx.nn as nn
    from mlx.nn.layers.distributed import QuantizedShardedToAllLinear, ShardedToAllLinear
    from mlx_lm.tuner.dora import DoRALinear
    from mlx_lm.tuner.lora import LoRALinear

    from training.sharding.tensor_parallel import ShardedDoRALinear, ShardedLoRALinear

    mx.random.seed(3)
    group = mx.distributed.init()
    linear: nn.Module = nn.Linear(64, 32, bias=True)
    if packed:
        linear = nn.QuantizedLinear.from_linear(linear, group_size=32, bits=4)
        base = QuantizedShardedToAllLinear.from_quantized_linear(linear, group=group)
    else:
        base = ShardedToAllLinear.from_linear(linear, group=group)
    lora = (DoRALinear if dora else LoRALinear).from_base(linear, r=4, scale=2.0)
    lora.lora_b = mx.random.normal(lora.lora_b.shape) * 0.1  # mlx-lm starts it at zero
    layer = (ShardedDoRALinear if dora else ShardedLoRALinear)(base, lora, group, (0, 64))
    x = mx.random.normal((2, 5, 64))

    sums = []
    all_sum = mx.distributed.all_sum
    monkeypatch.setattr(mx.distributed, "all_sum", lambda *a, **k: sums.append(1) or all_sum(*a, **k))
    trained = layer(x)
    training_sums = len(sums)
    layer.eval()
    answered = layer(x)

    assert len(sums) - training_sums == training_sums - 1
    assert mx.allclose(answered, trained, atol=1e-5).item()
    assert mx.allclose(answered, lora(x), atol=1e-5).item()  # and one process's mlx-lm layer
