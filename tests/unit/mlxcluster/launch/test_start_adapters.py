"""mlx-lm's resume_adapter_file on the cluster (mlxcluster/launch/start_adapters.py): the file on the
controller goes to every node, and the ranks start from it at the nodes' path."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from mlxcluster.describe.cluster import Cluster
from mlxcluster.errors import UserError
from tests.unit.mlxcluster.jobs.test_train import lab_layout, plan

CLUSTER = Cluster.from_json(lab_layout())


def test_the_file_a_run_starts_from_goes_to_every_node_and_nothing_beside_it(tmp_path: Path):
    earlier = tmp_path / "runs" / "old"
    earlier.mkdir(parents=True)
    (earlier / "adapters.safetensors").write_bytes(b"\0" * 16)
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
