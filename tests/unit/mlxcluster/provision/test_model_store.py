"""The provisioned model: the manifest checks the model role runs on the nodes
(training/model/manifest.py), the controller's cache (mlxcluster/provision/model_store.py), and `invoke train`
using the installed copy (mlxcluster/provision/inputs.py, cluster.py, train.py)."""

from __future__ import annotations

import json
import os
import shlex
import time
from pathlib import Path

import pytest

from mlxcluster.describe.cluster import Cluster, NotReady
from mlxcluster.errors import UserError
from mlxcluster.jobs import train as training
from mlxcluster.jobs.request import Request
from mlxcluster.provision import inputs, model_store
from tests.unit import fake_inputs
from tests.unit.mlxcluster.jobs.test_train import lab_layout
from tests.unit.training.model.test_folder import tiny_model
from training.model import folder, manifest


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tmp_path_factory.mktemp("src") / "tiny"
    tiny_model(source)
    return source


def test_a_copy_is_checked_against_the_manifest_whose_digest_is_expected(tmp_path: Path):
    copy = tmp_path / "m"
    assert manifest.copy_problems(copy, None) == ["not installed"]
    copy.mkdir()
    (copy / "w.safetensors").write_bytes(b"\0" * 64)
    assert manifest.copy_problems(copy, None) == ["no manifest.json"]
    manifest.write_manifest(copy, source="x")
    digest = manifest.manifest_sha256(copy)
    assert digest and manifest.copy_problems(copy, digest) == []
    assert manifest.copy_problems(copy, "f" * 64)[0].startswith("another model")
    (copy / "w.safetensors").write_bytes(b"\1" + b"\0" * 63)  # same size, one byte flipped
    assert manifest.copy_problems(copy, digest) == ["changed: w.safetensors"]


def test_a_quick_check_trusts_the_stamp_only_while_no_file_was_written(tmp_path: Path, monkeypatch):
    copy = tmp_path / "m"
    copy.mkdir()
    weights = copy / "w.safetensors"
    weights.write_bytes(b"\0" * 64)
    manifest.write_manifest(copy, source="x")
    digest = manifest.manifest_sha256(copy)
    assert digest
    # No stamp yet: hashed, and stamped only when asked to record.
    assert manifest.copy_problems(copy, digest, full=False) == []
    assert not (copy / manifest.VERIFIED).exists()
    assert manifest.copy_problems(copy, digest, full=False, record=True) == []
    assert (copy / manifest.VERIFIED).exists()
    # The stamp holds: nothing is hashed (and the stamp itself is no unexpected file).
    hashed: list[str] = []
    real_sha256 = manifest.sha256
    monkeypatch.setattr(manifest, "sha256", lambda p: hashed.append(p.name) or real_sha256(p))
    assert manifest.copy_problems(copy, digest, full=False) == []
    assert hashed == ["manifest.json"]
    assert manifest.copy_problems(copy, digest, full=True) == [] and "w.safetensors" in hashed
    # Same size, mtime put back, one byte flipped: ctime moved, so the quick check hashes it.
    mtime = weights.stat().st_mtime_ns
    time.sleep(0.05)  # past the kernel's coarse clock tick, as any later run is
    weights.write_bytes(b"\1" + b"\0" * 63)
    os.utime(weights, ns=(mtime, mtime))
    assert manifest.copy_problems(copy, digest, full=False) == ["changed: w.safetensors"]
    # A stamp for another manifest is not trusted.
    stamp = json.loads((copy / manifest.VERIFIED).read_text())
    (copy / manifest.VERIFIED).write_text(json.dumps({**stamp, "manifest_sha256": "0" * 64}))
    weights.write_bytes(b"\0" * 64)
    manifest.record_verified(copy, "0" * 64)
    assert manifest.copy_problems(copy, digest, full=False, record=True) == []
    assert json.loads((copy / manifest.VERIFIED).read_text())["manifest_sha256"] == digest


def test_the_free_disk_check_counts_what_the_copy_holds_and_says_what_to_fix(tmp_path: Path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "w").write_bytes(b"\0" * 1000)
    free = manifest.free_bytes(tmp_path / "m" / "not" / "yet")  # the nearest existing parent's
    assert free > 0
    assert manifest.room_shortfall(tmp_path / "m", free + 1000) is None
    message = manifest.room_shortfall(tmp_path / "m", free + 10**12)
    assert message and "GiB free" in message and "mpi_slots: 0" in message


def test_the_dtype_policy_follows_the_linux_nodes():
    assert model_store.policy("auto", linux_trains=False) == "float16"
    assert model_store.policy("auto", linux_trains=True) == "float32"
    assert model_store.policy("bfloat16", linux_trains=True) == "bfloat16"
    with pytest.raises(UserError, match="cluster_model_dtype must be one of"):
        model_store.policy("int4", linux_trains=True)
    assert model_store.cache_dir("smollm2", "float32").name == "smollm2-135m-float32"


def test_the_controller_fetches_once_and_again_only_when_the_source_changes(tiny_source: Path,
                                                                            tmp_path: Path):
    def ensure(check: bool = False) -> dict:
        return model_store.ensure(str(tiny_source), "float32", linux_trains=True, into=tmp_path,
                                  check=check)

    assert ensure(check=True) == {**ensure(check=True), "changed": True, "manifest_sha256": None}
    assert not (tmp_path / "tiny").exists()  # --check fetches nothing
    first = ensure()
    assert first["changed"] and first["path"] == str(tmp_path / "tiny")
    assert first["manifest_sha256"] == manifest.manifest_sha256(tmp_path / "tiny")
    assert ensure() == {**first, "changed": False}
    later = (tmp_path / "tiny" / "manifest.json").stat().st_mtime + 10
    os.utime(tiny_source / "config.json", (later, later))  # the user edited the source
    assert ensure()["changed"]
    with pytest.raises(UserError, match=r"cluster_model 'nowhere/at-all!': model source .* is not 'smollm2'"):
        model_store.ensure("nowhere/at-all!", linux_trains=True, into=tmp_path)


def test_a_quantized_model_stays_quantized_when_a_linux_node_trains_and_an_older_dequantized_copy_goes(
        tmp_path: Path):
    source = tmp_path / "src" / "tiny-4bit"
    tiny_model(source, quantized=True)
    cache = tmp_path / "cache"
    # The older policy's copy: dequantized because a Linux node trains.
    folder.fetch(str(source), cache / "tiny-4bit", "float32", dequantize=True)
    assert "quantization" not in json.loads((cache / "tiny-4bit" / "config.json").read_text())

    found = model_store.ensure(str(source), linux_trains=True, into=cache)
    assert found["changed"] and found["dtype"] == "float32"
    copy = Path(found["path"])
    assert (copy / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()
    assert json.loads((copy / "config.json").read_text())["quantization"] == {"group_size": 32, "bits": 4}
    assert json.loads((copy / manifest.MANIFEST).read_text())["dequantize"] == "false"
    assert not model_store.ensure(str(source), linux_trains=True, into=cache)["changed"]
    assert not model_store.for_run(str(source), linux_trains=True, fetch=False, into=cache).pending


def test_a_float_model_fetched_under_the_older_policy_is_not_fetched_again(tmp_path: Path):
    source = tmp_path / "src" / "tiny"
    tiny_model(source)
    # Then a Linux node's copy said dequantize "true" whatever the model: a float one was only copied.
    folder.fetch(str(source), tmp_path / "tiny", "float32", dequantize=True)
    assert json.loads((tmp_path / "tiny" / manifest.MANIFEST).read_text())["dequantize"] == "true"
    assert not model_store.ensure(str(source), linux_trains=True, into=tmp_path)["changed"]


def test_the_module_answers_in_json_and_errors_in_words(tiny_source: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]):
    argv = ["ensure", "--source", str(tiny_source), "--dtype", "float32", "--linux",
            "--into", str(tmp_path)]
    assert model_store.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["name"] == "tiny"
    assert model_store.main(["ensure", "--source", "no such model", "--into", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith("error: cluster_model 'no such model'")


def installed_layout(*, node2_digest: str = "abc") -> Cluster:
    layout = lab_layout()
    for node, digest in zip(layout["nodes"], ("abc", node2_digest), strict=True):
        node["model"] = {"path": "/opt/mlx-cluster/models/tiny", "manifest_sha256": digest,
                         "source": "/src/tiny", "controller_path": "/repo/models/tiny", "bytes": 9}
    return Cluster.from_json(layout)


def test_train_uses_the_installed_model_and_only_verifies_it():
    cluster = installed_layout()
    assert inputs.installed_model(cluster, None) == cluster.head.model
    assert inputs.installed_model(cluster, "/repo/models/tiny") == cluster.head.model
    assert inputs.installed_model(cluster, "/elsewhere/other") is None  # --model other: copied
    request = Request(fake_inputs.dataset("/d/p"), Path("/repo/models/tiny"),
                      installed="/opt/mlx-cluster/models/tiny", interactive=False)
    the_plan = training.plan(cluster, request, run_id="r1")
    labels = [label for label, _ in the_plan.steps]
    assert not [label for label in labels if label.startswith("copy the model")]
    assert labels[-2:] == ["verify the model's checksums on node1",
                           "verify the model's checksums on node2"]
    assert "--model /opt/mlx-cluster/models/tiny " in the_plan.launch[-1]


def test_another_model_under_the_provisioned_ones_name_never_replaces_its_copy():
    cluster = installed_layout()
    request = Request(fake_inputs.dataset("/d/p"), fake_inputs.model("/elsewhere/tiny"),
                      interactive=False)
    the_plan = training.plan(cluster, request, run_id="r1")
    copies = [shlex.join(cmd) for label, cmd in the_plan.steps if label.startswith("copy the model")]
    assert copies and all("/opt/mlx-cluster/models/given/tiny/" in cmd for cmd in copies)
    assert not any("/opt/mlx-cluster/models/tiny/" in cmd for cmd in copies)
    assert "--model /opt/mlx-cluster/models/given/tiny " in the_plan.launch[-1]
    # Another name: its own folder, as before.
    other = training.plan(cluster, Request(fake_inputs.dataset("/d/p"),
                                                       fake_inputs.model("/m/other"), interactive=False),
                          run_id="r2")
    assert "--model /opt/mlx-cluster/models/other " in other.launch[-1]


def test_a_node_without_the_installed_model_is_named_with_the_fix():
    with pytest.raises(NotReady, match=r"node2 has no copy of the provisioned model /src/tiny: "
                                       r"run invoke provision --tags model"):
        inputs.installed_model(installed_layout(node2_digest="other"), None)
    assert inputs.installed_model(Cluster.from_json(lab_layout()), None) is None  # none recorded


def test_a_local_model_folder_whose_name_is_not_plain_is_refused_before_any_copy(tmp_path: Path):
    odd = tmp_path / "my model"
    odd.mkdir()
    with pytest.raises(UserError, match=r"cluster_model '.*my model': its name 'my model' cannot be"):
        model_store.ensure(str(odd), linux_trains=True, into=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()
