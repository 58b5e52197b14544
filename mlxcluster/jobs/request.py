"""What `invoke train` is asked: its options as given, a resumed run's recorded inputs put back in
them, and the Request they make (the data and model found, the settings read, a calibration for
`batch_share: auto`). mlxcluster/jobs/train.py plans and runs a Request; a restart after a fault
makes its own from the run it resumes (`resumed`).
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from mlxcluster.describe.cluster import Recorded
from mlxcluster.errors import UserError
from mlxcluster.jobs import flags
from mlxcluster.launch import batch_shares, hf_datasets, parallel, runs, shipment
from mlxcluster.launch import settings as run_settings
from mlxcluster.paths import RUNS
from mlxcluster.provision import inputs, model_store
from training.config import FinetuneConfig
from training.model.folder import SMOLLM2_SHAPE
from training.model.manifest import manifest_sha256


@dataclass(frozen=True)
class Request:
    """What to train, and how to launch it."""

    data: Path
    model: Path
    config: Path | None = None  # a YAML settings file; for a resumed run, the run's own config.yaml
    overrides: Sequence[str] = ()  # more training flags, after the config's
    backend: str | None = None  # auto (None: what the cluster's recorded choice says), or a backend
    interface: str | None = None
    btl_tcp_links: int | None = None
    threads: int | None = None
    installed: str | None = None  # the model's path on every node, when provisioning put it there
    mlx_envs: Sequence[str] = ()  # hostfile_mlx_envs, for a hosts file written at launch (JACCL's)
    # The latest calibration of this model and sequence length (batch_share: auto), if any.
    calibration: Mapping[str, Any] | None = None
    # Defaults a dry run has not made yet ("data", "model"): their files are shown, not checked.
    pending: frozenset[str] = frozenset()
    # A model not fetched yet: what it was given as (None: the demo's SmolLM2), and its config.json
    # as far as the controller knows it (for how it shards).
    model_source: str | None = None
    pending_shape: Mapping[str, Any] | None = field(default_factory=lambda: SMOLLM2_SHAPE)
    interactive: bool = field(default_factory=lambda: sys.stdin.isatty() and sys.stdout.isatty())

    @cached_property
    def settings(self) -> FinetuneConfig:
        """The user's settings (the config file, then the overrides), read once: what the plan
        works the layout out from. A flag that names the run's own folders is refused here."""
        return run_settings.read(self.config, run_settings.user_flags(self.overrides))

    @property
    def parallel(self) -> str:
        """data or tensor, as the settings say (mlxcluster/launch/parallel.py)."""
        return self.settings.parallel


@dataclass(frozen=True)
class Options:
    """invoke train's options, as given."""

    config: str | None = None
    data: str | None = None
    model: str | None = None
    iters: int | None = None
    batch_size: int | None = None
    extra: str = ""
    backend: str | None = None
    interface: str | None = None
    btl_tcp_links: int | None = None
    threads: int | None = None
    parallel: str | None = None  # data or tensor (None: the config's, data by default)
    resume: str | bool | None = None  # True: the latest unfinished run
    dry_run: bool = False
    max_restarts: int | None = None  # after a node's fault (0: none; None: the default)
    min_nodes: int | None = None  # the fewest nodes a run goes on with (None: 1)


def resumed(options: Options) -> tuple[str | None, Options]:
    """The run to resume (if any), and the options with its data, model, backend and settings."""
    if not options.resume:
        return None, options
    if options.config:
        raise UserError("--config and --resume do not go together: a resumed run keeps the "
                        "settings it was started with (change reporting and the like with --extra)")
    run_id, info = runs.resumable(RUNS, None if options.resume is True else str(options.resume))
    recorded_data, recorded_model = (runs.recorded_path(RUNS / run_id, info, key)
                                     for key in ("data", "model"))
    if options.model and info.get("model_sha256"):
        given = manifest_sha256(Path(options.model))
        if given != str(info["model_sha256"]):
            raise UserError(f"--model {options.model} is not the model run {run_id} was trained on "
                            f"({recorded_model}, manifest sha256 {str(info['model_sha256'])[:12]}; this one "
                            f"{'has no manifest' if given is None else given[:12]}): resume without "
                            "--model, or start a new run with invoke train")
    # The inputs here, over the nodes' paths in the run's config.yaml.
    inputs_here = [*(hf_datasets.flag(info["hf_dataset"]) if info.get("hf_dataset") else []),
                   *(["--resume-adapter-file", str(info["resume_adapter_file"])]
                     if info.get("resume_adapter_file") else [])]
    extra = (shlex.join([*inputs_here, *run_settings.split_extra(options.extra)]) if inputs_here
             else options.extra)
    return run_id, dataclasses.replace(
        options, data=options.data or recorded_data, model=options.model or recorded_model,
        backend=options.backend or info.get("backend"), config=str(runs.resume_config(run_id)), extra=extra)


def request_for(rec: Recorded, options: Options, *, fetch: bool) -> Request:
    config = shipment.config_file(Path(options.config)).resolve() if options.config else None
    # A config's model and data are the run's, as in mlx_lm lora, unless --model / --data say otherwise.
    from_file = run_settings.paths_in(config)
    model_arg, data_arg = options.model or from_file.get("model"), options.data or from_file.get("data")
    installed = inputs.installed_model(rec.cluster, model_arg)
    model_given, fetched_from, shape = model_arg, None, SMOLLM2_SHAPE
    if installed:
        model_given = installed["controller_path"]
    elif model_arg:
        found = model_store.for_run(model_arg, linux_trains=inputs.cluster_dtype(rec.cluster) == "float32",
                                    fetch=fetch)
        model_given, fetched_from = str(found.path), found.fetched_from
        shape = model_store.shape_of(model_arg) if found.pending else None
    data, model = inputs.resolve(rec.cluster, data_arg, model_given, fetch=fetch, check=False)
    # A default a dry run did not make, or a model it did not fetch: the plan shows its files to be.
    pending = frozenset(name for name, given, path in (("data", data_arg, data), ("model", None, model))
                        if not given and not path.exists())
    # plan() refuses flags of the user's that name the run's own folders.
    overrides = run_settings.split_extra(options.extra)
    if options.iters:
        overrides += ["--iters", str(options.iters)]
    if options.batch_size:
        overrides += ["--batch-size", str(options.batch_size)]
    overrides += parallel.flags(options.parallel)
    request = Request(data, model, config, overrides, options.backend, flags.interface(options.interface),
                      options.btl_tcp_links, options.threads, installed["path"] if installed else None,
                      mlx_envs=rec.mlx_envs, pending=pending, model_source=fetched_from, pending_shape=shape)
    calibrated = dataclasses.replace(request, calibration=calibration_for(rec, model, request.settings))
    calibrated.__dict__["settings"] = request.settings  # the same config and flags: read once, carried
    return calibrated


def calibration_for(rec: Recorded, model: Path, settings: FinetuneConfig) -> Mapping[str, Any] | None:
    """The latest calibration of this model and sequence length, when a node's batch_share is auto."""
    if not any(n.batch_share == batch_shares.AUTO for n in rec.cluster.training_nodes):
        return None
    return batch_shares.latest_calibration(rec.calibration, batch_shares.calibration_key(model, settings))
