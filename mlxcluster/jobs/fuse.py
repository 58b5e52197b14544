"""`invoke fuse`: a run's adapters fused into its base, as a model folder any mlx-lm tool loads.

Fusing happens on this machine, where the runs and models are. Stock `mlx_lm fuse` does it when
the model fits this machine's memory; when it does not (a model trained tensor-parallel because no
Mac holds it), training/tools/fuse.py writes the same tensors one file at a time, holding one file
of weights, not the model. `--by-file` asks for that way whatever the memory. The folder is
written beside its place and renamed into it when whole: a failed or interrupted fuse leaves
nothing half-written, and an existing folder is never written over.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from mlxcluster.check import probe
from mlxcluster.errors import Interrupted, UserError, reason
from mlxcluster.launch import runs
from mlxcluster.plan import model as model_files
from training.model import quantization

# Stock mlx_lm fuse holds the model as loaded, its fused layers and what it writes: about the model
# loaded plus the model written (measured: 1.35x the float SmolLM2's size; 2x is the bound we use).
STOCK_MEMORY = 2.0
GIB = 2**30


class FuseError(UserError):
    """A fuse that cannot be done or failed; the message says why and what to do."""


@dataclass(frozen=True)
class Options:
    run: str | None = None  # a run id or folder (default: the latest finished run)
    model: str | None = None  # the base (default: the run's own)
    output: str | None = None  # default: runs/<id>/fused
    dequantize: bool = False
    gguf: bool = False
    by_file: bool = False  # file by file even where stock fits
    max_file_mb: int = 1024
    dry_run: bool = False


@dataclass(frozen=True)
class Plan:
    run: Path
    model: Path
    output: Path
    staging: Path  # where it is written until whole
    gguf: Path | None
    way: str  # "stock" or "by file"
    why: str
    command: list[str]


def _config(model: Path) -> dict:
    try:
        return json.loads((model / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise FuseError(f"{model}/config.json cannot be read ({reason(error)})") from None


def _size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.0f} MiB"


def plan(options: Options, available: int | None = None, disk_free: int | None = None) -> Plan:
    """The fuse as a command, and which way and why; a FuseError for what cannot be done.
    `available` and `disk_free` are this machine's (default: read now)."""
    from training.tools.fuse import gguf_refusal

    run = runs.named(options.run)
    model = runs.model_for(run, options.model)
    config = _config(model)
    if options.dequantize and not quantization.is_quantized(config):
        raise FuseError(f"--dequantize: {model} is not quantized (its weights are float already): "
                        "leave out --dequantize")
    if options.gguf and (why := gguf_refusal(model, config, options.dequantize)):
        raise FuseError(why)
    if options.max_file_mb < 1:
        raise FuseError("--max-file-mb must be at least 1")
    output = Path(options.output) if options.output else run / "fused"
    if output.exists():
        raise FuseError(f"{output} already exists: remove it, or pass --output <a new folder>")
    if not output.parent.is_dir():
        raise FuseError(f"--output {output}: its folder {output.parent} does not exist")
    weights = model_files.weights(model)
    stored = weights.stored if weights else sum(f.stat().st_size for f in model.glob("*.safetensors"))
    written = weights.dequantized if (weights and options.dequantize) else stored
    gguf = output / "model.gguf" if options.gguf else None
    needed_disk = written + (weights.dequantized if (weights and gguf) else written if gguf else 0)
    disk_free = probe.disk_free(str(output.parent)) if disk_free is None else disk_free
    if disk_free is not None and disk_free < needed_disk:
        raise FuseError(f"{output.parent} has {_size(disk_free)} free; the fused model needs "
                        f"{_size(needed_disk)}: free some, or pass --output on a larger disk")
    if available is None:
        available = probe.memory_bytes().get("available")
    stock_need = int(STOCK_MEMORY * max(stored, written))
    if options.by_file:
        way, why = "by file", "asked (--by-file)"
    elif available is not None and available < stock_need:
        way, why = "by file", (f"stock mlx_lm fuse would hold ~{_size(stock_need)} and this machine has "
                               f"{_size(available)} free; file by file holds {options.max_file_mb} MiB of "
                               "weights at a time")
    else:
        way, why = "stock", (f"the model ({_size(stored)}) fits this machine's memory"
                             + (f" ({_size(available)} free)" if available is not None else ""))
    staging = output.parent / f".{output.name}.partial"
    flags = ["--model", str(model), "--adapter-path", str(run), "--save-path", str(staging),
             *(["--dequantize"] if options.dequantize else [])]
    if way == "stock":
        command = [sys.executable, "-m", "mlx_lm", "fuse", *flags,
                   *(["--export-gguf", "--gguf-path", gguf.name] if gguf else [])]
    else:
        command = [sys.executable, "-m", "training.tools.fuse", *flags,
                   "--max-file-mb", str(options.max_file_mb),
                   *(["--gguf-path", str(staging / gguf.name)] if gguf else [])]
    return Plan(run, model, output, staging, gguf, way, why, command)


def execute(plan: Plan) -> Path:
    """Run the fuse into the staging folder, check it, and rename it into place."""
    shutil.rmtree(plan.staging, ignore_errors=True)  # a fuse killed before it could clean up
    print(f"==> fusing run {plan.run.name}'s adapters into {plan.model} ({plan.way}: {plan.why})", flush=True)
    try:
        result = subprocess.run(plan.command, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    except KeyboardInterrupt:
        shutil.rmtree(plan.staging, ignore_errors=True)
        raise Interrupted(f"stopped: nothing was written to {plan.output}") from None
    if result.returncode != 0:
        shutil.rmtree(plan.staging, ignore_errors=True)
        output = (result.stderr.strip() or result.stdout.strip()).splitlines()
        raise FuseError(f"fusing failed (exit {result.returncode}), nothing was written to {plan.output}: "
                        + (output[-1] if output else "no output"))
    from training.model.folder import missing_files

    if missing := missing_files(plan.staging):
        shutil.rmtree(plan.staging, ignore_errors=True)
        raise FuseError(f"the fused folder lacks {', '.join(missing)}; nothing was written to {plan.output}")
    plan.staging.rename(plan.output)
    return plan.output


def fuse(options: Options) -> Path | None:
    """invoke fuse."""
    the_plan = plan(options)
    if options.dry_run:
        print(f"# {the_plan.way}: {the_plan.why}\n# written to {the_plan.staging}, then renamed to "
              f"{the_plan.output}\n{shlex.join(the_plan.command)}")
        return None
    output = execute(the_plan)
    size = sum(f.stat().st_size for f in output.glob("*.safetensors"))
    print(f"==> {output}: the fused model ({_size(size)})"
          + (f", and {output / 'model.gguf'} for llama.cpp" if the_plan.gguf else ""))
    print(f"    mlx_lm generate --model {output} --prompt \"...\"\n"
          f"    mlx_lm.server --model {output}")
    return output
