"""Pipeline stages sized to each Mac (mlxcluster/launch/stages.py): each rank's run of whole layers
from its node's free memory (a node's ranks sharing it), or the inventory's pipeline_layers, equal
when a node's memory is not known; passed to every rank before the user's flags (which win), said,
recorded, and kept by a resumed run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from mlxcluster.describe.cluster import Cluster
from mlxcluster.describe.inventory import inventory_errors
from mlxcluster.errors import UserError
from mlxcluster.jobs import train as training
from mlxcluster.jobs.request import Request
from mlxcluster.launch import runs, settings, stages
from tests.unit import fake_inputs
from tests.unit.mlxcluster.jobs.test_train import lab_layout
from training.model.manifest import write_manifest

GB = 2**30
PIPELINE = settings.read(None, ["--parallel", "pipeline"])


def layout(slots: dict[str, int], by_hand: dict[str, int] | None = None,
           shares: dict[str, int] | None = None) -> Cluster:
    """The lab's nodes node1.. with these slots (and pipeline_layers and batch_share set by hand), in
    rank order."""
    first = lab_layout()["nodes"][0]
    nodes = [{**first, "name": name, "thunderbolt_ip": f"10.78.5.1{i}", "slots": count,
              "pipeline_layers": (by_hand or {}).get(name, 0), "batch_share": (shares or {}).get(name),
              "connection": {**first["connection"], "host": f"10.77.5.1{i}"}}
             for i, (name, count) in enumerate(slots.items(), start=1)]
    return Cluster.from_json({"launcher": "node1", "nodes": nodes})


THREE = {"node1": 1, "node2": 1, "node3": 1}
MAC_STUDIOS = {"node1": 192 * GB, "node2": 64 * GB, "node3": 64 * GB}
THIRTY = {"model_type": "llama", "num_hidden_layers": 30}


def counts(cluster: Cluster, memory: dict | None, config: dict = THIRTY, **kw) -> tuple[int, ...]:
    found = stages.for_run(cluster, PIPELINE, config, memory, **kw)
    assert found is not None
    return found.counts


def test_uneven_memory_gives_uneven_stages_in_rank_order():
    sized = stages.for_run(layout(THREE), PIPELINE, THIRTY, MAC_STUDIOS)
    assert sized is not None and sized.counts == (18, 6, 6)
    assert sized.args == ["--pipeline-layers", "18,6,6"]
    assert sized.line == ("pipeline stages 18,6,6 layers (from each node's free memory: node1 192, node2 64, "
                          "node3 64 GB)")
    # Rank order: the big Mac last gets the most layers last.
    assert counts(layout(THREE), {"node1": 64 * GB, "node2": 64 * GB, "node3": 192 * GB}) == (6, 6, 18)
    # Not exactly proportional: as near as whole layers allow (the fullest stage as little full as
    # can be), every stage at least one.
    assert counts(layout(THREE), {"node1": 100 * GB, "node2": 7 * GB, "node3": 5 * GB}) == (28, 1, 1)


def test_a_node_s_ranks_share_its_memory():
    two_on_one = layout({"node1": 2, "node2": 1})
    assert counts(two_on_one, {"node1": 128 * GB, "node2": 64 * GB}) == (10, 10, 10)
    sized = stages.for_run(two_on_one, PIPELINE, THIRTY, {"node1": 192 * GB, "node2": 64 * GB})
    assert sized is not None and sized.counts == (12, 11, 7)  # 96, 96 and 64 GB a rank
    assert sized.why == "from each node's free memory: node1 192 over 2 ranks, node2 64 GB"


def test_unknown_memory_gives_equal_stages_and_says_so():
    unknown = stages.for_run(layout(THREE), PIPELINE, THIRTY, {**MAC_STUDIOS, "node2": None})
    assert unknown is not None and unknown.counts == (10, 10, 10)
    assert unknown.line == "pipeline stages 10,10,10 layers (equal: the free memory of node2 is not known)"
    dry_run = stages.for_run(layout(THREE), PIPELINE, THIRTY, None)
    assert dry_run is not None and dry_run.counts == (10, 10, 10)
    assert "not asked in a dry run" in dry_run.why
    # A model whose layers the controller cannot count: the ranks split them equally by themselves.
    assert stages.for_run(layout(THREE), PIPELINE, {"model_type": "llama"}, MAC_STUDIOS) is None


def test_the_user_s_pipeline_layers_win_and_other_modes_get_none():
    given = settings.read(None, ["--parallel", "pipeline", "--pipeline-layers", "10,10,10"])
    assert stages.for_run(layout(THREE), given, THIRTY, MAC_STUDIOS) is None
    assert stages.for_run(layout(THREE), settings.read(None, []), THIRTY, MAC_STUDIOS) is None
    assert not stages.asks_memory(given) and stages.asks_memory(PIPELINE)


def test_a_resumed_run_keeps_its_recorded_stages_while_its_ranks_are_as_many():
    kept = stages.for_run(layout(THREE), PIPELINE, THIRTY, {n: 64 * GB for n in THREE}, recorded=[18, 6, 6])
    assert kept is not None and kept.counts == (18, 6, 6)
    assert kept.why == "as this run recorded them when it started"
    # A fault left two ranks: the layers are sized again over them.
    two = layout({"node1": 1, "node2": 1})
    assert counts(two, {"node1": 192 * GB, "node2": 64 * GB}, recorded=[18, 6, 6]) == (23, 7)
    # A record that does not fit the model (or is not one) is not kept.
    assert counts(layout(THREE), MAC_STUDIOS, recorded=[10, 10, 9]) == (18, 6, 6)
    assert counts(layout(THREE), MAC_STUDIOS, recorded="18,6,6") == (18, 6, 6)


def test_the_inventory_s_pipeline_layers_are_kept_and_the_rest_sized_by_memory():
    by_hand = layout(THREE, {"node1": 20})
    sized = stages.for_run(by_hand, PIPELINE, THIRTY, MAC_STUDIOS)
    assert sized is not None and sized.counts == (20, 5, 5)
    assert sized.why == ("pipeline_layers in the inventory on node1; from each node's free memory: node2 64, "
                         "node3 64 GB")
    everywhere = layout({"node1": 2, "node2": 1}, {"node1": 12, "node2": 6})
    assert counts(everywhere, None) == (12, 12, 6)
    with pytest.raises(UserError, match=r"\(node1 12, node2 7, per stage\) leaves -1 of the model's 30 "
                                        r"layers: make them add up to 30"):
        stages.for_run(layout({"node1": 2, "node2": 1}, {"node1": 12, "node2": 7}), PIPELINE, THIRTY, None)
    with pytest.raises(UserError, match="leave at least one layer to each of the 2 other stages"):
        stages.for_run(layout(THREE, {"node1": 29}), PIPELINE, THIRTY, MAC_STUDIOS)


FOUR = {"node1": 1, "node2": 1, "node3": 1, "node4": 1}
TWO_BY_TWO = settings.read(None, ["--parallel", "pipeline", "--pipeline-stages", "2"])


def test_replicas_of_the_stages_size_each_stage_by_its_smallest_replica():
    # Ranks 0-1 and 2-3 are the replicas; stage 0 is on node1 and node3, stage 1 on node2 and node4.
    memory = {"node1": 192 * GB, "node2": 64 * GB, "node3": 96 * GB, "node4": 64 * GB}
    sized = stages.for_run(layout(FOUR), TWO_BY_TWO, THIRTY, memory)
    assert sized is not None and sized.counts == (18, 12)  # 96 against 64
    assert sized.args == ["--pipeline-layers", "18,12"]
    assert sized.why.endswith("; 2 replicas of the stages, each stage as its smallest replica")
    unknown = stages.for_run(layout(FOUR), TWO_BY_TWO, THIRTY, {**memory, "node4": None})
    assert unknown is not None and unknown.counts == (15, 15)
    # A resumed run keeps its two stages; the inventory's numbers hold a stage in every replica.
    kept = stages.for_run(layout(FOUR), TWO_BY_TWO, THIRTY, memory, recorded=[20, 10])
    assert kept is not None and kept.counts == (20, 10)
    by_hand = stages.for_run(layout(FOUR, {"node1": 20, "node3": 20}), TWO_BY_TWO, THIRTY, memory)
    assert by_hand is not None and by_hand.counts == (20, 10)
    with pytest.raises(UserError, match=r"differs between the replicas of stage 0 \(node1 20, node3 22\)"):
        stages.for_run(layout(FOUR, {"node1": 20, "node3": 22}), TWO_BY_TWO, THIRTY, memory)


def test_with_the_model_s_bytes_by_layer_the_stages_holding_more_edges_hold_fewer_layers():
    # 30 layers of 1 GB, embeddings of 6 GB (on every stage but an untied last one) and a head of
    # 12 GB (the last's), on three Macs of 64 GB: 12, 12 and 6, 18 GB each.
    body = stages.Body((GB,) * 30, 6 * GB, 12 * GB, tied=False)
    equal = {n: 64 * GB for n in THREE}
    sized = stages.for_run(layout(THREE), PIPELINE, THIRTY, equal, body=body)
    assert sized is not None and sized.counts == (12, 12, 6)
    assert sized.why.endswith("; the embeddings and the head counted where they are held")
    # Without the bytes (a model not read here), the layers are dealt as before.
    assert counts(layout(THREE), equal) == (10, 10, 10)
    # The inventory's own numbers are kept as they are.
    by_hand = stages.for_run(layout(THREE, {"node1": 12}), PIPELINE, THIRTY, equal, body=body)
    assert by_hand is not None and by_hand.counts == (12, 9, 9)


def test_invoke_doctor_counts_the_stages_invoke_train_would_size(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps(THIRTY))
    assert stages.for_doctor(layout(THREE), tmp_path, "pipeline", MAC_STUDIOS) == (18, 6, 6)
    assert stages.for_doctor(layout(THREE), tmp_path, "data", MAC_STUDIOS) is None
    assert stages.for_doctor(layout(THREE), tmp_path / "unknown", "pipeline", MAC_STUDIOS) is None


def test_replicas_of_the_stages_share_the_batch_as_their_slowest_ranks():
    from mlxcluster.launch import batch_shares

    eight = settings.read(None, ["--parallel", "pipeline", "--pipeline-stages", "2", "--batch-size", "8"])
    # Replica 0 (node1 3, node2 1) is as slow as replica 1 (1 and 1): equal shares, none passed.
    assert batch_shares.for_run(layout(FOUR, shares={"node1": 3, "node2": 1, "node3": 1, "node4": 1}),
                                eight, None) is None
    found = batch_shares.for_run(layout(FOUR, shares={"node1": 3, "node2": 3, "node3": 1, "node4": 1}),
                                 eight, None)
    assert found is not None and found.shares == [6, 2] and found.args == ["--batch-shares", "6,2"]
    assert "each replica of the stages as its slowest rank" in found.why


@pytest.mark.parametrize(("value", "ok"), [(6, True), ("6", True), (0, False), (-2, False), (1.5, False),
                                           ("many", False), (True, False)])
def test_the_inventory_s_pipeline_layers_must_be_a_whole_number_of_at_least_one(value, ok):
    groups = {"cluster": ["node1", "node2"], "linux": ["node1", "node2"], "launcher": ["node1"]}
    link = {"thunderbolt_interface": "bridge0"}
    hostvars = {"node1": {"thunderbolt_ip": "10.0.0.1", **link},
                "node2": {"thunderbolt_ip": "10.0.0.2", **link, "pipeline_layers": value}}
    errors = inventory_errors(groups, hostvars)
    assert (errors == []) if ok else any(
        e.startswith(f"node2: pipeline_layers {value!r} must be a whole number of layers, at least 1")
        for e in errors), errors


@pytest.mark.parametrize(("config", "layers"), [
    ({"num_hidden_layers": 30}, 30), ({"n_layer": 12}, 12), ({"n_layers": 8}, 8), ({"num_layers": 4}, 4),
    ({"text_config": {"num_hidden_layers": 26}}, 26), ({"num_hidden_layers": True}, None), ({}, None),
    (None, None)])
def test_the_model_s_layers_are_read_from_its_config(config, layers):
    assert stages.layer_count(config) == layers


def thirty_layer_model(name: str) -> Path:
    folder = fake_inputs.model(name)
    (folder / "config.json").write_text(json.dumps(THIRTY))
    write_manifest(folder, source=name)
    return folder


def pipeline_plan(cluster: Cluster, memory: dict | None, *flags: str, resume: bool = False) -> training.Plan:
    request = Request(fake_inputs.dataset("/d/p"), thirty_layer_model("/m/thirty"), None,
                      ("--parallel", "pipeline", "--batch-size", "8", *flags), interactive=False)
    return training.plan(cluster, request, run_id="r1", resume=resume, memory=memory)


def test_a_plan_passes_the_stages_before_the_user_s_flags_says_and_records_them():
    the_plan = pipeline_plan(layout(THREE), MAC_STUDIOS, "--iters", "5")
    assert the_plan.launch[-1].endswith(
        "--expected-world-size 3 --pipeline-layers 18,6,6 --parallel pipeline --batch-size 8 --iters 5")
    assert the_plan.settings.pipeline_layers == "18,6,6"  # what every rank reads
    assert "pipeline stages 18,6,6 layers (from each node's free memory: node1 192, node2 64, node3 64 GB)" \
        in the_plan.notices
    assert the_plan.record["pipeline_layers"] == [18, 6, 6]
    assert the_plan.record["pipeline_layers_why"].startswith("from each node's free memory")
    assert the_plan.record["layout_settings"] == ["pipeline_layers"]
    # The user's own stages: nothing of ours on the command line, theirs recorded as theirs.
    theirs = pipeline_plan(layout(THREE), MAC_STUDIOS, "--pipeline-layers", "10,12,8")
    assert "--pipeline-layers 10,12,8" in theirs.launch[-1] and "18,6,6" not in theirs.launch[-1]
    assert theirs.pipeline_stages is None
    assert (theirs.record["pipeline_layers"], theirs.record["pipeline_layers_why"]) == (
        [10, 12, 8], "pipeline_layers in the settings")
    assert theirs.record["layout_settings"] == []


def test_a_resume_keeps_the_run_s_stages_and_a_fault_re_sizes_them(tmp_path, monkeypatch):
    monkeypatch.setattr(runs, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(runs, "REPO", tmp_path)
    monkeypatch.setattr(training, "RUNS", tmp_path / "runs")
    first = pipeline_plan(layout(THREE), MAC_STUDIOS)
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    runs.write_info(run, first.record)
    (run / "config.yaml").write_text(yaml.safe_dump({"parallel": "pipeline", "batch_size": 8,
                                                     "pipeline_layers": "18,6,6"}, sort_keys=False))
    again = runs.resume_config("r1")  # the layout's stages out of the config, run.json keeps them
    assert yaml.safe_load(again.read_text())["pipeline_layers"] is None
    request = Request(fake_inputs.dataset("/d/p"), thirty_layer_model("/m/thirty"), again, (),
                      interactive=False)
    # Memory that would size them otherwise: the run keeps its own.
    equal = {n: 64 * GB for n in THREE}
    resumed = training.plan(layout(THREE), request, run_id="r1", resume=True, memory=equal)
    assert resumed.settings.pipeline_layers == "18,6,6"
    assert "pipeline stages 18,6,6 layers (as this run recorded them when it started)" in resumed.notices
    # On the two nodes a fault left, they are sized again for them.
    left = training.plan(layout(THREE).without({"node3"}), request, run_id="r1", resume=True, memory=equal)
    assert left.settings.pipeline_layers == "15,15"


def test_stages_set_by_hand_that_the_ranks_left_cannot_hold_are_sized_again_on_a_resume(tmp_path,
                                                                                       monkeypatch):
    monkeypatch.setattr(runs, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(runs, "REPO", tmp_path)
    monkeypatch.setattr(training, "RUNS", tmp_path / "runs")
    run = tmp_path / "runs" / "r2"
    run.mkdir(parents=True)
    runs.write_info(run, {"parallel": "pipeline", "pipeline_layers": [10, 12, 8]})
    # The user's own stages, in the config and again in a flag (which a restart passes on).
    (run / "config.yaml").write_text(yaml.safe_dump({"parallel": "pipeline", "batch_size": 8,
                                                     "pipeline_layers": "10,12,8"}, sort_keys=False))
    request = Request(fake_inputs.dataset("/d/p"), thirty_layer_model("/m/thirty"), runs.resume_config("r2"),
                      ("--pipeline-layers", "10,12,8"), interactive=False)
    # On as many ranks they stay as set.
    same = training.plan(layout(THREE), request, run_id="r2", resume=True, memory=MAC_STUDIOS)
    assert same.settings.pipeline_layers == "10,12,8" and same.pipeline_stages is None
    # node3 lost: 3 numbers for 2 ranks would be refused; they are sized again, after the user's flag.
    two = layout(THREE).without({"node3"})
    left = training.plan(two, request, run_id="r2", resume=True, memory=MAC_STUDIOS)
    assert left.settings.pipeline_layers == "23,7" and left.settings.pipeline_stages == 2
    assert "--pipeline-layers 10,12,8 --pipeline-stages 2 --pipeline-layers 23,7" in left.launch[-1]
    said = next(line for line in left.notices if line.startswith("pipeline stages 23,7"))
    assert "pipeline_layers 10,12,8 set by hand do not fit the 2 ranks now: sized again" in said
    # Pipeline and data, 2 stages on 4 ranks, one lost: 2 does not divide 3, one stage a rank.
    four = layout({"node1": 1, "node2": 1, "node3": 1, "node4": 1})
    replicas = Request(fake_inputs.dataset("/d/p"), thirty_layer_model("/m/thirty"), runs.resume_config("r2"),
                       ("--pipeline-stages", "2", "--pipeline-layers", "15,15"), interactive=False)
    three = training.plan(four.without({"node4"}), replicas, run_id="r2", resume=True,
                          memory={n: 64 * GB for n in ("node1", "node2", "node3")})
    assert (three.settings.pipeline_stages, three.settings.pipeline_layers) == (3, "10,10,10")
    # A fresh run with stages that do not fit is refused, not re-sized: the user set them.
    with pytest.raises(UserError, match="pipeline_layers 10,12,8: give 2 whole numbers"):
        training.plan(two, dataclasses.replace(request, config=None, overrides=(
            "--parallel", "pipeline", "--pipeline-layers", "10,12,8")), run_id="r3", memory=MAC_STUDIOS)


def test_the_preflight_counts_the_stages_the_plan_gave_on_the_probes_that_sized_them(monkeypatch):
    from mlxcluster.check import doctor

    probes = {"nodes": {n: {"memory": {"total": m, "available": m}} for n, m in MAC_STUDIOS.items()}}
    asked, checked = [], []
    monkeypatch.setattr(doctor, "gather", lambda cluster: asked.append(cluster) or probes)
    monkeypatch.setattr(doctor, "preflight",
                        lambda cluster, need, probed=None: checked.append((need, probed)))
    request = Request(fake_inputs.dataset("/d/p"), thirty_layer_model("/m/thirty"), None,
                      ("--parallel", "pipeline"), interactive=False)
    probed = training.probe_for_stages(layout(THREE), request)
    assert probed is probes and len(asked) == 1
    the_plan = training.plan(layout(THREE), request, run_id="r1", memory=doctor.memory_of(probed))
    training.preflight(the_plan, probed)
    [(need, given)] = checked
    assert given is probes  # judged on the same probes: the nodes are asked once
    assert need.held == {"node1": "layers 1-18 of 30 on 1 rank", "node2": "layers 19-24 of 30 on 1 rank",
                         "node3": "layers 25-30 of 30 on 1 rank"}
    # A data-parallel run, or stages the user set, asks the nodes nothing before planning.
    data = Request(fake_inputs.dataset("/d/p"), thirty_layer_model("/m/thirty"), None, (), interactive=False)
    assert training.probe_for_stages(layout(THREE), data) is None and len(asked) == 1
