"""`invoke train`: a plan of the run (pure data, printed by --dry-run), then running it.

The plan is the sync steps that put code, data, config and model on every node, the launch
command (mlxcluster/launch/builder.py's one builder) and the rsync that brings the results back. Running
it syncs, launches with the output relayed (mlxcluster/launch/relay.py), records the run in runs/<id>/
(mlxcluster/launch/runs.py) and says what went wrong if it failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shlex
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxcluster import local
from mlxcluster.check import doctor, faults, room
from mlxcluster.check.faults import TrainFailed
from mlxcluster.describe.cluster import Cluster, Recorded, recorded
from mlxcluster.errors import Interrupted, shown
from mlxcluster.jobs import plan as planning
from mlxcluster.jobs import restarts
from mlxcluster.jobs.request import Options, Request, request_for, resumed
from mlxcluster.launch import (
    batch_shares,
    builder,
    hf_datasets,
    parallel,
    quantized,
    relay,
    runs,
    shipment,
    stages,
    start_adapters,
    sync,
)
from mlxcluster.launch import settings as run_settings
from mlxcluster.launch.liveness import Liveness
from mlxcluster.paths import REPO, RUNS
from mlxcluster.plan import model as model_files
from mlxcluster.plan import of_run
from mlxcluster.provision import inputs, preview
from training.config import FinetuneConfig
from training.model import quantization
from training.model.manifest import manifest_sha256
from training.parallel_rules import pipeline_layer_counts, pipeline_stage_count


@dataclass(frozen=True)
class Plan:
    """One run, whole: the cluster as recorded, what it trains on, the shares, the backend and the
    command lines, and what it says and records of itself. Syncing, launching and collecting take
    this and nothing else (`execute`); a dry run prints it (`show`)."""

    cluster: Cluster
    request: Request
    settings: FinetuneConfig  # what every rank trains with: the user's, the layout's and the nodes' paths
    run_id: str
    resume: bool
    backend: str  # as launched: mpi, ring, or direct (one rank)
    steps: list[sync.Step]
    launch: list[str]
    pull: list[str]
    backend_why: str = ""  # why this backend (mlxcluster/describe/backends.py)
    shares: batch_shares.Shares | None = None  # None: equal shares, as training does by itself
    pipeline_stages: stages.Stages | None = None  # the layout's (None: the settings' own, or equal)
    notices: tuple[str, ...] = ()  # what the run says of itself before it starts: backend, shares, split
    record: Mapping[str, Any] = field(default_factory=dict)  # run.json's fields known before launch
    planned: of_run.Planned | None = None  # each rank's peak and a step's time, as of_run.py plans them

    @property
    def dequantize_ranks(self) -> tuple[int, ...]:
        """The ranks that dequantize a quantized base as they load it."""
        return tuple(quantization.parse_ranks(self.settings.dequantize_ranks))

    @property
    def results(self) -> Path:
        return RUNS / self.run_id

    @property
    def on_launcher(self) -> str:
        """Where rank 0 writes the run: its folder on the launcher."""
        return f"{self.cluster.head.runs_dir}/{self.run_id}"

    @property
    def marker(self) -> str:
        """What names this run's processes on the launcher (for stopping them)."""
        return f"runs/{self.run_id}"


def finetune_argv(*, model: str, data: str, adapter_path: str, config: str | None = None,
                  resume: bool = False, world_size: int | None = None,
                  overrides: Sequence[str] = ()) -> list[str]:
    """The training entry point's command line, as every rank runs it."""
    argv = ["python", "-m", "training.finetune"]
    if config:
        argv += ["--config", config]
    if resume:
        argv.append("--resume")
    argv += ["--model", model, "--data", data, "--adapter-path", adapter_path]
    if world_size is not None:
        argv += ["--expected-world-size", str(world_size)]
    return [*argv, *overrides]


def plan(cluster: Cluster, request: Request, *, run_id: str, resume: bool = False,
         inventory: str = "", memory: Mapping[str, int | None] | None = None) -> Plan:
    """The run, as commands: nothing is run. resume: continue run_id from its latest checkpoint
    (request.config is then the run's own config.yaml). memory: each node's free memory, which
    sizes pipeline stages (None: not asked, as in a dry run)."""
    sent = job_inputs(cluster, request, run_id)
    steps, placed = sent.steps, sent.placed
    run_dir = f"{cluster.head.runs_dir}/{run_id}"
    if resume and (restore := sync.push_checkpoints(RUNS / run_id, cluster.head, run_dir)):
        steps.append(restore)
    # A dry run before the default model is fetched still knows how it shards (its pinned shape).
    stage_count = pipeline_stage_count(request.settings, cluster.world_size)
    parallel.check(cluster, request.model, request.parallel,
                   request.pending_shape if "model" in request.pending else None, stage_count)
    model_config = quantized.model_config(request.model,
                                          request.pending_shape if "model" in request.pending else None)
    shares = batch_shares.for_run(cluster, request.settings, request.calibration)
    dequantizing = quantized.args(cluster, model_config, request.settings)
    sized = stages.for_run(cluster, request.settings, model_config, memory,
                           recorded_stages(run_id) if resume else None, resumed=resume,
                           body=model_body(request.model) if memory else None)
    # The shares, stages and the ranks that dequantize go before the user's flags (theirs win); the
    # inputs at the nodes' paths after them.
    first, last = ([], sized.args) if sized and sized.refit else (sized.args if sized else [], [])
    overrides = [*(shares.args if shares else []), *first, *dequantizing, *request.overrides, *last,
                 *sent.flags]
    # The ranks' own rules, here: settings they would refuse stop the run before anything is sent.
    settings = run_settings.check(request.config, overrides, cluster.world_size)
    check_test_split(settings, sent.data)
    quantized.check(model_config, settings, cluster.world_size)
    base = quantized.base_weights(cluster, model_config, settings, from_inventory=bool(dequantizing))
    program = finetune_argv(model=placed.model, data=placed.data, adapter_path=run_dir,
                            config=placed.config, resume=resume, world_size=cluster.world_size,
                            overrides=overrides)
    choice = builder.choice_for(cluster, request.backend)
    if request.parallel == "pipeline":
        choice = parallel.pipeline_backend(choice, request.backend)
    backend = choice.backend
    job = builder.Job(program, backend=backend, interface=request.interface,
                     btl_tcp_links=request.btl_tcp_links, threads=request.threads,
                     interactive=request.interactive, mlx_envs=request.mlx_envs, beats=True)
    notices = [*([f"backend {backend}: {choice.why}"] if choice.why else []),
               *([shares_line(shares)] if shares else []),
               *([base.line] if base else []),
               *([split] if (split := parallel.line(cluster, request.parallel, stage_count)) else []),
               *([sized.line] if sized else [])]
    launch = builder.command(cluster, job)
    return Plan(cluster, request, settings, run_id, resume, backend, steps, launch,
                sync.pull(cluster.head, run_dir, RUNS / run_id), backend_why=choice.why, shares=shares,
                pipeline_stages=sized, notices=tuple(notices),
                record={**run_record(cluster, request, inventory, backend, choice.why, shares, launch),
                        **sent.controller_paths, "base_weights": base.per_node if base else None,
                        **stages_record(settings, sized),
                        "layout_settings": layout_settings(shares, dequantizing, sized)})


def model_body(model: Path) -> stages.Body | None:
    """The model's bytes by layer, from its safetensors headers (None: not here, or not by layer)."""
    found = model_files.weights(model, by_layer=True)
    return found.body if found else None


def layout_settings(shares: batch_shares.Shares | None, dequantizing: Sequence[str],
                    sized: stages.Stages | None = None) -> list[str]:
    """The settings of the run's config.yaml that the layout gave, rank by rank (the inventory's
    batch_share, max_micro_batch and model_dequantize, the stages sized to the nodes), not the
    user: a resume, on the same nodes or on those a fault left, works them out again
    (runs.resume_config); stages it keeps as run.json recorded them while the ranks are as many."""
    return [*(["batch_shares"] if shares else []),
            *(["max_micro_batch"] if shares and any(shares.limits) else []),
            *(["dequantize_ranks"] if dequantizing else []),
            *(["pipeline_layers"] if sized else [])]


def recorded_stages(run_id: str) -> Any:
    """The pipeline stages a resumed run's run.json recorded (None: none, or no record)."""
    try:
        return runs.read_info(RUNS / run_id).get("pipeline_layers")
    except runs.RunError:
        return None


def stages_record(settings: FinetuneConfig, sized: stages.Stages | None) -> dict[str, Any]:
    """run.json's pipeline stages: each rank's layers and where they come from (none: not a
    pipeline run, or the ranks split the layers equally by themselves)."""
    counts = pipeline_layer_counts(settings) if settings.parallel == "pipeline" else None
    why = sized.why if sized else "pipeline_layers in the settings" if counts else None
    return {"pipeline_layers": counts, "pipeline_layers_why": why}


@dataclass(frozen=True)
class JobInputs:
    """What a run reads, sent: the steps, where it lands, the flags that tell the ranks so (after
    the user's settings), and the paths on the controller that run.json keeps for a resume."""

    steps: list[sync.Step]
    placed: sync.Placed
    flags: list[str]
    controller_paths: dict[str, Any]
    data: shipment.Shipment  # the data folder's splits that go (none when hf_dataset is read instead)


def job_inputs(cluster: Cluster, request: Request, run_id: str) -> JobInputs:
    """The code, data, config and model on every node, and the inputs mlx-lm's settings name:
    hf_dataset's folders (instead of the data folder, which mlx-lm then does not read) and the
    resume_adapter_file a new run starts from."""
    settings = request.settings
    hf = hf_datasets.folders(settings.hf_dataset)
    start = start_adapters.shipment_of(settings.resume_adapter_file) if settings.resume_adapter_file else None
    data, model = shipments(request, data_read=not hf)
    steps, placed = sync.training_inputs(cluster, data, model, request.config, installed=request.installed)
    hf_dir = f"{cluster.head.work_dir}/data"
    steps += [(f"sync hf_dataset {folder.name} to {node.name}",
               sync.send(folder.shipment, node, f"{hf_dir}/hf/{folder.name}"))
              for node in cluster.training_nodes for folder in hf]
    start_dir = start_adapters.folder_on_nodes(cluster.head.work_dir, run_id)
    if start:  # every rank loads the weights it starts from
        steps += [(f"sync resume_adapter_file to {node.name}", sync.send(start, node, start_dir))
                  for node in cluster.training_nodes]
    flags = [*(hf_datasets.flag(hf_datasets.placed(settings.hf_dataset, hf, hf_dir)) if hf else []),
             *(["--resume-adapter-file", f"{start_dir}/{start.files[0]}"] if start else [])]
    controller_paths = {"hf_dataset": hf_datasets.on_controller(settings.hf_dataset) if hf else None,
            "resume_adapter_file": str(start.root / start.files[0]) if start else None}
    return JobInputs(steps, placed, flags, controller_paths, data)


def check_test_split(settings: FinetuneConfig, data: shipment.Shipment) -> None:
    """`test: true` needs a test split to evaluate on: the data folder's test.jsonl (every rank
    checks so too, but only once everything is sent), or each hf_dataset entry's test_split."""
    if not settings.test:
        return
    refused = run_settings.SettingsError
    if settings.hf_dataset:
        if missing := [i + 1 for i, entry in enumerate(hf_datasets.entries(settings.hf_dataset))
                       if not entry.get("test_split")]:
            raise refused(f"test: true, and hf_dataset entry {missing[0]} names no test_split to "
                          "evaluate on: give it one (test_split: test), or leave test out")
    elif shipment.TEST_SPLIT not in data.files:
        raise refused(f"test: true, and the data {shown(data.root)} has no {shipment.TEST_SPLIT} to evaluate "
                      "on: prepare it with a test split (invoke data.prepare ... --test-fraction 0.1), "
                      "or leave test out")


def run_record(cluster: Cluster, request: Request, inventory: str, backend: str, why: str,
               shares: batch_shares.Shares | None, launch: Sequence[str]) -> dict[str, Any]:
    """run.json as a run starts: what it trains on and how it is launched."""
    return {"inventory": inventory, "model": str(request.model.resolve()),
            # The model's identity, so that a resume with another --model is refused.
            "model_sha256": manifest_sha256(request.model.resolve()),
            "data": str(request.data.resolve()), "world_size": cluster.world_size,
            # As launched (a resume launches the same way); one rank alone runs directly.
            "backend": "mpi" if backend == "direct" else backend, "backend_why": why,
            "batch_shares": shares.shares if shares else None,
            "batch_shares_why": shares.why if shares else None,
            "batch_step_times": [round(t, 3) for t in shares.step_times] if shares else None,
            "parallel": request.parallel, "launch": shlex.join(launch)}


def shipments(request: Request, *, data_read: bool = True) -> tuple[shipment.Shipment, shipment.Shipment]:
    """The files of the data and of the model that go to the nodes, each checked (a default that a
    dry run has not made yet: the files it will have). An installed model goes nowhere, nor does
    data the run does not read (`data_read` false: hf_dataset's folders go instead)."""
    # Names first: a folder whose name cannot be one on the nodes is refused as such.
    sync.plain_name(request.data, "data")
    if not request.installed:
        sync.plain_name(request.model, "model")
    if not data_read:
        data = shipment.Shipment(request.data.resolve(), ())
    elif "data" in request.pending:
        data = shipment.Shipment(request.data.resolve(), inputs.DEMO_SPLITS)
    else:
        data = shipment.dataset(request.data)
    if request.installed:
        model = shipment.Shipment(request.model.resolve(), ())
    elif "model" in request.pending:
        model = shipment.Shipment(request.model.resolve(), (MODEL_FILES,))
    else:
        model = shipment.model(request.model)
    return data, model


# How a dry run shows the files of a model it has not fetched yet.
MODEL_FILES = "@MODEL_FILES@"


def pending_notes(request: Request) -> list[str]:
    """What a dry run says of the defaults it did not make."""
    notes = []
    if "data" in request.pending:
        notes.append(f"the data: the bundled pirate demo, prepared into {request.data} on first use")
    if "model" in request.pending:
        notes.append(f"{MODEL_FILES}: the files the manifest of {request.model} lists, once a run has "
                     f"fetched it ({request.model_source or 'SmolLM2-135M'})")
    return notes


def show(plan: Plan, notes: Sequence[str] = ()) -> None:
    """--dry-run: what the plan rests on (`notes`), then every command, in order."""
    for line in (*notes, *plan.notices):
        print(f"# {line}")
    sync.run_steps(plan.steps, dry_run=True)
    print(f"# launch on {plan.cluster.head.name}\n{shlex.join(plan.launch)}")
    print(f"# bring the results back\n{shlex.join(plan.pull)}")


def collect(plan: Plan, timeout: float | None = None) -> None:
    """Bring what the run wrote back to runs/<id> (rank 0's files, from the launcher)."""
    subprocess.run(plan.pull, cwd=REPO, capture_output=True, timeout=timeout,
                   stdin=subprocess.DEVNULL)


def diagnose(plan: Plan, relayed: relay.Relayed, oom_before: Mapping[str, int | None]) -> faults.Fault:
    """What stopped the run: its cause and node, from the launch's output and the nodes."""
    return faults.diagnose(plan.cluster, relayed.output, relayed.code, plan.request.parallel,
                           (oom_before, faults.oom_kills(plan.cluster)), relayed.frozen,
                           lambda: doctor.red_node_checks(plan.cluster, None),
                           (relayed.stuck, relayed.examined) if relayed.stuck else None)


def shares_line(shares: batch_shares.Shares) -> str:
    """What a run says of its shares: each rank's examples, why, each rank's expected step time
    against the fastest's (1.00 everywhere: exactly proportional), and the micro-batch caps."""
    line = f"batch shares {','.join(map(str, shares.shares))} ({shares.why})"
    if shares.step_times:
        times = ", ".join(f"{t:.2f}" for t in shares.step_times)
        line += f"; each rank's part of a step {times}x the fastest's"
    if any(shares.limits):
        caps = ", ".join(str(cap) if cap else "no limit" for cap in shares.limits)
        line += f"; at most {caps} examples at once (max_micro_batch)"
    return line


def execute(plan: Plan) -> Path:
    """Sync, launch on every slot, bring the results back: runs/<id>. Raises TrainFailed when
    training fails (what arrived is still kept in runs/<id>), Interrupted on Ctrl-C or SIGTERM."""
    synced = time.perf_counter()
    sync.run_steps(plan.steps, in_waves=True)  # each node's copies at once
    ranks = f"{plan.cluster.world_size} rank{'s' if plan.cluster.world_size > 1 else ''}"
    how = "one process, no launcher" if plan.backend == "direct" else plan.backend
    for line in plan.notices:
        if not (plan.backend == "direct" and line.startswith("backend ")):  # one process: no backend
            print(f"==> {line}", flush=True)
    print(f"==> {'resuming run ' + plan.run_id if plan.resume else 'training'} on {ranks} ({how}); "
          "rank 0 reports:", flush=True)
    info = {**plan.record, "status": "running", "exit_code": None, "wall_time_s": None,
            "sync_s": round(time.perf_counter() - synced, 1)}
    if plan.resume:
        before = runs.read_info(plan.results)
        attempts = before.get("attempts", 1)
        info["attempts"] = (attempts if isinstance(attempts, int) else 1) + 1
        if before.get("drained"):  # the nodes it went on without (mlxcluster/jobs/restarts.py)
            info["drained"] = before["drained"]
    runs.write_info(plan.results, info)
    oom_before = faults.oom_kills(plan.cluster)
    pulls = sync.CheckpointPulls(plan.cluster.head, plan.on_launcher, plan.results)
    start = time.perf_counter()
    try:
        with relay.terminated_as_interrupted():  # a `kill` stops every rank as Ctrl-C does
            relayed = relay.supervise(plan.cluster, plan.launch, plan.marker, on_line=pulls,
                                      liveness=(beats := Liveness.of_run(plan.cluster.world_size,
                                                                         plan.settings.stall_timeout)),
                                      examine=lambda: doctor.red_node_checks(plan.cluster, None))
    except KeyboardInterrupt:
        pulls.wait(timeout=10)
        with contextlib.suppress(subprocess.TimeoutExpired):
            collect(plan, timeout=30)  # what arrived, if it comes quickly
        runs.write_info(plan.results, info | {"status": "interrupted",
                                              "wall_time_s": round(time.perf_counter() - start, 1)})
        raise Interrupted(f"interrupted: every rank of run {plan.run_id} was stopped"
                          f"{runs.resume_hint(plan.results)}") from None
    pulls.wait()
    collect(plan)
    # summary.json is written last by rank 0, and each rank says how it ended: a launch that exits
    # 0 without them did not finish (mlx.launch has said 0 after a rank died: mlx #4319).
    unfinished = beats.unfinished()
    finished = relayed.code == 0 and (plan.results / "summary.json").exists() and not unfinished
    runs.write_info(plan.results, info | {"status": "finished" if finished else "failed",
                                          "exit_code": relayed.code,
                                          "wall_time_s": round(time.perf_counter() - start, 1)})
    if not finished:
        fault = (faults.unrecorded(plan.cluster, unfinished, beats.exit_codes())
                 if relayed.code == 0 and unfinished and not relayed.stuck
                 else diagnose(plan, relayed, oom_before))
        raise TrainFailed(f"training failed (exit {relayed.code}): {fault.why}", code=relayed.code or 1,
                          fault=fault, after=f"; what arrived is in {plan.results}"
                          f"{runs.resume_hint(plan.results)}")
    if plan.shares and plan.shares.step_times:
        runs.add_step_times(plan.results, plan.shares.step_times)
    if plan.planned:  # how good the plan was, rank by rank
        runs.add_to_summary(plan.results, lambda summary: {
            "ranks": of_run.ranks_record(plan.cluster, plan.planned, summary)})
    if not (plan.results / "loss.png").exists():
        # Nodes need no matplotlib: the controller draws the plot from the metrics.
        local.python_module("training.loop.report", [str(plan.results)])
    return plan.results


def launch_run(cluster: Cluster, request: Request, inventory: str, *, run_id: str | None = None,
               resume: bool = False) -> Path:
    """Plan and execute one run on `cluster` (or a sub-layout of it): its runs/<id>."""
    claimed = (runs.released_if_unstarted(runs.claim_id()) if run_id is None
               else contextlib.nullcontext(run_id))
    with claimed as own_id:
        the_plan = with_planned_peaks(plan(cluster, request, run_id=own_id, resume=resume,
                                           inventory=inventory))
    return execute(the_plan)


def train(inventory: str, options: Options) -> Path | None:
    """invoke train: a new run, or a resumed one, on the recorded cluster less the nodes left out;
    its runs/<id> (None: dry run, which also plans on a cluster not provisioned yet). A node's
    fault restarts it on the others (mlxcluster/jobs/restarts.py)."""
    rec, notes = preview.layout(inventory) if options.dry_run else (recorded(inventory), [])
    policy = restarts.Policy(restarts.DEFAULT_MAX_RESTARTS if options.max_restarts is None
                             else options.max_restarts, options.min_nodes or 1)
    resume_run, options = resumed(options)
    builder.checked_backend(options.backend)  # before any node is asked
    layout, left_out = restarts.layout(rec, dry_run=options.dry_run)  # a dry run checks no node
    notes += left_out
    policy.check_start(layout, rec.cluster)
    options = planning.resolved(layout, rec, options, probe=not options.dry_run)  # --parallel auto
    request = request_for(rec, options, fetch=not options.dry_run and not resume_run)
    if options.dry_run:  # it names the run it would start, and takes nothing
        the_plan = plan(layout, request, run_id=resume_run or runs.new_id(),
                        resume=resume_run is not None, inventory=rec.inventory)
        older = [f"note: {note}" for note in run_settings.older_names(request.config, request.overrides)]
        show(the_plan, [*notes, *pending_notes(request), *older])
        return None
    # A new run claims its folder (given back if the checks stop it); a resumed one has its own.
    claimed = (contextlib.nullcontext(resume_run) if resume_run
               else runs.released_if_unstarted(runs.claim_id()))
    with claimed as run_id:
        probed = probe_for_stages(layout, request, resume=resume_run is not None)
        the_plan = with_planned_peaks(plan(layout, request, run_id=run_id, resume=resume_run is not None,
                                           inventory=rec.inventory,
                                           memory=doctor.memory_of(probed) if probed else None))
        preflight(the_plan, probed)
    return restarts.run_with_restarts(
        the_plan, execute, policy,
        lambda current, left, fault, restart: restarted(rec, current, left, fault, options, policy, restart))


def probe_for_stages(cluster: Cluster, request: Request, resume: bool = False) -> dict[str, Any] | None:
    """The nodes' probes, before planning a run whose pipeline stages are sized from each node's
    free memory, or may be (a resumed pipeline run's, set by hand, on fewer ranks: stages.refitted);
    the preflight then judges the same probes (None: the plan needs none)."""
    sizes = stages.asks_memory(request.settings) or (resume and request.settings.parallel == "pipeline")
    return doctor.gather(cluster) if sizes else None


def with_planned_peaks(the_plan: Plan) -> Plan:
    """The plan with each rank's planned peak and a step's time under its own layout
    (mlxcluster/plan/of_run.py), which the preflight judges and summary.json keeps beside the
    measured ones."""
    shares, sized = the_plan.shares, the_plan.pipeline_stages
    return dataclasses.replace(the_plan, planned=of_run.plan_run(
        the_plan.cluster, the_plan.settings, the_plan.request.model, the_plan.request.data,
        the_plan.record.get("inventory", ""), shares=shares.shares if shares else None,
        limits=shares.limits if shares else None, stages=sized.counts if sized else None))


def preflight(the_plan: Plan, probed: Mapping[str, Any] | None = None) -> None:
    """The checks of the nodes a plan launches on (on `probed`, when the plan probed them), with
    the memory and disk its model needs: each rank's planned peak where the plan has them, else a
    pipeline stage's weights as the plan's settings give them."""
    cluster, request, settings = the_plan.cluster, the_plan.request, the_plan.settings
    counts = pipeline_layer_counts(settings) if settings.parallel == "pipeline" else None
    doctor.preflight(cluster, room.for_run(cluster, request.model, parallel=request.parallel,
                                           dequantize_ranks=the_plan.dequantize_ranks, stages=counts,
                                           stage_count=pipeline_stage_count(settings, cluster.world_size),
                                           peaks=the_plan.planned.peaks if the_plan.planned else None),
                     probed)


def restarted(rec: Recorded, current: Plan, left: Cluster, fault: faults.Fault, options: Options,
              policy: restarts.Policy, restart: int) -> Plan:
    """The plan that resumes `current`'s run on `left`, checked, with `fault.node` recorded as
    left out; a UserError when it cannot (the run never trained, the nodes left fail their
    checks, the model does not fit them)."""
    assert fault.cause is not None
    _, again = resumed(dataclasses.replace(options, resume=current.run_id, config=None, data=None,
                                            model=None))
    # One rank left of a tensor- or pipeline-parallel run holds the whole model: the same training
    # (every rank took the whole batch), as one process, if the model fits its node (preflight says).
    alone = current.request.parallel in ("tensor", "pipeline") and left.world_size == 1
    # The backend as asked for (auto: the choice for the nodes left), not the one run.json recorded.
    request = request_for(rec, dataclasses.replace(again, backend=options.backend,
                                                   parallel="data" if alone else again.parallel), fetch=False)
    probed = probe_for_stages(left, request, resume=True)
    the_plan = plan(left, request, run_id=current.run_id, resume=True, inventory=rec.inventory,
                    memory=doctor.memory_of(probed) if probed else None)
    if fault.goes_on_everywhere or fault.node is None:
        print(restarts.restart_everywhere_line(current.run_id, left, restart, policy), flush=True)
    else:
        entry = restarts.left_out(rec, current.run_id, fault.node, fault.cause, fault.why)
        print(restarts.restart_line(entry, left, restart, policy), flush=True)
    if alone:
        print(f"==> {left.training_nodes[0].name} alone holds the whole model: no {current.request.parallel} "
              "parallelism on one rank", flush=True)
    preflight(the_plan, probed)
    return the_plan
