"""The ranks' own settings rules, run on the controller before anything is sent
(mlxcluster/launch/settings.py): the config file, invoke's flags and --extra alike."""

from __future__ import annotations

import pytest

from mlxcluster.describe.cluster import Cluster
from mlxcluster.launch import settings
from mlxcluster.launch.settings import SettingsError
from tests.unit import fake_inputs
from tests.unit.mlxcluster.jobs.test_train import lab_layout, plan

CLUSTER = Cluster.from_json(lab_layout())  # two ranks


@pytest.mark.parametrize(("config", "says"), [
    ("iters: -5\n", "invalid settings: iters must be at least 1, got -5"),
    ("lora_rank: 0\n", "lora_parameters.rank must be at least 1, got 0"),
    ("fine_tune_type: qlora\n", "fine_tune_type must be one of lora, dora, full, got 'qlora'"),
    ("optimizer_config: {adamw: {weight_decy: 0.1}}\n",
     "optimizer_config.adamw has no setting 'weight_decy'"),
    ("batch_size: 0\n", "batch_size must be at least 1, got 0"),
    ("lora_dropout: 2\n", "lora_parameters.dropout must be in [0, 1), got 2.0"),
    ("max_seq_length: 0\n", "max_seq_length must be at least 2, got 0"),
    ("parallel: pipe\n", "parallel must be one of data, tensor, pipeline, got 'pipe' (did you mean"),
    ("batch_size: 1\n", "a global batch of 1 cannot give each of 2 ranks an example"),
    ("learning_rate: .inf\n", "learning_rate must be a finite number, got inf"),
    ("iters: 100000000000000000000\n", "iters must be an integer of at most 18 digits"),
    ("lora_rnk: 8\n", "unknown key 'lora_rnk' (did you mean 'lora_rank'?)"),
    ("[1, 2]\n", "a config file must hold a mapping"),
    # The constructors keep a setting of the wrong kind, which fails at the first update on every rank.
    ("optimizer_config: {adamw: {weight_decay: heavy}}\n",
     "optimizer_config.adamw.weight_decay must be a finite number, got 'heavy'"),
    ("optimizer: adam\noptimizer_config: {adam: {betas: [0.9]}}\n",
     "optimizer_config.adam.betas must be a list of 2 finite numbers, got list"),
    ("optimizer: sgd\noptimizer_config: {sgd: {nesterov: 1}}\n",
     "optimizer_config.sgd.nesterov must be true or false, got 1"),
    ("optimizer: muon\noptimizer_config: {muon: {ns_steps: 2.5}}\n",
     "optimizer_config.muon.ns_steps must be a whole number, got 2.5"),
    ("test: true\n", "has no test.jsonl to evaluate on: prepare it with a test split"),
])
def test_settings_the_ranks_refuse_are_refused_by_the_plan_in_one_line(config, says):
    file = fake_inputs.config(f"/c/bad-{abs(hash(config))}.yaml", config)
    with pytest.raises(SettingsError) as refused:
        plan(CLUSTER, config=str(file))
    assert says in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(("flags", "says"), [
    (["--iters", "-5"], "iters must be at least 1, got -5"),
    (["--batch-size", "1"], "a global batch of 1 cannot give each of 2 ranks an example"),
    (["--lora-dropout", "2"], "lora_parameters.dropout must be in [0, 1)"),
    (["--fine-tune-type", "full", "--parallel", "tensor"], "fine_tune_type full with parallel tensor"),
    (["--optimizer", "muon", "--parallel", "tensor"], "optimizer muon with parallel tensor: its update"),
    (["--iters", "many"], "argument --iters: invalid int value: 'many'"),
    (["--fine-tune-kind", "dora"],
     "unknown training flag '--fine-tune-kind' (did you mean --fine-tune-type?)"),
    (["--lora-rnk", "8"], "unknown training flag '--lora-rnk' (did you mean --lora-rank?)"),
    (["8"], "a value without its flag '8'"),
    (["--adapter-path", "/etc"], "--adapter-path cannot be given to a run: a run writes into its own folder"),
    (["--adapter", "/etc"], "--adapter-path cannot be given to a run"),  # argparse's abbreviation
    (["--model", "/m"], "--model cannot be given to a run: give the model with invoke train --model"),
    (["--resume"], "--resume cannot be given to a run"),
    (["--expected-world-size", "1"], "--expected-world-size cannot be given"),
    (["--help"], "--help is no training flag"),
])
def test_flags_and_extra_the_ranks_refuse_or_that_name_the_runs_folders_are_refused(flags, says):
    with pytest.raises(SettingsError) as refused:
        plan(CLUSTER, overrides=tuple(flags))
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_extra_is_split_as_a_shell_would_and_an_unclosed_quote_is_refused():
    assert settings.split_extra("--learning-rate 2e-4  --num-layers 4") == [
        "--learning-rate", "2e-4", "--num-layers", "4"]
    with pytest.raises(SettingsError, match=r"--extra '--seed \"1': No closing quotation"):
        settings.split_extra('--seed "1')


def test_the_settings_the_ranks_accept_are_accepted():
    the_plan = plan(CLUSTER, overrides=("--iters", "5", "--lora-dropout", "0.1", "--batch-size", "3"))
    assert the_plan.launch[-1].endswith("--iters 5 --lora-dropout 0.1 --batch-size 3")


def test_a_config_whose_yaml_aliases_nest_is_refused_at_once(tmp_path):
    """A "billion laughs" document (each list nine of the one before): nine levels are 9**9 values
    once expanded, which the controller walked (and printed) for ever before; one that holds itself
    likewise. Both are refused by the plan, in one line."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    laughs = fake_inputs.config(tmp_path / "laughs.yaml", "\n".join([*lines, "model: *a8", ""]))
    itself = fake_inputs.config(tmp_path / "itself.yaml", "model: &m [*m]\n")
    for config in (laughs, itself):
        with pytest.raises(SettingsError) as refused:
            plan(CLUSTER, config=str(config))
        assert "holds more than 100000 values once its YAML aliases (&name, *name) are expanded" \
            in str(refused.value) and "\n" not in str(refused.value)


def test_test_true_with_an_hf_dataset_needs_each_entry_s_test_split(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"text": "ahoy"}\n')
    config = fake_inputs.config(tmp_path / "hf.yaml", f"test: true\nhf_dataset: {{path: {folder}}}\n")
    with pytest.raises(SettingsError, match="test: true, and hf_dataset entry 1 names no test_split"):
        plan(CLUSTER, config=str(config))
    config.write_text(f"test: true\nhf_dataset: {{path: {folder}, test_split: 'train[:1]'}}\n")
    assert plan(CLUSTER, config=str(config)).settings.test
