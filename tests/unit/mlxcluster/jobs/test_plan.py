"""`invoke plan` and `--parallel auto` (mlxcluster/jobs/plan.py): a real model folder and data
planned on a cluster whose nodes can give so much memory: the pick, the refusal that names what
would fit, the JSON a script reads, and auto replaced by the pick before anything is synced."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from mlxcluster.describe.cluster import Recorded
from mlxcluster.errors import UserError
from mlxcluster.jobs import plan as planning
from mlxcluster.jobs.request import Options, Request
from mlxcluster.plan.memory import PROCESS_BYTES
from tests.unit.mlxcluster.launch.test_stages import layout as cluster_of
from tests.unit.mlxcluster.plan.test_memory import SHAPE, fixed_length_data
from training.model import stand_in
from training.model.manifest import write_manifest

THREE = {"node1": 1, "node2": 1, "node3": 1}
FOUR = {"node1": 1, "node2": 1, "node3": 1, "node4": 1}


@pytest.fixture(scope="module")
def request_(tmp_path_factory: pytest.TempPathFactory) -> Request:
    root = tmp_path_factory.mktemp("plan-job")
    stand_in.make(root / "model", **SHAPE)
    write_manifest(root / "model")  # a folder invoke model.fetch made: used as it is
    return Request(fixed_length_data(root / "data", 200), root / "model", overrides=("--batch-size", "4"))


def test_with_room_everywhere_data_is_picked_and_every_layout_planned(request_):
    plan = planning.for_request(cluster_of(THREE), request_, dict.fromkeys(THREE, 2**34))
    assert plan.job.length == 224 and plan.job.batch_size == 4  # 200 tokens, padded as mlx-lm pads
    assert [f.layout.name for f in plan.fits] == ["data", "tensor", "pipeline 1,1,1"]
    assert plan.picked is plan.fits[0]
    batch, length = plan.limits["data"]
    assert batch is not None and batch > 4 and length is not None and length > 224
    document = json.loads(json.dumps(planning.as_json(plan)))
    ranks = document["layouts"][0]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    assert ranks[0]["total"] == sum(ranks[0][t] for t in ("weights", "trainable", "gradients", "optimizer",
                                                           "activations", "working", "logits", "overhead"))


def test_too_little_room_for_data_picks_the_pipeline_and_none_names_what_would_fit(request_):
    cluster = cluster_of(THREE)
    roomy = planning.for_request(cluster, request_, dict.fromkeys(THREE, 2**34))
    peak = roomy.fits[0].need["node1"] - PROCESS_BYTES  # a data rank's, beside its process
    split = planning.for_request(cluster, request_, dict.fromkeys(THREE, PROCESS_BYTES + int(peak * 0.9)))
    assert split.picked is not None and split.picked.layout.parallel == "pipeline"
    tight = planning.for_request(cluster, request_, dict.fromkeys(THREE, PROCESS_BYTES + int(peak * 0.3)))
    assert tight.picked is None
    message = planning.refusal(tight)
    assert message.startswith("no layout fits this run's batch of 4 x 224 tokens (data: node1 needs ")
    assert "what would fit: --batch-size" in message or "not even one example fits" in message


def test_auto_becomes_the_pick_before_anything_runs(request_, monkeypatch, tmp_path: Path, capsys):
    four = cluster_of({"node1": 1, "node2": 1, "node3": 1, "node4": 1})
    rec = Recorded("inventory/lab.yml", four, tmp_path)
    options = Options(model=str(request_.model), data=str(request_.data), batch_size=4, parallel="auto")
    # A dry run asks no node: every layout fits, and data is picked.
    assert planning.resolved(four, rec, options, probe=False).parallel == "data"
    assert capsys.readouterr().out.startswith("==> parallel auto: data (data parallelism fits")
    # Nodes with room for half a data rank each (their probes, as doctor.gather reads them): a
    # pipeline of two stages twice (4 stages of 3 layers cannot be; 6 heads do not split in 4).
    roomy = planning.for_request(four, request_, dict.fromkeys(FOUR, 2**34))
    half = PROCESS_BYTES + int((roomy.fits[0].need["node1"] - PROCESS_BYTES) * 0.8)
    monkeypatch.setattr(planning, "free_memory", lambda cluster: dict.fromkeys(FOUR, half))
    chosen = planning.resolved(four, rec, options)
    assert (chosen.parallel, chosen.extra) == ("pipeline", "--pipeline-stages 2")
    assert planning.resolved(four, rec, dataclasses.replace(options, parallel="tensor")).parallel == "tensor"
    monkeypatch.setattr(planning, "free_memory", lambda cluster: dict.fromkeys(FOUR, PROCESS_BYTES // 2))
    with pytest.raises(UserError, match="no layout fits"):
        planning.resolved(four, rec, options)


def test_a_model_not_on_this_machine_cannot_be_planned(tmp_path: Path, request_):
    missing = dataclasses.replace(request_, model=tmp_path / "nothing")
    with pytest.raises(UserError, match=r"has no safetensors and config\.json on this machine"):
        planning.for_request(cluster_of(THREE), missing, dict.fromkeys(THREE, 2**34))


def test_with_the_cluster_s_measures_each_layout_has_a_step_time(request_):
    from mlxcluster.plan.speed import Measures

    measures = Measures(dict.fromkeys(THREE, 2000.0), bandwidth=1e9, latency=1e-4, source="measured")
    plan = planning.for_request(cluster_of(THREE), request_, dict.fromkeys(THREE, 2**34), measures)
    steps = {f.layout.name: f.step_s for f in plan.fits}
    assert all(step is not None and step > 0 for step in steps.values()), steps
    assert planning.as_json(plan)["step_times_from"] == "measured"
    unmeasured = planning.for_request(cluster_of(THREE), request_, dict.fromkeys(THREE, 2**34))
    assert unmeasured.fits[0].step_s is None
