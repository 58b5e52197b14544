"""The settings of a fine-tuning run: mlx-lm's LoRA config keys, this project's beside them.

`FinetuneConfig` holds every key of `mlx_lm lora`'s config file, with mlx-lm's defaults and meanings
(tests/unit/training/test_mlx_lm_config.py reads `mlx_lm.lora.CONFIG_DEFAULTS` and LORA.md from the
installed package and checks every key against them), then this project's own keys for the
cluster (`parallel`, `batch_shares`, `max_micro_batch`, `dequantize_ranks`, `stall_timeout`,
`save_rank_weights`).
`merge_config` layers a file's values and the flags' values over the defaults, checking each against
its type, and reads this project's older key names (training/older_keys.py); `config_problems` says
everything wrong with the result at once, for the world size the run has. `adapter_config` is
adapter_config.json as `mlx_lm lora` writes it, so that mlx-lm's own tools load what a run leaves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import re
import reprlib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from training import older_keys
from training.config_file import ConfigError
from training.data import shares
from training.model import quantization
from training.parallel_rules import pipeline_problems, pipeline_replicas, tensor_problems

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "lora.yaml"
FINE_TUNE_TYPES = ("lora", "dora", "full")
OPTIMIZERS = ("adam", "adamw", "muon", "sgd", "adafactor")
REPORTERS = ("wandb", "swanlab")
PARALLEL_MODES = ("data", "tensor", "pipeline")
LORA_PARAMETERS = {"rank": 8, "dropout": 0.0, "scale": 20.0}
# Integers beyond this are no step count, seed or size a run can use (and some cannot be printed).
LARGEST_INT = 10**18





def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class FinetuneConfig:
    # --- mlx-lm's keys, its defaults (mlx_lm.lora.CONFIG_DEFAULTS) -------------------------------
    model: str = field(default="Qwen/Qwen3-0.6b", metadata=_help("mlx-lm model folder or Hugging Face id"))
    train: bool = field(default=True, metadata=_help("train (invoke train always does)"))
    fine_tune_type: str = field(default="lora", metadata=_help(f"one of {', '.join(FINE_TUNE_TYPES)}"))
    optimizer: str = field(default="adam", metadata=_help(f"one of {', '.join(OPTIMIZERS)}"))
    optimizer_config: dict[str, Any] = field(
        default_factory=lambda: {name: {} for name in OPTIMIZERS},
        metadata=_help("each optimizer's settings, e.g. {adamw: {weight_decay: 0.01}} (YAML)"))
    data: str = field(default="mlx-community/WikiSQL",
                      metadata=_help("folder with train.jsonl, valid.jsonl and test.jsonl"))
    seed: int = field(default=0, metadata=_help("seed of the initialisation, dropout and batch order"))
    num_layers: int = field(default=16, metadata=_help("last layers to fine-tune; -1 for all"))
    batch_size: int = field(default=4, metadata=_help("GLOBAL batch: examples per iteration over all ranks"))
    iters: int = field(default=1000, metadata=_help("iterations (batches) to train for"))
    val_batches: int = field(default=25, metadata=_help("batches per validation; -1 for all"))
    learning_rate: float = field(default=1e-5, metadata=_help("the rate, when lr_schedule gives none"))
    steps_per_report: int = field(default=10, metadata=_help("iterations between train loss reports"))
    steps_per_eval: int = field(default=200, metadata=_help("iterations between validations"))
    resume_adapter_file: str | None = field(default=None,
                                            metadata=_help("adapters.safetensors to start a new run from"))
    adapter_path: str = field(default="adapters", metadata=_help("output folder of rank 0"))
    save_every: int = field(default=100, metadata=_help("iterations between checkpoints"))
    test: bool = field(default=False, metadata=_help("evaluate on test.jsonl after training"))
    test_batches: int = field(default=500, metadata=_help("test batches; -1 for all"))
    max_seq_length: int = field(default=2048, metadata=_help("longer examples are truncated"))
    config: str | None = field(default=None, metadata=_help("(the settings file; read as --config)"))
    grad_checkpoint: bool = field(default=False, metadata=_help("recompute activations to save memory"))
    grad_accumulation_steps: int = field(default=1,
                                         metadata=_help("iterations whose gradients make one update"))
    clear_cache_threshold: int = field(default=0,
                                       metadata=_help("clear MLX's cache above this size (bytes, or 2GB)"))
    lr_schedule: dict[str, Any] | None = field(
        default=None, metadata=_help("{name, arguments, warmup, warmup_init} (YAML); none: constant"))
    lora_parameters: dict[str, Any] = field(
        default_factory=lambda: dict(LORA_PARAMETERS),
        metadata=_help("{rank, scale, dropout, keys} of the LoRA and DoRA layers (YAML)"))
    mask_prompt: bool = field(default=False, metadata=_help("learn only the completion / last reply"))
    report_to: str | None = field(default=None, metadata=_help("wandb, swanlab or wandb,swanlab"))
    project_name: str | None = field(default=None, metadata=_help("the project name report_to logs under"))
    trust_remote_code: bool = field(default=False, metadata=_help("let the tokenizer run the model's code"))
    # mlx-lm's example config's training_mode: normal is the one mode the pinned mlx-lm has.
    training_mode: str = field(default="normal", metadata=_help("normal (the one mode of mlx-lm 0.32)"))
    # mlx-lm's data keys (LORA.md), read by its dataset loaders.
    hf_dataset: Any = field(default=None, metadata=_help("Hugging Face dataset(s) to train on (YAML)"))
    prompt_feature: str = field(default="prompt", metadata=_help("completions data: the prompt's key"))
    completion_feature: str = field(default="completion",
                                    metadata=_help("completions data: the completion's key"))
    chat_feature: str = field(default="messages", metadata=_help("chat data: the messages' key"))
    text_feature: str = field(default="text", metadata=_help("text data: the text's key"))
    # --- this project's keys, for the cluster ----------------------------------------------------
    parallel: str = field(
        default="data",
        metadata=_help("data: every rank holds the whole model and trains on its share of each batch; "
                       "tensor: every rank holds a shard of the model and all train on the whole batch; "
                       "pipeline: every rank holds a run of whole layers, the batch goes through them in "
                       "micro-batches"))
    pipeline_layers: str | None = field(
        default=None,
        metadata=_help("parallel pipeline: the layers each rank holds, in rank order, adding up to the "
                       "model's (e.g. 10,14,6); none: as equal as can be"))
    pipeline_stages: int = field(
        default=0,
        metadata=_help("parallel pipeline: the stages the layers are cut into; the ranks make replicas of "
                       "them (ranks / stages, each a run of consecutive ranks) that split each batch as "
                       "data parallelism does (batch_shares: one per replica); 0: one stage per rank, or "
                       "one per pipeline_layers entry"))
    pipeline_micro_batches: int = field(
        default=0,
        metadata=_help("parallel pipeline: micro-batches each batch goes through the stages in (at most "
                       "batch_size); 0: twice the stages, or batch_size if fewer"))
    batch_shares: str | None = field(
        default=None,
        metadata=_help("examples of each global batch per rank, in rank order, summing to batch_size "
                       "(e.g. 3,1); none: as equal as can be"))
    max_micro_batch: str | None = field(
        default=None,
        metadata=_help("most examples a rank runs at once (one per rank, or one for all; 0: no limit): "
                       "a larger share runs as micro-batches, gradients accumulated"))
    dequantize_ranks: str | None = field(
        default=None,
        metadata=_help("ranks that dequantize a quantized model as they load it (e.g. 0,2; from the "
                       "inventory's model_dequantize); none: every rank trains on its quantized weights"))
    stall_timeout: int = field(
        default=30,
        metadata=_help("seconds without progress after which a rank stops (a node or link is gone); "
                       "under invoke train, which reads every rank's beats, the run is stopped "
                       "min(this, 15) s past its slowest step, and the ranks' own stop is 30 s later"))
    save_rank_weights: bool = field(
        default=False, metadata=_help("every rank also writes the weights all ranks hold alike, to compare"))
    save_every_minutes: float = field(
        default=0.0,
        metadata=_help("also a checkpoint at the first report after this many minutes since the last "
                       "(0: by save_every alone): a lost node then costs at most that much work"))


CONFIG_KEYS = tuple(f.name for f in dataclasses.fields(FinetuneConfig))
PROJECT_KEYS = ("parallel", "pipeline_layers", "pipeline_stages", "pipeline_micro_batches", "batch_shares",
                "max_micro_batch", "dequantize_ranks", "stall_timeout",
                "save_rank_weights", "save_every_minutes")
KEY_TYPES = typing.get_type_hints(FinetuneConfig)
DEFAULTS = FinetuneConfig()


# --- reading values --------------------------------------------------------------------------------


# A value in a message: a few items of a few levels, so that a YAML document whose aliases nest
# (a "billion laughs") is shown in a line, not expanded for ever.
_SHORT = reprlib.Repr()  # its limits set one by one: Python before 3.12 takes none as arguments
_SHORT.maxlevel, _SHORT.maxdict, _SHORT.maxlist, _SHORT.maxtuple, _SHORT.maxset = 3, 4, 4, 4, 4
_SHORT.maxstring, _SHORT.maxother = 60, 60

def _shown(value: Any) -> str:
    """A value as a message shows it: short, on one line, even when it is huge."""
    try:
        text = _SHORT.repr(value)
    except ValueError:  # an integer too long for Python to print
        return "an integer of more than 4300 digits"
    return text if len(text) <= 60 else f"{text[:57]}..."


def parse_size(text: str) -> int:
    """A size as mlx-lm's --clear-cache-threshold takes it: 500000, 800M, 2GB (decimal units)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(|M|G|MB|GB)\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"not a size: {text!r} (a number of bytes, or with M, G, MB or GB)")
    units = {"": 1, "M": 10**6, "G": 10**9, "MB": 10**6, "GB": 10**9}
    with contextlib.suppress(InvalidOperation):
        return int(Decimal(match[1]) * units[match[2].upper()])
    raise ValueError(f"not a size: {text!r}")


def _integer(key: str, value: Any, source: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) < LARGEST_INT:
        return value
    raise ConfigError(f"{source}: {key} must be an integer of at most 18 digits, got {_shown(value)}")


def _number(key: str, value: Any, source: str) -> float:
    # A string too: PyYAML's safe_load reads 1e-5 (no dot) as one.
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        with contextlib.suppress(ValueError, OverflowError):
            number = float(value)
            if math.isfinite(number):
                return number
    raise ConfigError(f"{source}: {key} must be a finite number, got {_shown(value)}")


def _mapping(key: str, value: Any, source: str) -> dict[str, Any]:
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return dict(value)
    raise ConfigError(f"{source}: {key} must be a mapping of names to values, got {_shown(value)}")


def _lora_parameters(value: Any, source: str) -> dict[str, Any]:
    given = _mapping("lora_parameters", value, source)
    unknown = [k for k in given if k not in (*LORA_PARAMETERS, "keys")]
    if unknown:
        raise ConfigError(f"{source}: lora_parameters has no key {unknown[0]!r}; its keys are rank, scale, "
                          "dropout and keys")
    out = dict(given)  # what a layer leaves out comes from the layers under it (merge_config)
    if "rank" in out:
        out["rank"] = _integer("lora_parameters.rank", out["rank"], source)
    for inner in ("scale", "dropout"):
        if inner in out:
            out[inner] = _number(f"lora_parameters.{inner}", out[inner], source)
    keys = out.get("keys")
    if keys is not None and not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        raise ConfigError(f"{source}: lora_parameters.keys must be a list of layer names such as "
                          f"self_attn.q_proj, got {_shown(keys)}")
    return out


def _optimizer_config(value: Any, source: str) -> dict[str, Any]:
    given = _mapping("optimizer_config", {} if value is None else value, source)
    for name, settings in given.items():
        if name not in OPTIMIZERS:
            close = difflib.get_close_matches(name, OPTIMIZERS, n=1)
            raise ConfigError(f"{source}: optimizer_config has no optimizer {name!r}"
                              + (f" (did you mean {close[0]!r}?)" if close else "")
                              + f"; optimizers: {', '.join(OPTIMIZERS)}")
        given[name] = _mapping(f"optimizer_config.{name}", {} if settings is None else settings, source)
    return given


def _coerce(key: str, value: Any, source: str) -> Any:
    """`value` as the type of `key`, or a ConfigError naming the key and where it came from."""
    kind = KEY_TYPES[key]
    if key == "lora_parameters":
        return _lora_parameters(value, source)
    if key == "optimizer_config":
        return _optimizer_config(value, source)
    if key == "lr_schedule":
        return None if value is None else _mapping(key, value, source)
    if key == "hf_dataset":
        if value is None or isinstance(value, Mapping) or (
                isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value)):
            return value
        raise ConfigError(f"{source}: hf_dataset must be a mapping (path, train_split, ...) or a list of "
                          f"them, got {_shown(value)}")
    if key in ("dequantize_ranks", "pipeline_layers") and isinstance(value, list):  # YAML's [0, 2]
        value = ",".join(str(_integer(key, rank, source)) for rank in value)
    if key == "clear_cache_threshold" and isinstance(value, str):
        try:
            return parse_size(value)
        except ValueError as error:
            raise ConfigError(f"{source}: clear_cache_threshold: {error}") from None
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{source}: {key} must be true or false, got {value!r}")
    if kind is int:
        return _integer(key, value, source)
    if kind is float:
        return _number(key, value, source)
    if value is None and kind == (str | None):
        return None
    if kind == (str | None) and isinstance(value, int) and not isinstance(value, bool):
        return str(_integer(key, value, source))  # YAML reads `max_micro_batch: 2` as a number
    if isinstance(value, str):
        return value
    raise ConfigError(f"{source}: {key} must be a string, got {_shown(value)}")


def _unknown(values: Mapping[str, Any], source: str) -> None:
    known = (*CONFIG_KEYS, *older_keys.OLDER)
    unknown = [key for key in values if key not in known]
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), known, n=1)
        hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise ConfigError(f"{source}: unknown key {', '.join(hints)}; the keys are mlx-lm's "
                      f"(mlx_lm lora's config file) and {', '.join(PROJECT_KEYS)}")


def _layer(values: Mapping[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """One layer's values under mlx-lm's keys, each of its type; and its older schedule settings."""
    _unknown(values, source)
    if problems := older_keys.conflicts(values):
        raise ConfigError(f"{source}: {problems[0]}")
    current, older = older_keys.translate(values)
    return {key: _coerce(key, value, source) for key, value in current.items()}, older


def merge_config(
    file_values: Mapping[str, Any], cli_values: Mapping[str, Any], source: str = "config"
) -> FinetuneConfig:
    """Defaults, overridden by a config file's values, overridden by command line values.

    Unknown keys in the file are an error (a typo would otherwise be ignored silently); a CLI value
    of None means "not given". lora_parameters merges key by key over mlx-lm's (a file giving only
    the rank keeps the default scale and dropout; mlx-lm would fail on the missing keys).
    """
    file_layer, file_older = _layer(file_values, source)
    cli_layer, cli_older = _layer({k: v for k, v in cli_values.items() if v is not None}, "command line")
    values = file_layer | cli_layer
    values["lora_parameters"] = {**LORA_PARAMETERS, **file_layer.get("lora_parameters", {}),
                                 **cli_layer.get("lora_parameters", {})}
    older = file_older | cli_older
    if "lr_schedule" in cli_layer:  # a mapping on the command line wins over an older name in the file
        older.pop("lr_schedule", None)
    if older:
        if older_keys.WARMUP in older:
            _integer(older_keys.WARMUP, older[older_keys.WARMUP],
                     "command line" if older_keys.WARMUP in cli_older else source)
        merged = FinetuneConfig(**values)
        values["lr_schedule"] = older_keys.schedule(older, merged.lr_schedule, merged.learning_rate,
                                                    merged.iters)
    return FinetuneConfig(**values)


def older_names_said(file_values: Mapping[str, Any], cli_values: Mapping[str, Any]) -> list[str]:
    """The notes a run prints once for the older key names its settings use."""
    return older_keys.said([file_values, {k: v for k, v in cli_values.items() if v is not None}])


# --- checking the whole ----------------------------------------------------------------------------


def config_problems(config: FinetuneConfig, world_size: int = 1) -> list[str]:
    """Everything wrong with the settings for a run on `world_size` ranks (empty when all is well)."""
    from training.loop import optimizers  # mlx: only once the values are in

    problems = []
    for key in ("model", "adapter_path"):
        if not getattr(config, key):
            problems.append(f"{key} must not be empty")
    if not config.data and not config.hf_dataset:
        problems.append("data must not be empty (or give hf_dataset)")
    if not config.train:
        problems.append("train: false asks for no training, and invoke train trains: drop the key, or set "
                        "it to true (test: true then also evaluates the test split)")
    at_least_one = ("iters", "batch_size", "steps_per_report", "steps_per_eval", "save_every",
                    "stall_timeout", "grad_accumulation_steps")
    for key in at_least_one:
        if getattr(config, key) < 1:
            problems.append(f"{key} must be at least 1, got {getattr(config, key)}")
    for key in ("num_layers", "val_batches", "test_batches"):
        if getattr(config, key) != -1 and getattr(config, key) < 1:
            problems.append(f"{key} must be -1 (all) or at least 1, got {getattr(config, key)}")
    if not config.save_every_minutes >= 0:
        problems.append(f"save_every_minutes must be 0 (off) or more, got {config.save_every_minutes}")
    if config.clear_cache_threshold < 0:
        problems.append(f"clear_cache_threshold must be at least 0, got {config.clear_cache_threshold}")
    problems += _choice("fine_tune_type", config.fine_tune_type, FINE_TUNE_TYPES)
    problems += _choice("training_mode", config.training_mode, ("normal",))
    problems += _choice("optimizer", config.optimizer, OPTIMIZERS)
    problems += _choice("parallel", config.parallel, PARALLEL_MODES)
    if config.report_to:  # read as mlx-lm reads it: comma separated, any case
        for name in (n.strip().lower() for n in config.report_to.split(",") if n.strip()):
            problems += _choice("report_to", name, REPORTERS)
    problems += quantization.rank_problems(config.dequantize_ranks, world_size)
    if config.parallel == "tensor":
        problems += tensor_problems(config, world_size)
    problems += pipeline_problems(config, world_size)
    if config.batch_size >= 1:
        try:
            batch_plan(config, world_size)
        except shares.ShareError as error:
            problems.append(str(error))
    if not config.learning_rate > 0:
        problems.append(f"learning_rate must be positive, got {config.learning_rate}")
    problems += _lora_problems(config.lora_parameters)
    problems += optimizers.problems(config)
    if config.max_seq_length < 2:
        problems.append(f"max_seq_length must be at least 2, got {config.max_seq_length}")
    if not 0 <= config.seed < 2**32:
        problems.append(f"seed must be in [0, 2**32), got {config.seed}")
    return problems


def _choice(key: str, value: str, choices: tuple[str, ...]) -> list[str]:
    if value in choices:
        return []
    close = difflib.get_close_matches(value, choices, n=1)
    return [f"{key} must be one of {', '.join(choices)}, got {value!r}"
            + (f" (did you mean {close[0]!r}?)" if close else "")]


def _lora_problems(lora: Mapping[str, Any]) -> list[str]:
    problems = []
    if lora["rank"] < 1:
        problems.append(f"lora_parameters.rank must be at least 1, got {lora['rank']}")
    if not lora["scale"] > 0:
        problems.append(f"lora_parameters.scale must be positive, got {lora['scale']}")
    if not 0 <= lora["dropout"] < 1:
        problems.append(f"lora_parameters.dropout must be in [0, 1), got {lora['dropout']}")
    return problems


@dataclass(frozen=True)
class BatchPlan:
    """How each global batch is cut: examples per rank, and micro-batches per rank and iteration."""

    shares: list[int]
    limits: list[int]  # max_micro_batch per rank; 0: none
    micro_batches: int

    @property
    def equal(self) -> bool:
        return len(set(self.shares)) == 1 and self.micro_batches == 1


def data_ranks(config: FinetuneConfig, world_size: int) -> int:
    """The ranks that split each batch: all of them in data parallelism; in tensor parallelism every
    rank computes the whole batch, as one; in pipeline parallelism the replicas of the stages do."""
    if config.parallel == "pipeline":
        return pipeline_replicas(config, world_size)
    return 1 if config.parallel == "tensor" else world_size


def batch_plan(config: FinetuneConfig, world_size: int) -> BatchPlan:
    """The shares and micro-batches of `config` on `world_size` ranks (a ShareError says what
    is wrong with them)."""
    world_size = data_ranks(config, world_size)
    if config.batch_shares:
        unit = "replica" if config.parallel == "pipeline" else "rank"  # of the stages
        cut = shares.parse(config.batch_shares, world_size, "batch_shares", unit)
        if 0 in cut or sum(cut) != config.batch_size:
            raise shares.ShareError(
                f"batch_shares {config.batch_shares} must give every rank at least 1 example and sum "
                f"to batch_size {config.batch_size} (they sum to {sum(cut)})"
            )
    else:
        cut = shares.split(config.batch_size, [1] * world_size)
    limits = shares.parse(config.max_micro_batch or "0", world_size, "max_micro_batch")
    return BatchPlan(cut, limits, shares.micro_batches(cut, limits))


def validate_config(config: FinetuneConfig, world_size: int = 1) -> None:
    if problems := config_problems(config, world_size):
        # One problem, one line; several, one line each.
        raise ConfigError("invalid settings: " + (problems[0] if len(problems) == 1
                                                  else "\n  " + "\n  ".join(problems)))


def adapter_config(config: FinetuneConfig) -> dict[str, Any]:
    """adapter_config.json as `mlx_lm lora` writes it (every setting, by mlx-lm's name), which
    `mlx_lm.load(..., adapter_path=...)`, `mlx_lm generate --adapter-path` and `mlx_lm fuse` read:
    fine_tune_type, num_layers and lora_parameters (None for full fine-tuning, as mlx-lm sets it)."""
    values = dataclasses.asdict(config)
    if config.fine_tune_type == "full":
        values["lora_parameters"] = None
    return values


def check_inputs(config: FinetuneConfig) -> None:
    """Files the run reads, checked before the model loads."""
    if not config.hf_dataset:
        data = Path(config.data)
        if not (data / "train.jsonl").is_file():
            raise ConfigError(f"data: {data} has no train.jsonl (python -m training.data.prepare writes one)")
        if config.test and not (data / "test.jsonl").is_file():
            raise ConfigError(f"data: test: true, and {data} has no test.jsonl to evaluate on")
    if config.resume_adapter_file and not Path(config.resume_adapter_file).is_file():
        raise ConfigError(f"resume_adapter_file: {config.resume_adapter_file} does not exist")
