"""Every config key that changes the maths, against stock `mlx_lm lora` (a tiny llama, uneven chat
data, within one epoch): each of a handful of YAML config files, read by `mlx_lm lora -c FILE --train`
and by `training.finetune --config FILE`, trains the same adapters in one process of ours and on two
data-parallel ranks as in stock's one process; and each config trains other adapters than the
default settings, so that a key read and ignored would be seen.

Together the configs cover every lr_schedule mlx-lm's build_schedule builds from a config file, each
with warmup and warmup_init; every optimizer with settings of its own in optimizer_config;
grad_accumulation_steps; mask_prompt; grad_checkpoint; num_layers below the model's layers; and
lora_parameters (rank, scale, keys). Each key alone moves the weights by more than 1e-3, ten times
the tolerance (measured once by dropping it from its config: 2.6e-3 at least, adamw's weight_decay;
but `optimizer: adam`, mlx-lm's default, which the other configs change), except grad_checkpoint,
which recomputes the activations and changes no weight: its test is that mlx-lm's trainer
checkpointed the layers.

Stock runs every config in one process, the ranks run every config in one launch, and both run
while ours trains in this one: one start-up each instead of one per config.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import yaml
from mlx_lm.models import llama

from tests.unit import rings
from tests.unit.training.test_finetune import REPO
from tests.unit.training.test_shares_training import adapters
from training import config as training_config
from training import finetune as ft
from training.loop import optimizers
from training.model import stand_in

TOLERANCE = 1e-4
CHANGED = 1e-2  # a config moves the weights from the defaults' by more than 100 times the tolerance
TIMEOUT = 600  # seconds, for stock's runs and for the ranks' (each a few seconds on a quiet machine)

# What every run shares (the defaults, for the keys under test). Within the first epoch of the 24
# examples: stock draws its second epoch's order from numpy's global RNG after its validations have
# drawn from it too, ours has its own. One report, and no checkpoints: they change nothing trained.
BASE: dict[str, Any] = {
    "train": True, "fine_tune_type": "lora", "optimizer": "adam", "seed": 3, "batch_size": 4, "iters": 5,
    "learning_rate": 1e-3, "num_layers": -1, "steps_per_report": 100, "steps_per_eval": 100,
    "save_every": 100, "val_batches": 1,
}  # fmt: skip
# With grad_accumulation_steps 2: the same 5 updates, each of 2 batches of 2.
HALVES = {"batch_size": 2, "iters": 10, "grad_accumulation_steps": 2}


def schedule(name: str, arguments: list[float], warmup_init: float, warmup: int = 2) -> dict[str, Any]:
    """An lr_schedule as mlx-lm's config files write it."""
    return {"name": name, "arguments": arguments, "warmup": warmup, "warmup_init": warmup_init}


# Every schedule warms up over 2 updates (1 for muon's) from its own warmup_init, then decays: 5
# updates show the warmup's middle step and a decayed one. lora_parameters are whole: stock fails on
# a missing dropout (ours would take its default). Dropout stays 0: two ranks draw other masks than
# one process.
CONFIGS: dict[str, dict[str, Any]] = {
    # bias correction, betas, eps; cosine_decay; accumulation; the last reply's loss alone
    "adam": HALVES | {
        "optimizer": "adam",
        "optimizer_config": {"adam": {"betas": [0.8, 0.99], "eps": 1e-6, "bias_correction": True}},
        "lr_schedule": schedule("cosine_decay", [1e-2, 3, 1e-3], warmup_init=2e-3),
        "mask_prompt": True,
    },
    # weight decay, betas; linear_schedule; the last layer only, LoRA on three of its projections
    "adamw": {
        "optimizer": "adamw",
        "optimizer_config": {"adamw": {"weight_decay": 0.5, "betas": [0.7, 0.95]}},
        "lr_schedule": schedule("linear_schedule", [1e-2, 1e-3, 3], warmup_init=3e-3),
        "num_layers": 1,
        "lora_parameters": {"rank": 4, "scale": 5.0, "dropout": 0.0,
                            "keys": ["self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"]},
    },
    # Nesterov momentum, weight decay; exponential_decay; checkpointed layers
    "sgd": {
        "optimizer": "sgd",
        "optimizer_config": {"sgd": {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1}},
        "lr_schedule": schedule("exponential_decay", [0.02, 0.7], warmup_init=0.005),
        "grad_checkpoint": True,
    },
    # the schedule's rate (relative_step false: by default Adafactor ignores any rate), first moments,
    # clipping; step_decay; the last reply's loss alone; another rank and scale
    "adafactor": {
        "optimizer": "adafactor",
        "optimizer_config": {"adafactor": {"relative_step": False, "scale_parameter": False, "beta_1": 0.9,
                                           "clip_threshold": 0.5}},
        "lr_schedule": schedule("step_decay", [1e-2, 0.5, 1], warmup_init=2e-3),
        "mask_prompt": True,
        "lora_parameters": {"rank": 16, "scale": 10.0, "dropout": 0.0},
    },
    # momentum without Nesterov, fewer Newton-Schulz steps, weight decay; cosine_decay to 0 after a
    # 1-update warmup; accumulation; the last layer only
    "muon": HALVES | {
        "optimizer": "muon",
        "optimizer_config": {"muon": {"momentum": 0.8, "nesterov": False, "ns_steps": 3,
                                      "weight_decay": 0.1}},
        "lr_schedule": schedule("cosine_decay", [2e-2, 4], warmup=1, warmup_init=5e-3),
        "num_layers": 1,
    },
}  # fmt: skip
# The ranks' own flags, besides the world size: a patient watchdog (this box may be busy), and
# for one config the shares 3:1 in micro-batches, whose micro-batches carry the prompts' offsets.
RANK_FLAGS = ["--expected-world-size", "2", "--stall-timeout", str(TIMEOUT)]
RANK_EXTRA = {"adafactor": ["--batch-shares", "3,1", "--max-micro-batch", "2,0"]}

# mlx-lm's grad_checkpoint replaces the __call__ of the layers' class for good: each run here
# starts from the class as a new process has it, as each would alone.
STOCK = """
import sys
from mlx_lm import lora
from mlx_lm.models import llama

call = llama.TransformerBlock.__call__
for config, out in zip(sys.argv[1::2], sys.argv[2::2]):
    sys.argv = ["mlx_lm.lora", "-c", config, "--train", "--adapter-path", out]  # python -m mlx_lm lora
    lora.main()
    llama.TransformerBlock.__call__ = call
"""
RANKS = """
import sys
from mlx_lm.models import llama
from training import finetune as ft

call = llama.TransformerBlock.__call__
codes = []
for config, out, flags in zip(*[iter(sys.argv[1:])] * 3):
    codes.append(ft.main(["--config", config, "--adapter-path", out, *flags.split()]))
    llama.TransformerBlock.__call__ = call
sys.exit(max(codes))
"""


def settings(root: Path, name: str) -> dict[str, Any]:
    """A config file's values: a config's (a baseline's: `defaults-<batch>x<iters>`) over BASE."""
    keys = CONFIGS.get(name, {})
    if name.startswith("defaults-"):
        batch, iters = name.removeprefix("defaults-").split("x")
        keys = {"batch_size": int(batch), "iters": int(iters)}
    return {"model": str(root / "model"), "data": str(root / "data"), **BASE, **keys}


def baseline(name: str) -> str:
    """The default-settings run a config is told apart from: the same batches, nothing else."""
    values = BASE | CONFIGS[name]
    return f"defaults-{values['batch_size']}x{values['iters']}"


def distance(a: Path, b: Path) -> float:
    """The largest difference between two runs' adapters; infinite when their names or shapes differ
    (other layers or another rank)."""
    first, second = adapters(a), adapters(b)
    if first.keys() != second.keys() or any(first[k].shape != second[k].shape for k in first):
        return float("inf")
    return max(mx.abs(first[k] - second[k]).max().item() for k in first)


class Background:
    """A command started now in its own process group, its output in a file, its end awaited later."""

    def __init__(self, command: list[str], log: Path, cwd: Path):
        self.command, self.log, self.started = command, log, time.monotonic()
        with log.open("w") as out:
            # Its own stdin: a launcher may leave it non-blocking (mlx.launch did), and so pytest's.
            self.process = subprocess.Popen(command, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def result(self, timeout: float) -> subprocess.CompletedProcess[str]:
        try:
            self.process.wait(timeout=max(timeout - (time.monotonic() - self.started), 1))
        except subprocess.TimeoutExpired:
            self.stop()
            return subprocess.CompletedProcess(self.command, -1, f"{self.log.read_text()}\ntimed out after "
                                               f"{timeout} s")
        return subprocess.CompletedProcess(self.command, self.process.returncode, self.log.read_text())

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def ours(config: Path, out: Path) -> bool:
    """One process of ours, in this one; whether mlx-lm's trainer checkpointed the layers."""
    call = llama.TransformerBlock.__call__
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            # A patient watchdog: this process shares the box with stock's and the ranks'.
            code = ft.main(["--config", str(config), "--adapter-path", str(out), "--stall-timeout",
                            str(TIMEOUT)], environ={})
        assert code == 0, f"{config.name}: exit code {code}"
        return llama.TransformerBlock.__call__ is not call
    finally:
        llama.TransformerBlock.__call__ = call  # for the tests after this one


@dataclass(frozen=True)
class Runs:
    root: Path
    stock: subprocess.CompletedProcess[str]  # every config in one process of stock mlx_lm lora
    ranks: subprocess.CompletedProcess[str]  # every config on two ranks of ours, one launch
    checkpointed: set[str]  # the runs of ours in which mlx-lm's trainer checkpointed the layers


@pytest.fixture(scope="module")
def runs(uneven_run: Path) -> Runs:
    """Each config trained by stock, by two ranks of ours and by one of ours; the baselines by ours."""
    root = uneven_run / "config-keys"
    root.mkdir()
    names = [*CONFIGS, *sorted({baseline(name) for name in CONFIGS})]
    for name in names:
        (root / f"{name}.yaml").write_text(yaml.safe_dump(settings(uneven_run, name), sort_keys=False))
    stock = Background([sys.executable, "-c", STOCK,
                        *(a for n in CONFIGS for a in (str(root / f"{n}.yaml"), str(root / f"stock-{n}")))],
                       root / "stock.log", cwd=root)
    launch = rings.launch(2)
    ranks = Background([*launch, sys.executable, "-c", RANKS,
                        *(a for n in CONFIGS for a in (str(root / f"{n}.yaml"), str(root / f"two-{n}"),
                                                       " ".join([*RANK_FLAGS, *RANK_EXTRA.get(n, [])])))],
                       root / "ranks.log", cwd=REPO)
    try:
        checkpointed = {name for name in names if ours(root / f"{name}.yaml", root / f"ours-{name}")}
    except BaseException:
        stock.stop()
        ranks.stop()
        raise
    return Runs(root, stock.result(TIMEOUT), ranks.result(TIMEOUT), checkpointed)


def test_the_configs_cover_every_schedule_optimizer_and_key_that_changes_the_maths():
    """A schedule or optimizer this project adds is tested here only once a config trains with it."""
    schedules = {c["lr_schedule"]["name"] for c in CONFIGS.values()}
    assert sorted(schedules) == sorted(optimizers.SCHEDULES)
    assert all({"warmup", "warmup_init"} <= c["lr_schedule"].keys() for c in CONFIGS.values())
    assert sorted(c["optimizer"] for c in CONFIGS.values()) == sorted(training_config.OPTIMIZERS)
    assert all(c["optimizer_config"][c["optimizer"]] for c in CONFIGS.values())
    changed = {key for c in CONFIGS.values() for key, value in c.items()
               if value != getattr(training_config.DEFAULTS, key)}
    assert {"grad_accumulation_steps", "mask_prompt", "grad_checkpoint", "num_layers",
            "lora_parameters"} <= changed
    assert {"rank", "scale", "keys"} <= {k for c in CONFIGS.values() for k in c.get("lora_parameters", {})}
    # num_layers below the tiny llama's layers (stand_in's), and never above: mlx-lm refuses that
    layers = [c["num_layers"] for c in CONFIGS.values() if "num_layers" in c]
    assert layers and all(0 < n < stand_in.SHAPE["num_hidden_layers"] for n in layers)


@pytest.mark.parametrize("name", CONFIGS)
def test_one_process_trains_the_weights_stock_mlx_lm_lora_trains_with_the_config(runs: Runs, name: str):
    assert runs.stock.returncode == 0, runs.stock.stdout[-5000:]
    diff = distance(runs.root / f"ours-{name}", runs.root / f"stock-{name}")
    assert diff < TOLERANCE, diff
    print(f"{name}: max abs difference, one process of ours against stock mlx_lm lora: {diff:.3g}")


@pytest.mark.parametrize("name", CONFIGS)
def test_the_config_trains_other_weights_than_the_default_settings(runs: Runs, name: str):
    """Stock's weights with the config, far from the defaults' on the same batches: the config changes
    what mlx-lm trains (each of its keys alone by more than 1e-3, the module's docstring says), so
    ours reading a key and ignoring it would not train stock's weights."""
    assert runs.stock.returncode == 0, runs.stock.stdout[-5000:]
    moved = distance(runs.root / f"stock-{name}", runs.root / f"ours-{baseline(name)}")
    assert moved > CHANGED, moved
    print(f"{name}: max abs difference, stock with the config against the default settings: {moved:.3g}")


@pytest.mark.parametrize("name", CONFIGS)
def test_two_ranks_train_the_weights_stock_trains_in_one_process(runs: Runs, name: str):
    assert runs.stock.returncode == 0, runs.stock.stdout[-5000:]
    assert runs.ranks.returncode == 0, runs.ranks.stdout[-5000:]
    diff = distance(runs.root / f"two-{name}", runs.root / f"stock-{name}")
    assert diff < TOLERANCE, diff
    print(f"{name}: max abs difference, two ranks of ours against stock's one process: {diff:.3g}")


def test_grad_checkpoint_has_mlx_lm_s_trainer_checkpoint_the_layers(runs: Runs):
    """grad_checkpoint changes no weight (the activations are recomputed, not changed): what shows it
    was not ignored is that mlx-lm's trainer checkpointed the layers, in its runs alone."""
    assert runs.checkpointed == {name for name, c in CONFIGS.items() if c.get("grad_checkpoint")}
