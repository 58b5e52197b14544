"""mlx-lm's hf_dataset on the cluster (mlxcluster/launch/hf_datasets.py): a local dataset folder goes to
every node, only the files `datasets` reads, and the ranks get the entries with the nodes' paths."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from mlxcluster.describe.cluster import Cluster
from mlxcluster.errors import UserError
from mlxcluster.launch import hf_datasets
from tests.unit.mlxcluster.jobs.test_train import lab_layout, plan
from training.command_line import build_parser, cli_values

CLUSTER = Cluster.from_json(lab_layout())


def dataset_folder(root: Path) -> Path:
    folder = root / "billsum"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "train.jsonl").write_text('{"text": "ahoy", "summary": "a"}\n')
    (folder / "data" / "valid.parquet").write_bytes(b"PAR1")
    (folder / "README.md").write_text("---\nconfigs: []\n---\n")
    (folder / ".ssh").mkdir()
    (folder / ".ssh" / "id_ed25519").write_text("secret")
    (folder / "notes.docx").write_bytes(b"PK")
    (folder / ".cache").mkdir()
    (folder / ".cache" / "token.json").write_text("{}")
    return folder


def test_only_the_files_datasets_reads_go_and_the_ranks_get_the_nodes_paths(tmp_path: Path):
    folder = dataset_folder(tmp_path)
    entry = {"path": str(folder), "train_split": "train[:90%]", "prompt_feature": "text",
             "completion_feature": "summary"}
    config = tmp_path / "lora.yaml"
    config.write_text(yaml.safe_dump({"hf_dataset": entry}))
    the_plan = plan(CLUSTER, config=str(config))
    sent = {label: cmd for label, cmd in the_plan.steps}
    hf_step = shlex.join(sent["sync hf_dataset 0-billsum to node2"])
    for name in ("/README.md", "/data/", "/data/train.jsonl", "/data/valid.parquet"):
        assert f"--include={name}" in hf_step
    assert ".ssh" not in hf_step and "notes.docx" not in hf_step and ".cache" not in hf_step
    assert hf_step.endswith(":/opt/mlx-cluster/work/data/hf/0-billsum/")
    # The data folder, which mlx-lm does not read when hf_dataset is given, sends nothing.
    assert [w for w in sent["sync data to node1"] if w.startswith("--include")] == []
    # The ranks read the same entry, at the nodes' path.
    inner = shlex.split(the_plan.launch[-1])  # bash -c '... python -m training.finetune ...'
    words = inner[inner.index("training.finetune") + 1:]
    given = cli_values(build_parser().parse_known_args(words)[0])["hf_dataset"]
    assert given == [{**entry, "path": "/opt/mlx-cluster/work/data/hf/0-billsum"}]
    # run.json keeps the controller's folder, which a resume sends again (its config.yaml has the nodes').
    assert the_plan.record["hf_dataset"] == [{**entry, "path": str(folder.resolve())}]


def test_a_hub_name_or_a_folder_without_data_files_is_refused_saying_what_to_do(tmp_path: Path):
    with pytest.raises(UserError, match=r"hf_dataset path billsum is not a folder here, and the nodes train "
                                        r"offline: download the dataset into a folder first \(e\.g\. "
                                        r"huggingface-cli download --repo-type dataset billsum"):
        hf_datasets.folders({"path": "billsum"})
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.docx").write_bytes(b"PK")
    with pytest.raises(UserError, match="holds no data file datasets reads"):
        hf_datasets.folders([{"path": str(dataset_folder(tmp_path))}, {"path": str(tmp_path / "empty")}])
    with pytest.raises(UserError, match="every entry needs a path"):
        hf_datasets.folders({"name": "billsum"})
