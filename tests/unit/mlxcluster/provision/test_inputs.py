"""What a run trains on (mlxcluster/provision/inputs.py) and the layout it reads
(mlxcluster/describe/cluster.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxcluster import paths
from mlxcluster.describe.cluster import Cluster, NotReady, recorded
from mlxcluster.errors import UserError
from mlxcluster.provision import inputs


def cluster(*families: str) -> Cluster:
    return Cluster.from_json({"launcher": "n0", "nodes": [
        {"name": f"n{i}", "thunderbolt_ip": f"10.0.0.{i + 1}", "slots": 1, "os_family": family}
        for i, family in enumerate(families)]})


def test_the_nodes_train_in_float16_only_when_all_are_macs():
    assert inputs.cluster_dtype(cluster("Darwin", "Darwin")) == "float16"
    assert inputs.cluster_dtype(cluster("Darwin", "Debian")) == "float32"
    assert inputs.default_model_dir("float32") == paths.MODELS / "smollm2-135m-float32"


def test_given_directories_are_used_as_they_are_and_must_exist(tmp_path: Path):
    (tmp_path / "data").mkdir()
    (tmp_path / "model").mkdir()
    assert inputs.resolve(cluster("Debian"), str(tmp_path / "data"), str(tmp_path / "model")) == (
        tmp_path / "data", tmp_path / "model")
    with pytest.raises(UserError, match=r"--model .*nowhere is not a directory"):
        inputs.resolve(cluster("Debian"), str(tmp_path / "data"), str(tmp_path / "nowhere"))
    # A dry run neither fetches nor checks.
    assert inputs.resolve(cluster("Debian"), None, None, fetch=False, check=False) == (
        inputs.DEMO_DATA_DIR, inputs.default_model_dir("float32"))


def test_an_unprovisioned_inventory_says_to_provision_it(tmp_path: Path):
    inventory = tmp_path / "never-provisioned-cluster" / "inventory" / "hosts.yml"
    inventory.parent.mkdir(parents=True)
    inventory.write_text("cluster: {}\n")
    with pytest.raises(NotReady, match=r"cannot launch: .*cluster.json is missing: provision"):
        recorded(str(inventory))
    with pytest.raises(NotReady, match=r"cannot check: "):
        recorded(str(inventory), ready=False)


def test_a_recorded_layout_without_its_hostfile_is_not_ready(tmp_path: Path):
    inventory = tmp_path / f"half-provisioned-{tmp_path.name}" / "inventory" / "hosts.yml"
    inventory.parent.mkdir(parents=True)
    build = paths.build_dir_for(inventory)
    build.mkdir(parents=True)
    try:
        (build / "cluster.json").write_text(json.dumps({"launcher": "n0", "nodes": [
            {"name": "n0", "thunderbolt_ip": "10.0.0.1", "slots": 1}]}))
        with pytest.raises(NotReady, match="hostfile is missing: run invoke provision"):
            recorded(str(inventory))
        assert recorded(str(inventory), ready=False).rendered_hostfile == ""
    finally:
        (build / "cluster.json").unlink()
        build.rmdir()
