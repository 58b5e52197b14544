"""mlx-lm's resume_adapter_file on the cluster (mlxcluster/launch/start_adapters.py): the file on the
controller goes to every node, and the ranks start from it at the nodes' path."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import save_file

from mlxcluster.describe.cluster import Cluster
from mlxcluster.errors import UserError
from tests.unit.mlxcluster.jobs.test_train import lab_layout, plan

CLUSTER = Cluster.from_json(lab_layout())


def adapters_file(path: Path, tensors: int = 1) -> Path:
    """An adapters file as a LoRA run leaves it: safetensors with a layer's lora_a and lora_b."""
    path.parent.mkdir(parents=True, exist_ok=True)
    names = [f"model.layers.{i // 2}.self_attn.q_proj.lora_{'ab'[i % 2]}" for i in range(tensors)]
    save_file({name: np.zeros((4, 2), np.float32) for name in names}, str(path))
    return path


def refused_start(file: Path, *, through_extra: bool = False, tmp_path: Path) -> str:
    """The message a plan that starts from `file` is refused with (as the config's key or --extra)."""
    config = tmp_path / "lora.yaml"
    config.write_text(yaml.safe_dump({} if through_extra else {"resume_adapter_file": str(file)}))
    extra = ("--resume-adapter-file", str(file)) if through_extra else ()
    with pytest.raises(UserError) as refused:
        plan(CLUSTER, config=str(config), overrides=extra)
    return str(refused.value)


def test_the_file_a_run_starts_from_goes_to_every_node_and_nothing_beside_it(tmp_path: Path):
    earlier = tmp_path / "runs" / "old"
    earlier.mkdir(parents=True)
    adapters_file(earlier / "adapters.safetensors", tensors=4)
    (earlier / "secret.txt").write_text("no")
    config = tmp_path / "lora.yaml"
    config.write_text(yaml.safe_dump({"resume_adapter_file": str(earlier / "adapters.safetensors")}))
    the_plan = plan(CLUSTER, config=str(config))
    sent = dict(the_plan.steps)
    for node in ("node1", "node2"):
        step = shlex.join(sent[f"sync resume_adapter_file to {node}"])
        assert "--include=/adapters.safetensors" in step and "secret" not in step
        assert step.endswith(":/opt/mlx-cluster/work/start/r1/")
    inner = shlex.split(the_plan.launch[-1])
    words = inner[inner.index("training.finetune") + 1:]
    assert words[-2:] == ["--resume-adapter-file", "/opt/mlx-cluster/work/start/r1/adapters.safetensors"]
    assert the_plan.record["resume_adapter_file"] == str((earlier / "adapters.safetensors").resolve())


def test_a_file_that_is_not_here_is_refused_before_anything_is_sent(tmp_path: Path):
    config = tmp_path / "lora.yaml"
    config.write_text(yaml.safe_dump({"resume_adapter_file": "adapters/adapters.safetensors"}))
    with pytest.raises(UserError,
                       match=r"resume_adapter_file adapters/adapters\.safetensors: no such file here"):
        plan(CLUSTER, config=str(config))


@pytest.mark.parametrize("through_extra", [False, True], ids=["config", "extra"])
def test_a_file_that_is_not_an_adapters_file_is_never_planned_for_the_nodes(tmp_path: Path, monkeypatch,
                                                                             through_extra: bool):
    """Issue 50's probes: a private key, /etc/passwd, a file named as adapters that is not one, and
    an adapters file on a hidden path are each refused by the plan, as the key or through --extra."""
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    key = home / ".ssh" / "id_ed25519"
    key.parent.mkdir(parents=True)
    key.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n")
    fake = home / "runs" / "old" / "adapters.safetensors"
    fake.parent.mkdir(parents=True)
    fake.write_bytes(key.read_bytes())
    empty = home / "runs" / "empty" / "adapters.safetensors"
    empty.parent.mkdir(parents=True)
    save_file({}, str(empty))
    hidden = adapters_file(home / ".cache" / "adapters.safetensors")
    expected = {key: "hidden or secret file", Path("/etc/passwd"): r"not a \.safetensors file",
                fake: "not a safetensors file", empty: "no tensor in it", hidden: "hidden or secret file"}
    for file, why in expected.items():
        message = refused_start(file, through_extra=through_extra, tmp_path=tmp_path)
        assert message.startswith(f"resume_adapter_file {file}: ") and re.search(why, message)
        assert "give the adapters.safetensors a run left" in message
    # ~ in the setting is the home folder: the key is refused by that name too.
    assert "hidden or secret file" in refused_start(Path("~/.ssh/id_ed25519"), through_extra=through_extra,
                                                    tmp_path=tmp_path)


def test_a_checkpoint_s_adapters_file_is_one_to_start_from(tmp_path: Path):
    step = tmp_path / "runs" / "old" / "checkpoints" / "0000010"
    checkpoint = adapters_file(step / "adapters.safetensors", tensors=2)
    config = tmp_path / "lora.yaml"
    config.write_text(yaml.safe_dump({"resume_adapter_file": str(checkpoint)}))
    steps = dict(plan(CLUSTER, config=str(config)).steps)
    assert "--include=/adapters.safetensors" in shlex.join(steps["sync resume_adapter_file to node2"])
