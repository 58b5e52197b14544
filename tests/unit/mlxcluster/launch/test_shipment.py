"""What of a user's folder goes to the nodes (mlxcluster/launch/shipment.py): the files the job reads,
each checked, sent by real rsync to a local node; never the folder whole, never through a link
that leads out of it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from mlxcluster.describe.cluster import Cluster
from mlxcluster.launch import shipment, sync
from mlxcluster.launch.shipment import ShipmentError
from tests.unit import fake_inputs
from tests.unit.mlxcluster.jobs.test_train import lab_layout
from training.model.manifest import write_manifest

SECRETS = (".ssh/id_ed25519", ".cache/huggingface/token", "notes.txt", "id_ed25519")


def home_with(tmp_path: Path, *files: str) -> Path:
    """A home folder with a private key, a token and notes beside `files`."""
    home = tmp_path / "home"
    for name in (*SECRETS, *files):
        (home / name).parent.mkdir(parents=True, exist_ok=True)
        (home / name).write_text(f"{name}: SECRET\n" if name in SECRETS else "{}\n")
    return home


def local_node(tmp_path: Path):
    layout = lab_layout()
    layout["nodes"] = [dict(layout["nodes"][0], cluster_root=str(tmp_path / "node"),
                            connection={"type": "local"})]
    return Cluster.from_json(layout).head


def landed(tmp_path: Path, shipped: shipment.Shipment, *, delete: bool = True) -> list[str]:
    """Send `shipped` to a local node with the command a run uses; the files that arrived."""
    dest = tmp_path / "node" / "dest"
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(sync.send(shipped, local_node(tmp_path), str(dest), delete=delete), check=True,
                   capture_output=True)
    return sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())


def test_a_data_folder_in_a_home_sends_its_splits_and_nothing_else(tmp_path):
    home = home_with(tmp_path, "train.jsonl", "valid.jsonl")
    shipped = shipment.dataset(home)
    assert shipped.files == ("train.jsonl", "valid.jsonl")
    assert landed(tmp_path, shipped) == ["train.jsonl", "valid.jsonl"]
    # A later data set of the same name without a valid split leaves no stale one behind.
    (home / "valid.jsonl").unlink()
    (home / "test.jsonl").write_text("{}\n")
    assert landed(tmp_path, shipment.dataset(home)) == ["test.jsonl", "train.jsonl"]


def test_a_folder_that_is_no_data_set_or_no_model_is_refused_naming_what_it_lacks(tmp_path):
    home = home_with(tmp_path)
    with pytest.raises(ShipmentError, match=r"--data .*home is not a data set: it has no train\.jsonl"):
        shipment.dataset(home)
    with pytest.raises(ShipmentError, match=r"--model .*home is not a model folder: it has no "
                                              r"manifest\.json"):
        shipment.model(home)
    with pytest.raises(ShipmentError, match="no such folder"):
        shipment.dataset(tmp_path / "nowhere")
    (home / "manifest.json").write_text("{not json")
    with pytest.raises(ShipmentError, match=r"its manifest\.json cannot be read"):
        shipment.model(home)
    (home / "config.json").write_text("{}")
    write_manifest(home)  # every top-level file: the key and the notes too
    with pytest.raises(ShipmentError, match=r"lists id_ed25519, which no mlx-lm model has"):
        shipment.model(home)


def test_a_model_sends_the_files_its_manifest_lists_and_the_manifest(tmp_path):
    model = fake_inputs.model(tmp_path / "m" / "tiny")
    for name, text in (("id_ed25519", "SECRET"), ("extra.json", "{}")):  # added after the fetch
        (model / name).write_text(text)
    shipped = shipment.model(model)
    assert sorted(shipped.files) == ["config.json", "manifest.json", "model.safetensors", "tokenizer.json"]
    assert landed(tmp_path, shipped) == sorted(shipped.files)
    manifest = json.loads((model / "manifest.json").read_text())
    del manifest["files"]["model.safetensors"]
    (model / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShipmentError, match=r"not a whole model: its manifest\.json lists no "
                                              r"model\*\.safetensors"):
        shipment.model(model)


def test_links_out_of_the_folder_or_to_hidden_files_are_refused_never_followed(tmp_path):
    home = home_with(tmp_path, "train.jsonl")
    outside = tmp_path / "outside.jsonl"
    outside.write_text("{}\n")
    (home / "valid.jsonl").symlink_to(outside)
    with pytest.raises(ShipmentError, match=rf"valid\.jsonl leads out of the folder \(to {outside}\)"):
        shipment.dataset(home)
    (home / "valid.jsonl").unlink()
    (home / "valid.jsonl").symlink_to(home / ".cache" / "huggingface" / "token")
    with pytest.raises(ShipmentError, match=r"leads to a hidden file \(\.cache/huggingface/token\)"):
        shipment.dataset(home)
    (home / "valid.jsonl").unlink()
    (home / "valid.jsonl").symlink_to("train.jsonl")  # inside, and plain: sent as the file it names
    assert landed(tmp_path, shipment.dataset(home)) == ["train.jsonl", "valid.jsonl"]
    assert not (tmp_path / "node" / "dest" / "valid.jsonl").is_symlink()
    (home / "train.jsonl").unlink()
    (home / "train.jsonl").mkdir()
    with pytest.raises(ShipmentError, match=r"train\.jsonl is not a regular file"):
        shipment.dataset(home)


def test_a_runs_checkpoints_go_file_by_file_and_never_through_a_link(tmp_path):
    run = tmp_path / "runs" / "r1"
    step = run / "checkpoints" / "0000010"
    step.mkdir(parents=True)
    for name in ("adapters.safetensors", "optimizer.safetensors", "state.json"):
        (step / name).write_text(name)
    (step / "id_ed25519").write_text("SECRET")  # not a checkpoint's file: stays behind
    shipped = shipment.checkpoints(run)
    assert shipped is not None
    assert landed(tmp_path, shipped, delete=False) == [
        "0000010/adapters.safetensors", "0000010/optimizer.safetensors", "0000010/state.json"]
    (step / "state.json").unlink()
    (step / "state.json").symlink_to(tmp_path / "home_state.json")
    (tmp_path / "home_state.json").write_text("SECRET")
    with pytest.raises(ShipmentError, match=r"state\.json leads out of the folder"):
        shipment.checkpoints(run)
    elsewhere = tmp_path / "elsewhere"
    (run / "checkpoints").rename(elsewhere)
    (run / "checkpoints").symlink_to(elsewhere)
    with pytest.raises(ShipmentError, match="is not a folder of the run"):
        shipment.checkpoints(run)
    assert shipment.checkpoints(tmp_path / "runs" / "r2") is None  # none: nothing to send


def test_the_model_fans_out_from_the_launcher_with_the_same_files():
    shipped = shipment.model(fake_inputs.model("/m/tiny"))
    fan = sync.fan_out(Cluster.from_json(lab_layout()), shipped, "/opt/mlx-cluster/models/tiny")
    [(_, cmd)] = fan
    for rule in shipped.rsync_filter():
        assert rule in cmd[-1]
    assert "--delete-excluded" in cmd[-1] and cmd[-1].index("--include=/config.json") < cmd[-1].index(
        "--exclude=*")
