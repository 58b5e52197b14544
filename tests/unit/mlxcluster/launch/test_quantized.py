"""A quantized base model on the controller (mlxcluster/launch/quantized.py): the inventory's
model_dequantize given to the ranks as --dequantize-ranks in rank order, said per node in the dry run
and in run.json, and full refused on a quantized base before anything is synced."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from mlxcluster.describe.cluster import Cluster
from mlxcluster.errors import UserError
from mlxcluster.jobs import train as training
from mlxcluster.jobs.request import Request
from tests.unit import fake_inputs
from tests.unit.mlxcluster.jobs.test_train import lab_layout
from training.model.manifest import write_manifest

Q4 = {"group_size": 64, "bits": 4}


def layout(dequantize: dict[str, bool], slots: dict[str, int] | None = None) -> Cluster:
    data = lab_layout()
    for node in data["nodes"]:
        node["model_dequantize"] = dequantize.get(node["name"], False)
        node["slots"] = (slots or {}).get(node["name"], 1)
    return Cluster.from_json(data)


def model(name: str, quantization: dict | None = Q4) -> Path:
    """A model folder whose config.json has this quantization (none: float)."""
    folder = fake_inputs.model(f"/m/{name}")
    config = {
        "model_type": "llama",
        **({"quantization": quantization, "quantization_config": quantization} if quantization else {}),
    }
    (folder / "config.json").write_text(json.dumps(config))
    write_manifest(folder, source=name)
    return folder


def plan(cluster: Cluster, model_dir: Path, *overrides: str, **request: object) -> training.Plan:
    asked = Request(
        fake_inputs.dataset("/d/p"), model_dir, None, overrides, interactive=False, **request
    )  # type: ignore[arg-type]
    return training.plan(cluster, asked, run_id="r1")


def test_the_nodes_that_ask_dequantize_at_load_and_the_run_says_so_per_node():
    cluster = layout({"node2": True})
    the_plan = plan(cluster, model("q4"), "--iters", "5")
    assert the_plan.launch[-1].endswith("--expected-world-size 2 --dequantize-ranks 1 --iters 5")
    line = (
        "base weights 4-bit affine, group 64: kept quantized on node1; dequantized at load on node2 "
        "(inventory model_dequantize)"
    )
    assert line in the_plan.notices
    assert the_plan.record["base_weights"] == {"node1": "4-bit affine, group 64", "node2": "dequantized"}
    assert the_plan.dequantize_ranks == (1,)  # what the memory preflight counts in float
    with contextlib.redirect_stdout(io.StringIO()) as shown:
        training.show(the_plan)
    assert f"# {line}\n" in shown.getvalue()


def test_a_node_s_ranks_are_numbered_as_the_launchers_fill_the_hostfile():
    cluster = layout({"node2": True}, slots={"node1": 2, "node2": 2})
    mixed = {"group_size": 64, "bits": 4, "model.layers.0.mlp.down_proj": {"group_size": 64, "bits": 8}}
    the_plan = plan(cluster, model("mixed", mixed))
    assert "--dequantize-ranks 2,3" in the_plan.launch[-1]
    assert the_plan.dequantize_ranks == (2, 3)
    assert the_plan.record["base_weights"] == {
        "node1": "mixed 4/8-bit affine, group 64",
        "node2": "dequantized",
    }


def test_without_a_node_that_asks_every_rank_keeps_the_quantized_weights():
    the_plan = plan(layout({}), model("q4"))
    assert "--dequantize-ranks" not in the_plan.launch[-1]
    assert "base weights 4-bit affine, group 64: kept quantized on node1, node2" in the_plan.notices
    assert the_plan.record["base_weights"] == {
        "node1": "4-bit affine, group 64",
        "node2": "4-bit affine, group 64",
    }


def test_a_float_model_or_one_not_known_yet_gets_no_flag_and_nothing_is_said():
    for the_plan in (
        plan(layout({"node2": True}), model("float", None)),
        plan(
            layout({"node2": True}),
            Path("/nowhere/models/hub-model"),
            pending=frozenset({"model"}),
            pending_shape=None,
        ),
    ):
        assert "--dequantize-ranks" not in the_plan.launch[-1]
        assert not [line for line in the_plan.notices if line.startswith("base weights")]
        assert the_plan.record["base_weights"] is None
        assert the_plan.dequantize_ranks == ()
    # A model not fetched yet whose source's config.json says it is quantized is said all the same.
    pending = plan(
        layout({"node2": True}),
        Path("/nowhere/models/q4"),
        pending=frozenset({"model"}),
        pending_shape={"model_type": "llama", "quantization": Q4},
    )
    assert "--dequantize-ranks 1" in pending.launch[-1]


def test_ranks_the_settings_name_win_over_the_inventory():
    the_plan = plan(layout({"node2": True}), model("q4"), "--dequantize-ranks", "0")
    assert the_plan.launch[-1].count("--dequantize-ranks") == 1
    assert the_plan.dequantize_ranks == (0,)
    assert (
        "base weights 4-bit affine, group 64: kept quantized on node2; dequantized at load on node1 "
        "(dequantize_ranks in the settings)"
    ) in the_plan.notices


def test_full_on_a_quantized_base_is_refused_before_anything_is_synced_unless_every_node_dequantizes():
    with pytest.raises(
        UserError,
        match=r"cannot train: fine_tune_type full on a quantized model \(4-bit "
        r"affine, group 64\): .* train lora or dora .* set model_dequantize: "
        r"true for every training node",
    ):
        plan(layout({"node2": True}), model("q4"), "--fine-tune-type", "full")
    every = plan(layout({"node1": True, "node2": True}), model("q4"), "--fine-tune-type", "full")
    assert "--dequantize-ranks 0,1" in every.launch[-1]
    assert "dequantized at load on node1, node2 (inventory model_dequantize)" in every.notices[-1]
    for kind in ("lora", "dora"):
        assert plan(layout({}), model("q4"), "--fine-tune-type", kind).record["base_weights"]
    assert plan(layout({}), model("float", None), "--fine-tune-type", "full").record["base_weights"] is None


def test_a_rank_beyond_the_run_is_refused_with_the_ranks_it_has():
    with pytest.raises(UserError, match=r"dequantize_ranks 3: rank 3 is beyond the 2 ranks of this run"):
        plan(layout({}), model("q4"), "--dequantize-ranks", "3")
