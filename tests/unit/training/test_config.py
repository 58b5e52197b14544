"""training.config: defaults, the config file and the flags over them, the checks, mlx-lm's names."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from mlx_lm.tuner.utils import build_schedule

from training import config as tc
from training.command_line import build_parser, cli_values
from training.config_file import load_config_file

# The demo's model and data (invoke train's defaults), mlx-lm's data keys the demo has no use for,
# and the settings file's own name.
NOT_IN_THE_DEMO = {"model", "data", "config", "training_mode", "hf_dataset", "prompt_feature",
                   "completion_feature", "chat_feature", "text_feature"}


def test_shipped_lora_yaml_gives_every_key_a_comment_and_trains_as_it_is():
    text = tc.DEFAULT_CONFIG.read_text()
    values = load_config_file(tc.DEFAULT_CONFIG)
    assert set(values) == set(tc.CONFIG_KEYS) - NOT_IN_THE_DEMO
    assert tc.config_problems(tc.merge_config(values, {})) == []
    lines = text.splitlines()
    for number, line in enumerate(lines):
        if line and not line.startswith(("#", " ")):
            assert lines[number - 1].startswith("#"), f"{line.split(':')[0]} has no comment above it"


def test_command_line_wins_over_the_file_which_wins_over_the_defaults():
    args = build_parser().parse_args(["--iters", "7", "--grad-checkpoint", "--learning-rate", "3e-4"])
    config = tc.merge_config({"iters": 50, "batch_size": 8, "grad_checkpoint": False}, cli_values(args))

    assert (config.iters, config.batch_size, config.grad_checkpoint) == (7, 8, True)
    assert config.learning_rate == 3e-4
    assert config.lora_parameters == tc.FinetuneConfig().lora_parameters
    assert cli_values(build_parser().parse_args([])) == {}
    assert cli_values(build_parser().parse_args(["--no-mask-prompt"])) == {"mask_prompt": False}


def test_unknown_key_in_the_file_is_an_error_naming_it():
    with pytest.raises(
        tc.ConfigError, match=r"lora.yaml: unknown key 'lora_rnk' \(did you mean 'lora_rank'\?\)"
    ):
        tc.merge_config({"lora_rnk": 4, "iters": 3}, {}, source="lora.yaml")


def test_values_are_checked_against_their_types():
    # PyYAML reads 1e-5 without a dot as a string; a learning rate may still be written so.
    assert tc.merge_config(yaml.safe_load("learning_rate: 1e-5"), {}).learning_rate == 1e-5
    assert tc.merge_config({"resume_adapter_file": None}, {}).resume_adapter_file is None
    with pytest.raises(tc.ConfigError, match=r"my\.yaml: iters must be an integer of at most 18 digits, "
                                             r"got 'ten'"):
        tc.merge_config({"iters": "ten"}, {}, source="my.yaml")
    with pytest.raises(tc.ConfigError, match="grad_checkpoint must be true or false, got 'yes please'"):
        tc.merge_config({"grad_checkpoint": "yes please"}, {})
    with pytest.raises(tc.ConfigError, match="batch_size must be an integer of at most 18 digits, got True"):
        tc.merge_config({"batch_size": True}, {})
    # Sizes no run can use, and numbers that are none, are refused in one line too.
    with pytest.raises(tc.ConfigError, match="iters must be an integer of at most 18 digits, got an integer "
                                             "of more than 4300 digits"):
        tc.merge_config({"iters": 10**5000}, {})
    for value in ("inf", float("nan"), 1e400, "-Infinity"):
        with pytest.raises(tc.ConfigError, match="learning_rate must be a finite number"):
            tc.merge_config({"learning_rate": value}, {})


def test_the_global_batch_is_shared_as_equally_as_can_be_or_as_batch_shares_says():
    config = tc.FinetuneConfig(batch_size=6)
    assert tc.batch_plan(config, 3) == tc.BatchPlan([2, 2, 2], [0, 0, 0], 1)
    assert tc.batch_plan(config, 4).shares == [2, 2, 1, 1]  # no longer needs to divide
    with pytest.raises(tc.ConfigError, match="a global batch of 6 cannot give each of 7 ranks an example"):
        tc.validate_config(config, world_size=7)
    shared = tc.FinetuneConfig(batch_size=8, batch_shares="6,2", max_micro_batch="4,0")
    assert tc.batch_plan(shared, 2) == tc.BatchPlan([6, 2], [4, 0], 2)
    for shares, message in (("5,2", "must give every rank at least 1 example and sum to batch_size 8 "
                                    r"\(they sum to 7\)"),
                            ("8,0", "at least 1 example"),
                            ("4,2,2", "gives 3 ranks a value, but the run has 2")):
        with pytest.raises(tc.ConfigError, match=message):
            tc.validate_config(dataclasses.replace(shared, batch_shares=shares), world_size=2)
    # YAML reads `max_micro_batch: 2` as a number.
    assert tc.merge_config({"max_micro_batch": 2}, {}).max_micro_batch == "2"


def test_dequantize_ranks_come_as_a_flag_or_a_yaml_list_and_name_ranks_of_the_run():
    from_flag = tc.merge_config({}, cli_values(build_parser().parse_args(["--dequantize-ranks", "0,2"])))
    assert from_flag.dequantize_ranks == "0,2" and tc.config_problems(from_flag, 3) == []
    assert tc.merge_config({"dequantize_ranks": [2, 0]}, {}).dequantize_ranks == "2,0"
    assert tc.merge_config({"dequantize_ranks": 1}, {}).dequantize_ranks == "1"
    assert tc.config_problems(from_flag, 2) == [
        "dequantize_ranks 0,2: rank 2 is beyond the 2 ranks of this run (ranks 0 to 1)"]
    with pytest.raises(tc.ConfigError, match="dequantize_ranks must be an integer"):
        tc.merge_config({"dequantize_ranks": ["one"]}, {})


def test_every_problem_is_reported_at_once():
    config = tc.merge_config({"iters": 10, "lora_dropout": 1.0, "lr_schedule": "linear", "num_layers": 0,
                              "learning_rate": 0, "save_every_minutes": -1}, {})
    problems = tc.config_problems(config)
    assert [p.split()[0] for p in problems] == [
        "num_layers",
        "save_every_minutes",
        "learning_rate",
        "lora_parameters.dropout",
        "lr_schedule",
    ]
    assert tc.config_problems(tc.FinetuneConfig()) == []


def schedule(values: dict) -> object:
    return build_schedule(tc.merge_config(values, {}).lr_schedule)


def test_the_older_learning_rate_schedules_are_mlx_lm_s_schedules():
    assert tc.merge_config({"learning_rate": 1e-3, "lr_schedule": "none"}, {}).lr_schedule is None

    cosine = schedule({"learning_rate": 1e-3, "lr_schedule": "cosine", "iters": 110, "warmup_steps": 10})
    assert cosine(0).item() == 0
    assert cosine(10).item() == pytest.approx(1e-3)
    assert cosine(60).item() == pytest.approx(5e-4, rel=0.05)
    assert cosine(110).item() < 1e-3 / 1000

    warm_then_constant = schedule({"learning_rate": 1e-3, "warmup_steps": 4})
    assert [round(warm_then_constant(step).item(), 6) for step in (0, 2, 4, 50)] == [0, 5e-4, 1e-3, 1e-3]
    # warmup_steps over a schedule given as mlx-lm's mapping adds its warmup.
    given = {"name": "cosine_decay", "arguments": [1e-3, 100]}
    assert tc.merge_config({"lr_schedule": given}, {"warmup_steps": 5}).lr_schedule == {
        **given, "warmup": 5, "warmup_init": 0.0}
