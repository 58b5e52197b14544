"""mlx-lm's config files and flags, unchanged: every key of `mlx_lm.lora.CONFIG_DEFAULTS`, every flag
of `mlx_lm lora` and every config and command line its LORA.md shows, read from the installed
package at test time, so that a key or flag a newer mlx-lm adds fails here until it is handled."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import mlx_lm
import pytest
import yaml
from mlx_lm import lora

from training import config as tc
from training.command_line import build_parser, cli_values
from training.config_file import load_config_file

LORA_MD = Path(mlx_lm.__file__).parent / "LORA.md"
# mlx-lm's own example config for `mlx_lm lora --config`, verbatim (ml-explore/mlx-lm,
# mlx_lm/examples/lora_config.yaml at commit 09ccfba7fc19, MIT licence): it is not in the wheel.
EXAMPLE = Path(__file__).parent / "mlx_lm_lora_config.yaml"
# Where our defaults differ from mlx-lm's, and why: invoke train exists to train, so `train` needs
# no --train (mlx-lm's default False means "not asked", and it then refuses to run).
DIFFERENT_DEFAULTS = {"train": True}


def merged(values: dict[str, Any], flags: list[str] | None = None) -> tc.FinetuneConfig:
    return tc.merge_config(values, cli_values(build_parser().parse_args(flags or [])))


def test_every_key_of_mlx_lm_s_config_is_a_key_here_with_mlx_lm_s_default():
    ours = tc.FinetuneConfig()
    for key, default in lora.CONFIG_DEFAULTS.items():
        assert key in tc.CONFIG_KEYS, f"mlx-lm's key {key!r} is not handled"
        if key == "optimizer_config":
            # mlx-lm lists every optimizer with no settings; ours is the same mapping.
            assert getattr(ours, key) == default
        else:
            assert getattr(ours, key) == DIFFERENT_DEFAULTS.get(key, default), key


def test_a_config_file_with_every_key_of_mlx_lm_trains_unchanged(tmp_path: Path):
    values = dict(lora.CONFIG_DEFAULTS) | {"train": True}
    (tmp_path / "every.yaml").write_text(yaml.safe_dump(values))
    config = tc.merge_config(load_config_file(tmp_path / "every.yaml"), {}, source="every.yaml")
    assert tc.config_problems(config) == []
    for key, value in values.items():
        assert getattr(config, key) == value, key


def test_mlx_lm_s_own_example_config_trains_unchanged_with_its_commented_blocks_too(tmp_path: Path):
    text = EXAMPLE.read_text()
    config = tc.merge_config(load_config_file(EXAMPLE), {}, source=str(EXAMPLE))
    assert tc.config_problems(config) == []
    assert (config.optimizer, config.learning_rate, config.test_batches) == ("adamw", 1e-5, 100)
    assert config.lora_parameters["keys"] == ["self_attn.q_proj", "self_attn.v_proj"]
    # Its optimizer_config and lr_schedule, uncommented (the hf_dataset block is another example).
    switched_on = re.sub(r"^#( ?)(optimizer_config:|  |lr_schedule:)", r"\2", text.split("#hf_dataset")[0],
                         flags=re.MULTILINE)
    (tmp_path / "on.yaml").write_text(switched_on)
    config = tc.merge_config(load_config_file(tmp_path / "on.yaml"), {})
    assert config.optimizer_config["adamw"] == {"betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.05,
                                                "bias_correction": True}
    assert config.lr_schedule == {"name": "cosine_decay", "warmup": 100, "warmup_init": 1e-7,
                                  "arguments": [1e-5, 1000, 1e-7]}
    assert tc.config_problems(config) == []


def test_numbers_are_read_as_mlx_lm_reads_them(tmp_path: Path):
    text = "learning_rate: 1e-5\nlr_schedule:\n  name: cosine_decay\n  arguments: [1e-5, 1000, 1e-7]\n"
    (tmp_path / "c.yaml").write_text(text)
    ours = load_config_file(tmp_path / "c.yaml")
    assert ours == yaml.load(text, lora.yaml_loader)
    assert ours["lr_schedule"]["arguments"] == [1e-5, 1000, 1e-7]


def _sample(action: Any) -> list[str]:
    """Words that give `action` a value."""
    if action.nargs == 0:
        return [action.option_strings[-1]]
    if action.choices:
        return [action.option_strings[-1], list(action.choices)[-1]]
    size = "2GB" if action.dest == "clear_cache_threshold" else "x"
    value = {int: "3", float: "2e-4"}.get(action.type, size)
    return [action.option_strings[-1], value]


def test_every_flag_of_mlx_lm_lora_means_here_what_it_means_there():
    theirs = lora.build_parser()
    ours = build_parser()
    for action in theirs._actions:
        if action.dest == "help":
            continue
        words = _sample(action)
        expected = getattr(theirs.parse_args(words), action.dest)
        got = ours.parse_args(words)
        value = got.config if action.dest == "config" else cli_values(got)[action.dest]
        assert value == expected, (words, value, expected)
        assert set(action.option_strings) <= {s for a in ours._actions for s in a.option_strings}
    assert ours.parse_args(["-c", "x.yaml"]).config == "x.yaml"


def _yaml_blocks(text: str) -> list[str]:
    return re.findall(r"```yaml\n(.*?)```", text, re.DOTALL)


def _command_lines(text: str) -> list[list[str]]:
    lines = []
    for block in re.findall(r"```shell\n(.*?)```", text, re.DOTALL):
        joined = block.replace("\\\n", " ")
        lines += [shlex.split(line)[1:] for line in joined.splitlines() if line.startswith("mlx_lm.lora ")]
    return lines


def test_the_configs_and_command_lines_lora_md_shows_are_taken():
    text = LORA_MD.read_text()
    blocks = _yaml_blocks(text)
    commands = _command_lines(text)
    assert len(blocks) >= 3 and len(commands) >= 3  # what the pinned mlx-lm's LORA.md shows
    for block in blocks:
        values = yaml.safe_load(block)
        assert tc.config_problems(merged(values)) == [], block
    for words in commands:
        if words == ["--help"]:
            continue
        words = [w.replace("<", "").replace(">", "") for w in words]
        assert tc.config_problems(merged({}, words)) == [], words


def test_an_unknown_key_is_refused_naming_the_nearest_known_one():
    with pytest.raises(tc.ConfigError,
                       match=r"unknown key 'fine_tune_typ' \(did you mean 'fine_tune_type'\?\)"):
        tc.merge_config({"fine_tune_typ": "dora"}, {}, source="my.yaml")
    with pytest.raises(tc.ConfigError, match="optimizer_config has no optimizer 'adamx' "
                                             r"\(did you mean 'adam'\?\)"):
        tc.merge_config({"optimizer_config": {"adamx": {}}}, {})
    with pytest.raises(tc.ConfigError, match="lora_parameters has no key 'alpha'"):
        tc.merge_config({"lora_parameters": {"rank": 8, "alpha": 16}}, {})


def test_settings_mlx_lm_would_fail_on_are_named_before_anything_loads():
    problems = tc.config_problems(tc.FinetuneConfig(
        fine_tune_type="qlora", optimizer="adamw", optimizer_config={"adamw": {"weight_decy": 0.1}},
        lr_schedule={"name": "cosine", "arguments": [1e-5, 100]}, report_to="wandb,tensorboard",
        grad_accumulation_steps=0, test_batches=0, train=False,
    ))
    said = "\n".join(problems)
    for expected in ("fine_tune_type must be one of lora, dora, full, got 'qlora'",
                     "optimizer_config.adamw has no setting 'weight_decy'; adamw takes betas, eps, "
                     "weight_decay, bias_correction",
                     "lr_schedule.name must be one of cosine_decay",
                     "report_to must be one of wandb, swanlab, got 'tensorboard'",
                     "grad_accumulation_steps must be at least 1",
                     "test_batches must be -1 (all) or at least 1",
                     "train: false asks for no training"):
        assert expected in said
    broken = tc.FinetuneConfig(lr_schedule={"name": "cosine_decay", "arguments": ["fast"]})
    problems = tc.config_problems(broken)
    assert any(p.startswith("lr_schedule: cosine_decay('fast',) cannot be built") for p in problems)


def test_the_older_names_give_mlx_lm_s_settings_and_are_said_once():
    older = {"lora_rank": 16, "lora_scale": 10.0, "lora_dropout": 0.1, "lr_schedule": "cosine",
             "warmup_steps": 10, "learning_rate": 1e-3, "iters": 110}
    newer = {"lora_parameters": {"rank": 16, "scale": 10.0, "dropout": 0.1}, "learning_rate": 1e-3,
             "iters": 110, "lr_schedule": {"name": "cosine_decay", "arguments": [1e-3, 100, 0.0],
                                           "warmup": 10, "warmup_init": 0.0}}
    assert tc.merge_config(older, {}) == tc.merge_config(newer, {})
    notes = tc.older_names_said(older, {})
    assert len(notes) == 5 and all("older" in note for note in notes)
    assert tc.older_names_said(newer, {}) == []
    # A flag of the older kind wins over the file's newer value, key by key.
    config = merged({"lora_parameters": {"rank": 4, "scale": 5.0}}, ["--lora-rank", "32"])
    assert config.lora_parameters == {"rank": 32, "scale": 5.0, "dropout": 0.0}
    with pytest.raises(tc.ConfigError, match=r"lora_rank and lora_parameters\.rank are the same setting"):
        tc.merge_config({"lora_rank": 4, "lora_parameters": {"rank": 8}}, {})
