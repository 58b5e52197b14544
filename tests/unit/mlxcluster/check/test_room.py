"""What a run's model needs of each node (mlxcluster/check/room.py): its float size read from the
safetensors headers of a quantized folder, per rank (whole or 1/N, quantized or dequantized) and per
node (its slots), and invoke doctor's memory check that counts it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load

from mlxcluster.check import doctor, room
from mlxcluster.launch.stages import Body
from mlxcluster.plan import model as model_files
from tests.unit.mlxcluster.check.test_doctor import HOSTFILE, cluster, healthy
from training.model import quantization, stand_in

GIB = 2**30
# Mixed per-layer quantization as mlx-lm writes it: one layer in 8 bits with its own group size,
# one left float, the rest 4-bit in groups of 32.
MIXED = {"model.layers.0.mlp.down_proj": {"group_size": 64, "bits": 8},
         "model.layers.1.self_attn.q_proj": False}


def parameter_bytes(model) -> int:
    return sum(array.nbytes for _, array in tree_flatten(model.parameters()))


@pytest.mark.parametrize("per_layer", [None, MIXED], ids=["4-bit", "mixed"])
def test_the_float_size_of_a_quantized_folder_is_what_a_dequantizing_rank_holds(tmp_path: Path, per_layer):
    stand_in.make(tmp_path / "float")
    stand_in.make(tmp_path / "q", quantized=True, per_layer=per_layer)
    found = model_files.weights(tmp_path / "q")
    assert found is not None and found.quantized
    assert found.stored == (tmp_path / "q" / "model.safetensors").stat().st_size
    model, _ = load(str(tmp_path / "q"))
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    dequantized, _ = quantization.dequantized_if_asked(model, config, 0, [0])
    mx.eval(dequantized.parameters())
    float_model, _ = load(str(tmp_path / "float"))
    assert found.dequantized == parameter_bytes(dequantized) == parameter_bytes(float_model)
    assert found.dequantized > 3 * found.stored  # what a node that dequantizes needs beyond the disk's size


def test_a_float_folder_is_its_size_on_disk_and_a_folder_without_weights_is_not_known(tmp_path: Path):
    stand_in.make(tmp_path / "float")
    size = (tmp_path / "float" / "model.safetensors").stat().st_size
    assert model_files.weights(tmp_path / "float") == model_files.Weights(size, size, quantized=False)
    assert model_files.weights(tmp_path / "missing") is None
    (tmp_path / "hub-id").mkdir()
    assert model_files.weights(tmp_path / "hub-id") is None
    # A quantized folder whose weights cannot be read counts as its size on disk (its ranks say why).
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "broken" / "config.json").write_text(json.dumps({"quantization": {"bits": 4}}))
    assert model_files.weights(tmp_path / "broken") == model_files.Weights(1000, 1000, quantized=True)


Q4 = model_files.Weights(stored=GIB, dequantized=4 * GIB, quantized=True)  # node1 has 2 ranks, node2 1


def test_each_node_needs_what_its_ranks_hold_whole_or_split_quantized_or_dequantized():
    data = room.need(cluster(), Q4)
    assert data.memory == {"node1": 3 * GIB, "node2": 1.5 * GIB}
    assert data.held == {"node1": "the whole model on 2 ranks", "node2": "the whole model on 1 rank"}
    assert data.disk == 2 * GIB  # the folder as stored, on every node
    tensor = room.need(cluster(), Q4, parallel="tensor", dequantize_ranks=[2])
    assert tensor.memory == {"node1": 1 * GIB, "node2": 2 * GIB}
    assert tensor.held == {"node1": "1/3 of the model on 2 ranks",
                           "node2": "1/3 of the model on 1 rank, dequantized"}
    # A pipeline stage holds about its share of the layers: as tensor parallelism's share, by default.
    stages = room.need(cluster(), Q4, parallel="pipeline")
    assert stages.memory == {"node1": 1 * GIB, "node2": 0.5 * GIB}
    assert stages.held == {"node1": "a stage of about 1/3 of the layers on 2 ranks",
                           "node2": "a stage of about 1/3 of the layers on 1 rank"}
    partly = room.need(cluster(), Q4, dequantize_ranks=[1])
    assert partly.memory["node1"] == 7.5 * GIB
    assert partly.held["node1"] == "the whole model on 2 ranks, dequantized on 1 of them"
    # A float model has nothing to dequantize, whatever the ranks asked.
    float_model = model_files.Weights(GIB, GIB, quantized=False)
    assert room.need(cluster(), float_model, dequantize_ranks=[0, 1, 2]).memory == data.memory


def test_the_inventory_s_model_dequantize_is_counted_unless_the_run_names_the_ranks(tmp_path: Path):
    stand_in.make(tmp_path / "q", quantized=True)
    found = model_files.weights(tmp_path / "q")
    assert found is not None
    nodes = tuple(dataclasses.replace(n, model_dequantize=n.name == "node2") for n in cluster().nodes)
    asking = dataclasses.replace(cluster(), nodes=nodes)
    by_inventory = room.for_run(asking, tmp_path / "q")
    assert by_inventory is not None
    assert by_inventory.memory["node2"] == int(found.dequantized * room.MEMORY_FACTOR)
    named = room.for_run(asking, tmp_path / "q", dequantize_ranks=())
    assert named is not None and named.memory["node2"] == int(found.stored * room.MEMORY_FACTOR)


def test_doctor_is_red_where_the_dequantized_model_does_not_fit_and_green_when_split():
    gathered = healthy()
    gathered["nodes"]["node2"]["memory"]["available"] = 4 * GIB
    fits = room.need(cluster(), Q4)
    red = room.need(cluster(), Q4, dequantize_ranks=[2])
    assert [c for c in doctor.evaluate(cluster(), HOSTFILE, gathered, fits) if not c.ok] == []
    [bad] = [c for c in doctor.evaluate(cluster(), HOSTFILE, gathered, red) if not c.ok]
    assert (bad.scope, bad.name) == ("node2", "free memory")
    assert bad.detail == "4.0 GiB free, need ~6.0 GiB for the whole model on 1 rank, dequantized"
    assert "--parallel tensor" in bad.fix
    # The same node holds its third of the dequantized model under tensor parallelism.
    split = room.need(cluster(), Q4, parallel="tensor", dequantize_ranks=[2])
    assert [c for c in doctor.evaluate(cluster(), HOSTFILE, gathered, split) if not c.ok] == []


def test_a_benchmark_s_runs_need_each_node_s_largest():
    one = room.need(cluster().first_nodes(1), Q4)
    split = room.need(cluster(), Q4, parallel="tensor")
    both = room.largest([one, None, split])
    assert both is not None
    assert both.memory == {"node1": 3 * GIB, "node2": 0.5 * GIB}
    assert both.held["node1"] == "the whole model on 2 ranks"
    assert room.largest([None]) is None


# --- pipeline stages: each stage's real share --------------------------------------------------------


def test_a_pipeline_stage_needs_its_layers_bytes_and_its_edges(tmp_path: Path):
    """Read from the headers: the first and middle stages hold the embeddings (a middle one as its
    placeholder's weight), the last the norm and (the head being tied here) the embeddings too;
    stages of 4, 1 and 1 of 6 layers."""
    stand_in.make(tmp_path / "six", num_hidden_layers=6)
    found = model_files.weights(tmp_path / "six", by_layer=True)
    assert found is not None and found.body is not None
    tensors = model_files.headers([tmp_path / "six" / "model.safetensors"])
    layer = [sum(t.bytes for n, t in tensors.items() if n.startswith(f"model.layers.{i}.")) for i in range(6)]
    embeddings = tensors["model.embed_tokens.weight"].bytes
    norm = tensors["model.norm.weight"].bytes
    assert found.body == Body(tuple(layer), embeddings, norm, tied=True)
    whole = sum(layer) + embeddings + norm
    stages = room.for_run(cluster(), tmp_path / "six", parallel="pipeline", stages=[4, 1, 1])
    assert stages is not None
    # node1: ranks 0 and 1 (layers 1-4, layer 5, each with the embeddings); node2: rank 2 (layer 6,
    # the head).
    held = [sum(layer[:4]) + embeddings, layer[4] + embeddings, layer[5] + norm + embeddings]
    assert stages.memory == {
        "node1": round(found.stored * (held[0] + held[1]) / whole * room.MEMORY_FACTOR),
        "node2": round(found.stored * held[2] / whole * room.MEMORY_FACTOR)}
    assert stages.held == {"node1": "layers 1-4 of 6 and the embeddings; layer 5 of 6 and the embeddings "
                                    "on 2 ranks",
                           "node2": "layer 6 of 6 and the head on 1 rank"}
    # Without stages: as equal as the ranks split them by default (2, 2 and 2).
    equal = room.for_run(cluster(), tmp_path / "six", parallel="pipeline")
    assert equal is not None
    assert equal.memory["node2"] == round(found.stored * (sum(layer[4:]) + norm + embeddings) / whole
                                          * room.MEMORY_FACTOR)


def test_without_the_layers_bytes_a_stage_needs_its_fraction_of_the_layers():
    stages = room.need(cluster(), Q4, parallel="pipeline", stages=[4, 1, 1])
    assert stages.memory == {"node1": round(GIB * 5 / 6 * 1.5), "node2": round(GIB / 6 * 1.5)}
    assert stages.held["node2"] == "layer 6 of 6 on 1 rank"


def test_stages_fitted_to_the_bytes_count_each_stage_s_edges():
    from mlxcluster.launch import stages

    # 12 layers of 1 GB, embeddings of 3 GB on every stage but an untied last one (a stage between
    # keeps its placeholder's weight), a head of 6 GB on the last, three equal Macs: dealt by layers
    # the last holds 10 GB and the others 7; fitted, every stage 8.
    body = Body((GIB,) * 12, 3 * GIB, 6 * GIB, tied=False)
    assert [body.edges(stage, 3) for stage in range(3)] == [3 * GIB, 3 * GIB, 6 * GIB]
    assert stages.fitted(body, [1.0, 1.0, 1.0]) == [5, 5, 2]
    assert body.stage_bytes([5, 5, 2]) == [8 * GIB] * 3 and max(body.stage_bytes([4, 4, 4])) == 10 * GIB
    # One stage holds it all; a tied head: the last stage holds the embeddings too.
    assert body.edges(0, 1) == 9 * GIB
    tied = Body((GIB,) * 12, 3 * GIB, 0, tied=True)
    assert stages.fitted(tied, [1.0, 1.0]) == [6, 6]
    # Uneven Macs, no edges: the layers' deal by memory; the fullest stage as little full as can be.
    plain = Body((GIB,) * 30, 0, 0, tied=False)
    assert stages.fitted(plain, [192.0, 64.0, 64.0]) == [18, 6, 6]
    # Uneven layers (a wide one in the middle), every stage at least one layer.
    assert stages.fitted(Body((1, 1, 8, 1, 1), 0, 0, tied=False), [1.0, 1.0, 1.0]) == [2, 1, 2]
    assert stages.fitted(Body((5,) * 4, 100, 0, tied=True), [1.0] * 4) == [1, 1, 1, 1]


def test_replicas_of_the_stages_need_their_stage_s_share_wherever_their_ranks_are():
    two_each = cluster()
    four = dataclasses.replace(two_each, nodes=tuple(dataclasses.replace(n, slots=2) for n in two_each.nodes))
    assert four.world_size == 4
    # 2 stages of 4 and 2 layers: ranks 0 and 2 hold stage 0, ranks 1 and 3 stage 1; a node one of each.
    replicas = room.need(four, Q4, parallel="pipeline", stages=[4, 2])
    assert replicas.memory == {"node1": round(GIB * 1.5), "node2": round(GIB * 1.5)}
    assert replicas.held["node1"] == "layers 1-4 of 6; layers 5-6 of 6 on 2 ranks"
    # Two stages not sized yet, of a model whose layers are not known: about half of it each.
    equal = room.need(four, Q4, parallel="pipeline", stage_count=2)
    assert equal.held["node2"] == "a stage of about 1/2 of the layers on 2 ranks"
    assert equal.memory == replicas.memory


def test_stages_sized_from_the_memory_the_preflight_counts_pass_it_where_equal_ones_do_not():
    from mlxcluster.launch import stages

    six = model_files.Weights(6 * GIB, 6 * GIB, quantized=False, body=Body((GIB,) * 6, 0, 0, tied=False))
    gathered = healthy()
    gathered["nodes"]["node1"]["memory"]["available"] = 12 * GIB  # 6 a rank
    gathered["nodes"]["node2"]["memory"]["available"] = int(2.5 * GIB)
    memory = doctor.memory_of(gathered)
    assert memory == {"node1": 12 * GIB, "node2": int(2.5 * GIB)}
    sized = stages.sized(cluster(), 6, memory)
    assert sized.counts == (3, 2, 1)
    fits = room.need(cluster(), six, parallel="pipeline", stages=sized.counts)
    assert [c for c in doctor.evaluate(cluster(), HOSTFILE, gathered, fits) if not c.ok] == []
    equal = room.need(cluster(), six, parallel="pipeline")  # 2, 2 and 2 layers: node2's 3 GiB do not fit
    [red] = [c for c in doctor.evaluate(cluster(), HOSTFILE, gathered, equal) if not c.ok]
    assert (red.scope, red.name) == ("node2", "free memory")
    # A node that did not answer has no memory to size by.
    gathered["nodes"]["node2"] = {"unreachable": "no route"}
    assert doctor.memory_of(gathered) == {"node1": 12 * GIB, "node2": None}
