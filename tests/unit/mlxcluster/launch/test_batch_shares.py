"""Batch shares on the controller (mlxcluster/launch/batch_shares.py): the inventory's batch_share and
max_micro_batch checked, turned into each rank's examples of the run's global batch (from the
numbers, or from the latest calibration for auto), passed to every rank and said."""

from __future__ import annotations

import json

import pytest

from mlxcluster.describe.cluster import Cluster
from mlxcluster.describe.inventory import cluster_share_errors, inventory_errors
from mlxcluster.errors import UserError
from mlxcluster.jobs import train as training
from mlxcluster.jobs.request import Request
from mlxcluster.jobs.train import shares_line
from mlxcluster.launch import batch_shares, runs, settings
from tests.unit import fake_inputs
from tests.unit.mlxcluster.jobs.test_train import lab_layout, plan
from training.loop import report


def layout(shares: dict[str, object], limits: dict[str, int] | None = None, slots: int = 1) -> Cluster:
    data = lab_layout()
    for node in data["nodes"]:
        node["batch_share"] = shares.get(node["name"])
        node["max_micro_batch"] = (limits or {}).get(node["name"], 0)
        node["slots"] = slots
    return Cluster.from_json(data)


def calibration(**speeds: float) -> dict:
    return {"date": "2026-11-24T10:00:00", "model_id": "abc", "max_seq_length": 2048,
            "nodes": {name: {"tokens_per_second": s, "peak_memory_gb": 1.0} for name, s in speeds.items()}}


def training_plan(cluster: Cluster, found: dict | None, batch: int) -> training.Plan:
    request = Request(fake_inputs.dataset("/d/p"), fake_inputs.model("/m/t"), None,
                      ("--batch-size", str(batch)), interactive=False, calibration=found)
    return training.plan(cluster, request, run_id="r1")


def batch_shares_line(the_plan: training.Plan) -> str:
    assert the_plan.shares is not None
    return shares_line(the_plan.shares)


@pytest.mark.parametrize(
    ("hv", "message"),
    [
        ({"batch_share": 0}, "node2: batch_share 0 must be a positive number"),
        ({"batch_share": "fast"}, "node2: batch_share 'fast' must be a positive number"),
        ({"batch_share": True}, "node2: batch_share True must be a positive number"),
        ({"batch_share": float("inf")}, "node2: batch_share inf must be a positive number"),
        ({"max_micro_batch": -1}, "node2: max_micro_batch -1 must be a whole number"),
        ({"max_micro_batch": 1.5}, "node2: max_micro_batch 1.5 must be a whole number"),
    ],
)
def test_a_bad_batch_share_or_max_micro_batch_is_named_with_its_fix(hv, message):
    groups = {"cluster": ["node1", "node2"], "linux": ["node1", "node2"], "launcher": ["node1"]}
    hostvars = {"node1": {"thunderbolt_ip": "10.0.0.1"}, "node2": {"thunderbolt_ip": "10.0.0.2", **hv}}
    errors = inventory_errors(groups, hostvars)
    assert any(e.startswith(message) for e in errors), errors


def test_auto_beside_a_number_is_refused_and_good_values_pass():
    hosts = ["node1", "node2", "node3"]
    mixed = {"node1": {"batch_share": "auto"}, "node2": {"batch_share": 2}, "node3": {}}
    assert cluster_share_errors(hosts, mixed) == [
        "batch_share is auto on node1 but a number on node2: use auto on every node (weights from "
        "the calibration) or numbers on every node"]
    good = {"node1": {"batch_share": 3}, "node2": {"batch_share": "1.5", "max_micro_batch": 4}, "node3": {}}
    assert cluster_share_errors(hosts, good) == []


def test_numbers_in_the_inventory_split_the_global_batch_and_go_before_the_users_flags():
    the_plan = plan(layout({"node1": 3, "node2": 1}), overrides=("--batch-size", "8", "--iters", "5"))
    assert the_plan.shares == batch_shares.Shares([6, 2], [0, 0], "from batch_share in the inventory")
    assert the_plan.launch[-1].endswith("--expected-world-size 2 --batch-shares 6,2 --batch-size 8 --iters 5")
    # A node without a share weighs 1; each of a node's ranks gets its weight.
    two_each = plan(layout({"node1": 3}, slots=2), overrides=("--batch-size", "8"))
    assert two_each.shares is not None and two_each.shares.shares == [3, 3, 1, 1]


def test_equal_shares_without_a_cap_pass_nothing_and_a_cap_alone_passes_only_the_cap():
    assert plan(layout({"node1": 2, "node2": 2})).shares is None
    assert plan(layout({})).shares is None
    capped = plan(layout({}, {"node2": 1}), overrides=("--batch-size", "4"))
    assert capped.shares is not None and capped.shares.args == [
        "--batch-shares", "2,2", "--max-micro-batch", "0,1"]
    assert "at most no limit, 1 examples at once (max_micro_batch)" in batch_shares_line(capped)


def test_a_config_that_sets_its_own_shares_is_left_as_it_is(tmp_path):
    config = tmp_path / "mine.yaml"
    config.write_text("batch_size: 4\nbatch_shares: 1,3\n")
    assert plan(layout({"node1": 3, "node2": 1}), config=str(config)).shares is None


def test_auto_takes_each_nodes_speed_from_the_calibration_and_says_which():
    auto = layout({"node1": "auto", "node2": "auto"})
    the_plan = training_plan(auto, calibration(node1=900.0, node2=300.0), batch=8)
    assert the_plan.shares is not None and the_plan.shares.shares == [6, 2]
    assert the_plan.shares.why == ("from the calibration of 2026-11-24T10:00:00 "
                                   "(node1 900 tok/s, node2 300 tok/s)")
    with pytest.raises(UserError, match=r"no calibration of this model and max_seq_length was found: "
                                        r"run invoke bench\.calibrate"):
        training_plan(auto, None, batch=8)
    with pytest.raises(UserError, match="has no speed for node2"):
        training_plan(auto, calibration(node1=900.0), batch=8)
    with pytest.raises(UserError, match="a global batch of 1 cannot give each of 2 ranks an example"):
        training_plan(auto, calibration(node1=900.0, node2=300.0), batch=1)


def test_the_latest_calibration_of_the_same_model_and_sequence_length_is_used(tmp_path):
    path = tmp_path / "calibration.json"
    model = tmp_path / "model"
    model.mkdir()
    key = batch_shares.calibration_key(model, settings.read(None, ["--max-seq-length", "512"]))
    # A model without a manifest is known by its path.
    assert key == {"model_id": f"path:{model}", "max_seq_length": 512}
    assert batch_shares.latest_calibration(path, key) is None
    for date, model_id, length in (("2026-11-20", key["model_id"], 512), ("2026-11-22", key["model_id"], 512),
                                   ("2026-11-23", key["model_id"], 2048), ("2026-11-24", "abc", 512)):
        batch_shares.add_calibration(path, {"date": date, "model_id": model_id, "max_seq_length": length})
    found = batch_shares.latest_calibration(path, key)
    assert found is not None and found["date"] == "2026-11-22"
    assert len(json.loads(path.read_text())["calibrations"]) == 4
    assert not path.with_suffix(".partial").exists()


def test_the_run_settings_are_the_config_file_then_the_flags(tmp_path):
    config = tmp_path / "mine.yaml"
    config.write_text("batch_size: 6\nmax_seq_length: 512\n")
    read = settings.read(config, ["--batch-size", "8", "--steps-per-report", "1"])
    assert (read.batch_size, read.max_seq_length) == (8, 512)
    assert settings.read(None, []).batch_size == 4  # the shipped lora.yaml
    with pytest.raises(UserError, match="unknown key"):
        config.write_text("batch_sise: 6\n")
        settings.read(config, [])


def test_the_shares_benchmark_reports_the_ratio_and_the_share_of_the_solo_speeds():
    from rich.console import Console

    from mlxcluster.bench import shares as bench

    solo = {"node1": {"tokens_per_second": 900.0}, "node2": {"tokens_per_second": 300.0}}
    equal, calibrated = {"tokens_per_second": 600.0, "shares": [4, 4]}, {"tokens_per_second": 1080.0,
                                                                          "shares": [6, 2]}
    figures = bench.figures(solo, equal, calibrated)
    assert figures == {"calibrated_over_equal": 1.8, "solo_sum_tokens_per_second": 1200.0,
                       "calibrated_over_solo_sum": 0.9}
    console = Console(record=True, width=120)
    console.print(bench.table({"model": "tiny", "global_batch_size": 8, "iters": 30, "solo": solo,
                               "equal": equal, "calibrated": calibrated, "figures": figures}))
    text = console.export_text()
    assert "all, calibrated" in text and "6,2" in text and "1.80x" in text and "90%" in text


def test_a_calibration_runs_each_node_alone_with_the_whole_batch_and_its_own_cap():
    from mlxcluster.bench.calibrate import alone

    auto = layout({"node1": "auto", "node2": "auto"}, {"node2": 2}, slots=2)
    for node in auto.nodes:
        solo = alone(node)
        assert solo.launcher == node.name and solo.world_size == 1
        # No calibration is needed to calibrate; node2's cap still holds.
        shared = training_plan(solo, None, batch=4).shares
        assert shared is None if node.name == "node1" else shared == batch_shares.Shares(
            [4], [2], "from batch_share in the inventory")


def test_the_shares_make_the_slowest_rank_fastest_and_the_run_says_each_ranks_time(tmp_path):
    # Weights 5:1 of 8 were 6,2 by largest remainder after one example each: the 1-weight rank then
    # took 2 units while the other took 1.2. The slowest rank is fastest at 7,1 (1.4 and 1 unit).
    the_plan = plan(layout({"node1": 5, "node2": 1}), overrides=("--batch-size", "8"))
    assert the_plan.shares is not None and the_plan.shares.shares == [7, 1]
    assert the_plan.shares.step_times == pytest.approx([1.4, 1.0])
    line = batch_shares_line(the_plan)
    assert "each rank's part of a step 1.40, 1.00x the fastest's" in line and "at most" not in line
    assert the_plan.record["batch_shares"] == [7, 1]
    assert the_plan.record["batch_step_times"] == [1.4, 1.0]
    # Exactly proportional weights: every rank's part takes as long.
    even = plan(layout({"node1": 3, "node2": 1}), overrides=("--batch-size", "8")).shares
    assert even is not None and even.step_times == [1.0, 1.0]
    # The controller adds the expected times to the summary the ranks wrote.
    (tmp_path / "summary.json").write_text(json.dumps({"batch": {"ranks": [{"rank": 0}, {"rank": 1}]}}))
    runs.add_step_times(tmp_path, the_plan.shares.step_times)
    ranks = json.loads((tmp_path / "summary.json").read_text())["batch"]["ranks"]
    assert [r["expected_step_time"] for r in ranks] == [1.4, 1.0]


def test_the_summary_says_no_limit_where_a_rank_has_no_micro_batch_cap():
    split = report.batch_split([3, 1], 3, [30, 10], 40.0, [0, 1])
    assert [r["max_micro_batch"] for r in split["ranks"]] == ["no limit", 1]
    assert [r["max_micro_batch"] for r in report.batch_split([2], 1, [5], 1.0)["ranks"]] == ["no limit"]


def test_a_resume_on_fewer_nodes_works_the_shares_out_again_for_them(tmp_path, monkeypatch):
    """The shares and caps the inventory gave (config.yaml keeps them, rank by rank) are not the
    resumed run's: on the nodes a fault left they are worked out again, the global batch the
    same; shares the user's own config set stay (and are checked against the ranks)."""
    import yaml

    monkeypatch.setattr(runs, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(runs, "REPO", tmp_path)
    three = layout({"node1": 3, "node2": 1}, {"node2": 1}, slots=2)
    first = plan(three, overrides=("--batch-size", "8"))
    assert first.shares is not None and first.shares.shares == [3, 3, 1, 1]
    assert first.record["layout_settings"] == ["batch_shares", "max_micro_batch"]
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    runs.write_info(run, first.record)
    (run / "config.yaml").write_text(yaml.safe_dump(
        {"batch_size": 8, "iters": 40, "batch_shares": "3,3,1,1", "max_micro_batch": "0,0,1,1"},
        sort_keys=False))
    again = runs.resume_config("r1")
    assert yaml.safe_load(again.read_text()) == {"batch_size": 8, "iters": 40, "batch_shares": None,
                                                  "max_micro_batch": None}
    left = plan(three.without({"node1"}), config=str(again), resume=True)
    assert left.shares is not None
    assert left.shares.args == ["--batch-shares", "4,4", "--max-micro-batch", "1,1"]
    # Set by the user: kept as they are.
    runs.write_info(run, {**first.record, "layout_settings": []})
    assert yaml.safe_load(runs.resume_config("r1").read_text())["batch_shares"] == "3,3,1,1"
