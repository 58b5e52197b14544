"""mlx-lm's hf_dataset on the cluster (mlxcluster/launch/hf_datasets.py): a local dataset folder goes to
every node, only the files `datasets` itself resolves for the entry (and the dataset card), sent by
real rsync to a local node and loaded there as on the controller; keys beside the splits, files named
outside the folder, and folders as broad as / or a home are refused, and datasets' own errors come
back as one line with the fix. The ranks get the entries with the nodes' paths."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import datasets
import pytest
import yaml

from mlxcluster.describe.cluster import Cluster
from mlxcluster.errors import UserError
from mlxcluster.launch import hf_datasets
from tests.unit.mlxcluster.jobs.test_train import lab_layout, plan
from tests.unit.mlxcluster.launch.test_shipment import landed
from training.command_line import build_parser, cli_values

CLUSTER = Cluster.from_json(lab_layout())
# What a data folder may hold beside its splits, none of which datasets reads.
KEYS = ("secrets/service-account.json", "keys/key.json", "notes.txt")
ROWS = '{"text": "ahoy", "summary": "a"}\n{"text": "avast", "summary": "b"}\n'


def dataset_folder(root: Path) -> Path:
    folder = root / "billsum"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "train.jsonl").write_text('{"text": "ahoy", "summary": "a"}\n')
    (folder / "data" / "valid.jsonl").write_text('{"text": "avast", "summary": "b"}\n')
    (folder / "README.md").write_text("---\nconfigs: []\n---\n")
    (folder / ".ssh").mkdir()
    (folder / ".ssh" / "id_ed25519").write_text("secret")
    (folder / "notes.docx").write_bytes(b"PK")
    (folder / ".cache").mkdir()
    (folder / ".cache" / "token.json").write_text("{}")
    return folder


def with_keys(folder: Path, *files: str) -> Path:
    """`folder` with `files` of rows (made as their suffix says) and KEYS beside them."""
    for name in (*files, *KEYS):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".parquet"):
            datasets.Dataset.from_dict({"text": [name, "ahoy"]}).to_parquet(folder / name)
        else:
            (folder / name).write_text(ROWS if name in files else '{"private_key": "SECRET"}\n')
    return folder


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """load_dataset as a node runs it: offline, with a cache of the test's own."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    datasets.disable_progress_bars()

    def rows(folder: Path, split: str = "train", **config) -> list[dict]:
        return datasets.load_dataset(str(folder), split=split, cache_dir=str(tmp_path / "hf-cache"),
                                     **config).to_list()
    yield rows
    datasets.enable_progress_bars()


def test_only_the_files_datasets_reads_go_and_the_ranks_get_the_nodes_paths(tmp_path: Path):
    folder = dataset_folder(tmp_path)
    entry = {"path": str(folder), "train_split": "train[:90%]", "prompt_feature": "text",
             "completion_feature": "summary"}
    config = tmp_path / "lora.yaml"
    config.write_text(yaml.safe_dump({"hf_dataset": entry}))
    the_plan = plan(CLUSTER, config=str(config))
    sent = {label: cmd for label, cmd in the_plan.steps}
    hf_step = shlex.join(sent["sync hf_dataset 0-billsum to node2"])
    for name in ("/README.md", "/data/", "/data/train.jsonl", "/data/valid.jsonl"):
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


def test_keys_and_notes_beside_the_splits_stay_behind_and_the_copy_loads_as_the_original(
        tmp_path: Path, offline):
    folder = with_keys(tmp_path / "pirate", "train.jsonl", "valid.jsonl")
    config = tmp_path / "lora.yaml"
    config.write_text(yaml.safe_dump({"hf_dataset": {"path": str(folder)}}))
    sent = dict(plan(CLUSTER, config=str(config)).steps)
    hf_step = sent["sync hf_dataset 0-pirate to node2"]
    assert [w for w in hf_step if w.startswith(("--include", "--exclude"))] == [
        "--include=/train.jsonl", "--include=/valid.jsonl", "--exclude=*"]
    assert not any(Path(name).name in shlex.join(hf_step) for name in KEYS)
    [shipped] = hf_datasets.folders({"path": str(folder)})
    assert landed(tmp_path, shipped.shipment) == ["train.jsonl", "valid.jsonl"]
    # What stayed behind was not needed: the copy loads the same rows, offline.
    copy = tmp_path / "node" / "dest"
    assert offline(copy) == offline(folder) == [{"text": "ahoy", "summary": "a"},
                                                {"text": "avast", "summary": "b"}]
    assert offline(copy, "validation") == offline(folder, "validation")


def test_a_parquet_layout_sends_its_shards_and_card_and_nothing_else(tmp_path: Path, offline):
    shards = ("data/train-00000-of-00001.parquet", "data/test-00000-of-00001.parquet")
    folder = with_keys(tmp_path / "billsum", *shards)
    (folder / "README.md").write_text("# billsum\n")  # a card without YAML: its files by their names
    [shipped] = hf_datasets.folders([{"path": str(folder)}])
    assert landed(tmp_path, shipped.shipment) == ["README.md", *sorted(shards)]
    copy = tmp_path / "node" / "dest"
    assert offline(copy) == offline(folder) == [{"text": shards[0]}, {"text": "ahoy"}]
    assert offline(copy, "test") == offline(folder, "test")


def test_the_files_the_config_or_the_cards_configs_name_go_and_no_others(tmp_path: Path, offline):
    folder = with_keys(tmp_path / "mixed", "train.jsonl", "mine.jsonl", "sub/other.jsonl")
    entry = {"path": str(folder), "config": {"data_files": {"train": "mine.jsonl"}}}
    [shipped] = hf_datasets.folders(entry)
    assert landed(tmp_path, shipped.shipment) == ["mine.jsonl"]
    assert offline(tmp_path / "node" / "dest", **entry["config"]) == offline(folder, **entry["config"])
    (folder / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files: mine.jsonl\n"
                                      "- config_name: other\n  data_files: sub/other.jsonl\n---\n")
    assert hf_datasets.folder(0, {"path": str(folder)}).shipment.files == ("mine.jsonl", "README.md")
    chosen = hf_datasets.folder(0, {"path": str(folder), "config": {"name": "other"}})
    assert chosen.shipment.files == ("sub/other.jsonl", "README.md")


def test_the_root_or_a_home_folder_is_refused_before_anything_looks_into_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def never(*args):
        raise AssertionError("the folder was looked into")
    monkeypatch.setattr(hf_datasets, "_files_of", never)
    home = tmp_path / "home" / "me"
    home.mkdir(parents=True)
    monkeypatch.setattr(Path, "home", lambda: home)
    monkeypatch.setenv("HOME", str(home))
    for given, kind in (("/", "the root folder"), ("~", "a home folder"), (str(home), "a home folder"),
                        (str(home.parent), "a folder holding home folders")):
        with pytest.raises(UserError, match=rf"^hf_dataset path {given}: .* is {kind}, which is never sent "
                                            r"to the nodes: give the folder of the job's own files"):
            hf_datasets.folders({"path": given})
    with pytest.raises(UserError, match=r"^hf_dataset entry 2 path /: / is the root folder"):
        hf_datasets.folder(1, {"path": "/"})


def test_a_data_file_named_outside_the_folder_is_refused_saying_to_put_it_inside(tmp_path: Path):
    folder = with_keys(tmp_path / "pirate", "train.jsonl")
    (tmp_path / "elsewhere.jsonl").write_text(ROWS)
    inside = r"is not inside the folder, .*: put the file inside the folder and name it relative to it"
    for named in (str(tmp_path / "elsewhere.jsonl"), "../elsewhere.jsonl", str(folder / "train.jsonl"),
                  "~/train.jsonl", "hf://datasets/someone/pirate/train.jsonl"):
        with pytest.raises(UserError, match=rf"^hf_dataset path .*pirate: the data file .* {inside}"):
            hf_datasets.folders({"path": str(folder), "config": {"data_files": {"train": [named]}}})
    with pytest.raises(UserError, match=inside):
        hf_datasets.folders({"path": str(folder), "config": {"data_dir": "../"}})
    (folder / "README.md").write_text("---\nconfigs:\n- config_name: default\n"
                                      "  data_files: ../elsewhere.jsonl\n---\n")
    with pytest.raises(UserError, match=rf"the data file .*elsewhere\.jsonl {inside}"):
        hf_datasets.folders({"path": str(folder)})
    (folder / "README.md").unlink()
    (folder / "valid.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    with pytest.raises(UserError, match=r"valid\.jsonl leads out of the folder .*copy the file into it"):
        hf_datasets.folders({"path": str(folder)})


def test_a_credential_datasets_would_read_as_data_is_refused_never_sent(tmp_path: Path):
    # No split names here: datasets reads every .json and .jsonl, the key among them.
    folder = with_keys(tmp_path / "pirate", "mine.jsonl")
    with pytest.raises(UserError, match=r"datasets would read secrets/service-account\.json as data, and it "
                                        r"is named as credentials are, which are never sent: move it out"):
        hf_datasets.folders({"path": str(folder)})
    # Named in the config, the data files alone go.
    entry = {"path": str(folder), "config": {"data_files": "mine.jsonl"}}
    assert hf_datasets.folder(0, entry).shipment.files == ("mine.jsonl",)


def test_what_datasets_cannot_load_is_refused_in_one_line_naming_the_entry_and_the_fix(tmp_path: Path):
    folder = with_keys(tmp_path / "pirate", "train.jsonl")
    (folder / "README.md").write_text("---\nconfigs: [: bad\n---\n")
    failures = [(0, {"path": str(folder)}, r"^hf_dataset path .*pirate: the YAML header of its README\.md "
                                        r"cannot be read \(.*\): fix it, or delete the header$")]
    (tmp_path / "cards").mkdir()
    (tmp_path / "cards" / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files: "
                                                  "train.jsonl\n---\n")
    (tmp_path / "cards" / "train.jsonl").write_text(ROWS)
    failures += [
        (1, {"path": str(tmp_path / "cards"), "config": {"name": "nope"}},
         r"^hf_dataset entry 2 path .*cards: datasets cannot load it as the nodes would \(ValueError: "
         r"BuilderConfig 'nope' not found\. Available: \['default'\]\): fix the entry's config or the "
         r"folder's README\.md$"),
        (0, {"path": str(tmp_path / "cards"), "config": {"data_files": "missing.jsonl"}},
         r"\(FileNotFoundError: Unable to find .*missing\.jsonl.*\): fix the entry's config"),
        (0, {"path": str(tmp_path / "cards"), "config": "default"}, r"its config must be a mapping")]
    for index, entry, message in failures:
        with pytest.raises(UserError, match=message) as refused:
            hf_datasets.folder(index, entry)
        assert "\n" not in str(refused.value) and len(str(refused.value)) < 600
    (folder / "README.md").unlink()
    (folder / ".huggingface.yaml").write_text("configs: []\n")
    with pytest.raises(UserError, match=r"its \.huggingface\.yaml shapes what datasets reads, but a hidden "
                                        r"file is never sent: move its YAML into the header of README\.md"):
        hf_datasets.folders({"path": str(folder)})


def test_the_files_are_resolved_by_name_offline_and_the_process_is_left_online(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    folder = tmp_path / "billsum"
    (folder / "data").mkdir(parents=True)
    # Not data at all: a resolver that read a row or a schema would fail on them.
    for name in ("data/train-00000-of-00001.parquet", "data/validation-00000-of-00001.parquet"):
        (folder / name).write_bytes(b"PAR1 not parquet")
    seen = []
    resolve = datasets.load_dataset_builder

    def watched(*args, **kwargs):
        seen.append((datasets.config.HF_HUB_OFFLINE, os.environ.get("HF_HUB_OFFLINE"),
                     os.environ.get("HF_DATASETS_OFFLINE"), kwargs["cache_dir"]))
        return resolve(*args, **kwargs)
    monkeypatch.setattr(datasets, "load_dataset_builder", watched)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    assert hf_datasets.folder(0, {"path": str(folder)}).shipment.files == (
        "data/train-00000-of-00001.parquet", "data/validation-00000-of-00001.parquet")
    [(offline_then, hub_env, datasets_env, cache)] = seen
    assert (offline_then, hub_env, datasets_env) == (True, "1", "1")
    assert not Path(cache).exists()  # a throwaway cache, not the user's
    assert datasets.config.HF_HUB_OFFLINE is False and "HF_HUB_OFFLINE" not in os.environ


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
