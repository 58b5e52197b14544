"""Entry point: `invoke --list` shows what you can do.

Each task is a thin wrapper: the command lines are built in mlxcluster/ (tested there).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import datetime as dt
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
import typing
from pathlib import Path

from invoke.collection import Collection
from invoke.context import Context
from invoke.exceptions import Exit
from invoke.tasks import task

from mlxcluster import commands, lab, launch, runs, sync

REPO = Path(__file__).resolve().parent
VENV_BIN = Path(sys.executable).parent
INVENTORY_HELP = "Inventory file (default: cluster.inventory in invoke.yaml, the local machine)"


def _inventory(c: Context, inventory: str | None) -> str:
    path = Path(inventory or c.config.cluster.inventory)
    if not path.is_absolute():
        path = REPO / path
    if not path.exists():
        raise Exit(f"inventory {path} does not exist: pass -i/--inventory PATH "
                   "(see inventory/hosts.yml for an example)")
    return str(path)


def _run(c: Context, cmd: list[str], **kwargs: object) -> object:
    """Run with the venv's tools first on PATH, from the repo root (ansible.cfg applies)."""
    env = {"PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    with c.cd(str(REPO)):
        return c.run(commands.join(cmd), env=env, pty=sys.stdout.isatty(), **kwargs)


@task(help={"inventory": INVENTORY_HELP,
            "check": "Dry run: report what would change, change nothing",
            "diff": "Show file differences",
            "tags": "Only these plays, e.g. ssh,hostfile (see site.yml)",
            "limit": "Only these hosts"})
def provision(c, inventory=None, check=False, diff=False, tags=None, limit=None):
    """Provision every node of the inventory (ansible-playbook site.yml)."""
    inv = _inventory(c, inventory)
    _run(c, commands.provision(inv, check=check, diff=diff, tags=tags, limit=limit))


@task(help={"inventory": INVENTORY_HELP, "output": "Directory to write hostfile and hosts.json"})
def hostfile(c, inventory=None, output=None):
    """Render the Open MPI hostfile and MLX hosts.json from inventory, touching no host."""
    inv = _inventory(c, inventory)
    out = Path(output) if output else commands.build_dir_for(inv)
    _run(c, commands.render_hostfiles(inv, out))
    print(f"wrote {out / 'hostfile'} and {out / 'hosts.json'}")


def _ruff_targets() -> list[str]:
    return ["tasks.py", "mlxcluster", "training", "tests", "filter_plugins"]


@task
def lint(c):
    """Lint everything: ruff, yamllint, ansible-lint (production profile)."""
    _run(c, ["ruff", "check", *_ruff_targets()])
    _run(c, ["yamllint", "--strict", "."])
    _run(c, ["ansible-lint", "--profile", "production", "--offline"])


@task(help={"unit": "Only the fast unit tests (no root, no hosts)",
            "k": "Only tests matching this pytest -k expression",
            "lint_first": "Lint before testing (default yes)"})
def test(c, unit=False, k=None, lint_first=True):
    """Run the linters, the unit tests and the lab-cluster tests."""
    if lint_first:
        lint(c)
    cmd = ["pytest", "tests/unit"] if unit else ["pytest"]
    if k:
        cmd += ["-k", k]
    if not unit and os.geteuid() == 0:
        lab.prepare_offline_cache()
    _run(c, cmd)


# ---------------------------------------------------------------------------- lab

def _lab_call(fn, *args):
    try:
        return fn(*args)
    except lab.LabError as exc:
        raise Exit(f"lab: {exc}") from exc


@task(name="up", help={"nodes": "Number of hosts (1-9; existing ones are kept)",
                       "id": "Lab number 0-9 (default: lab.id in invoke.yaml)"})
def lab_up(c, nodes=None, id=None):
    """Bring up a lab cluster of real Debian hosts in network namespaces (root)."""
    lab_id = int(id if id is not None else c.config.lab.id)
    n = int(nodes or c.config.lab.nodes)
    _lab_call(lab.prepare_offline_cache)
    inventory = _lab_call(lab.up, n, lab_id)
    print(f"lab {lab_id}: {n} hosts up; inventory: {inventory}")
    print(f"provision it with: invoke provision -i {inventory}")


@task(name="down", help={"id": "Lab number 0-9"})
def lab_down(c, id=None):
    """Tear the lab cluster down, leaving nothing behind."""
    _lab_call(lab.down, int(id if id is not None else c.config.lab.id))


@task(name="status", help={"id": "Lab number 0-9"})
def lab_status(c, id=None):
    """Show the lab's hosts and inventory."""
    print(json.dumps(lab.status(int(id if id is not None else c.config.lab.id)), indent=2))


# -------------------------------------------------------------------------- bench

def _timed_playbook(cmd: list[str], env: dict[str, str]) -> tuple[float, dict, str]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise Exit(f"{commands.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}")
    return elapsed, commands.parse_recap(proc.stdout), proc.stdout


@task(name="provision", help={"nodes": "Lab hosts (default 3)", "id": "Lab number (default 8)",
                              "output": "JSON file to write (default runs/bench/...)"})
def bench_provision(c, nodes=3, id=8, output=None):
    """Time a first and an idempotent second site.yml run on a fresh lab cluster."""
    lab_id = int(id)
    _lab_call(lab.prepare_offline_cache)
    _lab_call(lab.down, lab_id)
    inventory = str(_lab_call(lab.up, int(nodes), lab_id))
    facts = Path(f"/tmp/mlx-bench-facts-{lab_id}")
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
           "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(facts)}
    try:
        cmd = commands.provision(inventory)
        first, recap1, _ = _timed_playbook(cmd, env)
        second, recap2, _ = _timed_playbook(cmd, env)
    finally:
        _lab_call(lab.down, lab_id)
    result = {
        "benchmark": "provision",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "nodes": int(nodes),
        "first_run_s": round(first, 1),
        "second_run_s": round(second, 1),
        "second_over_first": round(second / first, 3),
        "changed_first_run": sum(h["changed"] for h in recap1.values()),
        "changed_second_run": sum(h["changed"] for h in recap2.values()),
        "recap_second_run": recap2,
    }
    out = Path(output) if output else (
        REPO / "runs" / "bench" / f"provision-{dt.datetime.now():%Y%m%d-%H%M%S}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"wrote {out}")
    if result["changed_second_run"]:
        raise Exit("the second run changed something: provisioning is not idempotent")


# ------------------------------------------------------------------ data and model

DEMO_DATA = REPO / "training" / "data" / "pirate.jsonl"
MODELS = REPO / "models"


def _python_module(c: Context, module: str, args: list[str]) -> None:
    _run(c, [sys.executable, "-m", module, *args])


@task(name="prepare", help={
    "input": "Instruction data: .jsonl (dolly, alpaca or chat rows) or a .json list",
    "output": "Directory for train.jsonl / valid.jsonl (/ test.jsonl)",
    "valid_fraction": "Expected share of validation examples (0.2)",
    "test_fraction": "Expected share of test examples (0: none)",
    "seed": "Seed of the split (0)",
    "max_tokens": "Drop examples longer than this many tokens (needs --model)",
    "model": "Local model directory whose tokenizer counts tokens",
    "system_prompt": "System message for examples that have none"})
def data_prepare(c, input=str(DEMO_DATA), output="build/data/pirate", valid_fraction=0.2,
                 test_fraction=0.0, seed=0, max_tokens=None, model=None, system_prompt=None):
    """Turn instruction data into mlx-lm chat format, split deterministically."""
    args = ["--input", input, "--output", output, "--valid-fraction", str(valid_fraction),
            "--test-fraction", str(test_fraction), "--seed", str(seed)]
    if max_tokens:
        args += ["--max-tokens", str(max_tokens)]
    if model:
        args += ["--model", model]
    if system_prompt:
        args += ["--system-prompt", system_prompt]
    _python_module(c, "training.prepare", args)


def _default_model_dir(dtype: str) -> Path:
    return MODELS / f"smollm2-135m-{dtype}"


@task(name="fetch", help={
    "source": "Hugging Face repo id (org/name), a local model directory, or smollm2 (default)",
    "output": "Model directory on the controller (default models/<name>)",
    "dtype": "float16 or float32 (default: float32 on Linux, where 4-bit/16-bit matmul is slow)"})
def model_fetch(c, source="smollm2", output=None, dtype=None):
    """Get the model onto the controller once (invoke train fans it out to the nodes)."""
    dtype = dtype or ("float16" if sys.platform == "darwin" else "float32")
    out = Path(output) if output else (
        _default_model_dir(dtype) if source == "smollm2" else MODELS / Path(source).name)
    _python_module(c, "training.model", ["fetch", "--source", source, "--output", str(out),
                                         "--dtype", dtype])


# ------------------------------------------------------------------------- train

def _cluster(inv: str) -> tuple[launch.Cluster, Path]:
    build = commands.build_dir_for(inv)
    try:
        cluster = launch.Cluster.load(build / "cluster.json")
        launch.check_ready(cluster, (build / "hostfile").read_text())
    except (launch.LaunchError, FileNotFoundError) as exc:
        raise Exit(f"cannot launch: {exc}") from exc
    return cluster, build


def _data_and_model(c: Context, cluster: launch.Cluster, data: str | None, model: str | None,
                    fetch: bool = True) -> tuple[Path, Path]:
    """The data and model directories on the controller: the ones given, or the bundled pirate
    demo and SmolLM2 in the nodes' dtype, prepared or fetched on first use when `fetch`."""
    dtype = "float16" if all(n.os_family == "Darwin" for n in cluster.training_nodes) \
        else "float32"
    data_dir = Path(data) if data else REPO / "build" / "data" / "pirate"
    model_dir = Path(model) if model else _default_model_dir(dtype)
    if fetch:
        if data is None and not (data_dir / "train.jsonl").exists():
            data_prepare(c, output=str(data_dir))
        if model is None and not (model_dir / "config.json").exists():
            model_fetch(c, output=str(model_dir), dtype=dtype)
    return data_dir, model_dir


def _is_root(node: launch.Node) -> bool:
    user = (node.connection or {}).get("user")
    if (node.connection or {}).get("type") == "local" or user is None:
        return os.geteuid() == 0
    return user == "root"


def _step(c: Context, label: str, cmd: list[str], dry_run: bool) -> None:
    print(f"# {label}\n{commands.join(cmd)}" if dry_run else f"==> {label}", flush=True)
    if not dry_run and cmd[0] == "rsync" and ":" not in cmd[-1]:
        # To a local node: rsync's --rsync-path (which makes the destination) is not used.
        Path(cmd[-1]).mkdir(parents=True, exist_ok=True)
    if not dry_run:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            raise Exit(f"{label} failed ({proc.returncode}):\n{proc.stderr.strip()[-3000:]}")


def train_plan(cluster: launch.Cluster, *, run_id: str, data: Path, model: Path,
               config: Path | None, overrides: list[str], backend: str,
               interface: str | None, btl_tcp_links: int | None, threads: int | None = None,
               interactive: bool = False, resume: bool = False) -> tuple[list, list[str]]:
    """(sync steps, launch command) of one training run: plain data, printed by --dry-run.

    resume: continue run_id from its latest checkpoint; `config` is then the run's own config.yaml
    (flags given now must agree with it on what changes the training).
    """
    head = cluster.head
    paths = sync.node_paths(head)
    remote_data = f"{paths['work']}/data/{data.name}"
    remote_model = f"{paths['models']}/{model.name}"
    remote_run = f"{paths['runs']}/{run_id}"
    steps: list[tuple[str, list[str]]] = []
    for node, code in zip(cluster.training_nodes, sync.push_code(cluster, REPO / "training"),
                          strict=True):
        steps.append(code)
        steps.append((f"sync data to {node.name}", sync.push(data, node, remote_data)))
        if config:
            steps.append((f"sync config to {node.name}",
                          sync.push(config.parent, node, f"{paths['work']}/config",
                                    delete=False)))
    steps.append((f"copy the model to {head.name}", sync.push(model, head, remote_model)))
    for name, cmd in sync.fan_out(cluster, remote_model):
        steps.append((f"copy the model from {head.name} to {name} over the cluster link", cmd))
    for node in cluster.training_nodes:
        steps.append((f"verify the model's checksums on {node.name}",
                      sync.verify_model(cluster, node, remote_model)))
    program = ["python", "-m", "training.finetune",
               "--model", remote_model, "--data", remote_data, "--adapter-path", remote_run,
               "--expected-world-size", str(cluster.world_size)]
    if config:
        program[3:3] = ["--config", f"{paths['work']}/config/{config.name}"]
    if resume:
        program[5:5] = ["--resume"]
    program += overrides
    env = {"HF_HUB_OFFLINE": "1"}
    if not interactive:
        # Open MPI gives ranks a pty: without this rank 0 would draw a progress bar into a log.
        env["TTY_COMPATIBLE"] = "0"
    if threads:
        env["OPENBLAS_NUM_THREADS"] = str(threads)
    elif max(n.slots for n in cluster.training_nodes) > 1:
        env["OPENBLAS_NUM_THREADS"] = "1"  # several ranks share a machine's cores
    if backend == "ring":
        launcher_cmd = [f"{head.venv}/bin/mlx.launch", "--backend", "ring", "--hostfile",
                        f"{head.cluster_root}/hosts.json", "--cwd", paths["work"],
                        # mlx.launch can only pass fixed values, but each rank needs what its
                        # own env.sh sets (the venv first on PATH, OpenBLAS preloaded): so every
                        # rank runs bash, which sources env.sh and then execs the venv's python.
                        "--python", "bash"]
        for name, value in env.items():
            launcher_cmd += ["--env", f"{name}={value}"]
        launcher_cmd += ["--", "-c", f'. {shlex.quote(str(head.env_file))} && exec python "$@"',
                         *program]  # program[0] is "python": bash's $0
    elif cluster.world_size == 1 and head.slots == 1:
        # One rank on the launcher has nobody to talk to: run it directly. (Under `mpirun -np 1`
        # mlx-lm's trainer initializes MPI, which MLX never finalizes for a group of one, and
        # mpirun fails the job after training finished.)
        launcher_cmd = ["env", *(f"{k}={v}" for k, v in sorted(env.items())),
                        f"{head.venv}/bin/python", *program[1:]]
    else:
        program[0] = f"{head.venv}/bin/python"
        launcher_cmd = launch.mpirun_command(cluster, program, launch.MpiOptions(
            interface=interface, btl_tcp_links=btl_tcp_links, env=env,
            allow_run_as_root=_is_root(head), extra=["--wdir", paths["work"]]))
    line = launch.on_launcher(cluster, launcher_cmd, workdir=paths["work"])
    return steps, launch.ssh_command(head, line, tty=interactive)


@task(help={
    "inventory": INVENTORY_HELP,
    "config": "YAML training config (default training/configs/lora.yaml); flags below win",
    "data": "Prepared data directory (default: the bundled pirate demo, prepared on first use)",
    "model": "Model directory on the controller (default: SmolLM2-135M, fetched on first use)",
    "iters": "Optimizer steps",
    "batch_size": "GLOBAL batch size (divisible by the total slots)",
    "extra": "More training flags, e.g. \"--learning-rate 2e-4 --num-layers 4\"",
    "backend": "mpi (mpirun + hostfile, default) or ring (mlx.launch + hosts.json)",
    "interface": "Interface MPI traffic is pinned to (default: the Thunderbolt interface)",
    "btl_tcp_links": "TCP connections per peer for Open MPI (btl_tcp_links)",
    "threads": "BLAS threads per rank (default: all cores, or 1 when a node has several slots)",
    "resume": "Continue an interrupted run from its latest checkpoint: --resume (the latest "
              "unfinished run in runs/) or --resume=RUN_ID; its data, model and settings are kept",
    "dry_run": "Print every command and touch no host"}, optional=["resume"])
def train(c, inventory=None, config=None, data=None, model=None, iters=None, batch_size=None,
          extra="", backend=None, interface=None, btl_tcp_links=None, threads=None,
          resume=None, dry_run=False):
    """Fine-tune on the cluster: sync data, code and model, mpirun on every slot, fetch results."""
    if backend not in (None, "mpi", "ring"):
        raise Exit(f"--backend must be mpi or ring, not {backend!r}")
    inv = _inventory(c, inventory)
    cluster, _ = _cluster(inv)
    resume_run = None
    if resume:
        if config:
            raise Exit("--config and --resume do not go together: a resumed run keeps the "
                       "settings it was started with (change reporting and the like with --extra)")
        try:
            resume_run, info = runs.resumable(REPO / "runs", None if resume is True else str(resume))
        except runs.RunError as exc:
            raise Exit(str(exc)) from None
        data = data or info["data"]
        model = model or info["model"]
        backend = backend or info.get("backend")
        # Every rank reads the settings the run was started with: its config.yaml, which rank 0
        # wrote and which came back with the run's files, goes to every node like a --config.
        config = REPO / "build" / "resume" / f"{resume_run}.yaml"
        config.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(REPO / "runs" / resume_run / "config.yaml", config)
    config_path = Path(config).resolve() if config else None
    if config_path and not config_path.is_file():
        raise Exit(f"--config {config} does not exist")
    data_dir, model_dir = _data_and_model(c, cluster, data, model,
                                          fetch=not dry_run and not resume_run)
    for path, what in ((data_dir, "data"), (model_dir, "model")):
        if not dry_run and not path.is_dir():
            raise Exit(f"--{what} {path} is not a directory")
    if not dry_run:
        _preflight(cluster, _model_bytes(model_dir))
    overrides = shlex.split(extra)
    if iters:
        overrides += ["--iters", str(iters)]
    if batch_size:
        overrides += ["--batch-size", str(batch_size)]
    results = launch_training(
        c, cluster, inventory=inv, data_dir=data_dir, model_dir=model_dir, config=config_path,
        overrides=overrides, backend=backend or "mpi", interface=interface,
        btl_tcp_links=int(btl_tcp_links) if btl_tcp_links else None,
        threads=int(threads) if threads else None, dry_run=dry_run, resume_run=resume_run)
    if results:
        _print_run_summary(results)


def _stop_run(cluster: launch.Cluster, run_id: str) -> None:
    """Stop a run's launcher on the launcher node; it takes every rank down with it.

    Needed when ssh had no tty (output piped, CI): then closing ssh does not hang up the
    remote side, and mpirun would train on unattended.
    """
    pattern = f"(mpirun|mlx\\.launch|python) .*runs/{run_id}"
    try:
        subprocess.run(launch.ssh_command(cluster.head, f"pkill -TERM -f {shlex.quote(pattern)}"),
                       cwd=REPO, capture_output=True, timeout=20, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        print(f"warning: could not reach {cluster.head.name} to stop run {run_id} there: check "
              "for its processes (invoke doctor)", file=sys.stderr, flush=True)


def launch_training(c: Context, cluster: launch.Cluster, *, inventory: str, data_dir: Path,
                    model_dir: Path, config: Path | None, overrides: list[str], backend: str = "mpi",
                    interface: str | None = None, btl_tcp_links: int | None = None,
                    threads: int | None = None, dry_run: bool = False,
                    resume_run: str | None = None) -> Path | None:
    """Sync, launch on every slot of `cluster`, bring the results back: runs/<id> (None: dry run).

    resume_run: the id of a run to continue from its latest checkpoint, instead of a new run.
    Raises Exit when training fails; what arrived is still kept in runs/<id>.
    """
    run_id = resume_run or dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    steps, launch_cmd = train_plan(
        cluster, run_id=run_id, data=data_dir.resolve(), model=model_dir.resolve(),
        config=config, overrides=overrides, backend=backend, interface=interface,
        btl_tcp_links=btl_tcp_links, threads=threads,
        interactive=sys.stdin.isatty() and sys.stdout.isatty(), resume=resume_run is not None)
    synced = time.perf_counter()
    for label, cmd in steps:
        _step(c, label, cmd, dry_run)
    sync_s = round(time.perf_counter() - synced, 1)
    results = REPO / "runs" / run_id
    pull_cmd = sync.pull(cluster.head, f"{sync.node_paths(cluster.head)['runs']}/{run_id}",
                         results)
    if dry_run:
        print(f"# launch on {cluster.head.name}\n{commands.join(launch_cmd)}")
        print(f"# bring the results back\n{commands.join(pull_cmd)}")
        return None
    ranks = f"{cluster.world_size} rank{'s' if cluster.world_size > 1 else ''}"
    how = backend if cluster.world_size > 1 else "one process, no launcher"
    print(f"==> {'resuming run ' + run_id if resume_run else 'training'} on {ranks} ({how}); "
          "rank 0 reports:", flush=True)
    start = time.perf_counter()
    info = {"inventory": inventory, "model": str(model_dir.resolve()),
            "data": str(data_dir.resolve()), "world_size": cluster.world_size, "backend": backend,
            "status": "running", "exit_code": None, "wall_time_s": None, "sync_s": sync_s,
            "launch": commands.join(launch_cmd)}
    if resume_run:
        before = json.loads((results / "run.json").read_text())
        info["attempts"] = before.get("attempts", 1) + 1
    runs.write_info(results, info)
    def stop_stalled_run() -> None:
        print(f"==> a rank stalled and the launcher has not exited after {runs.STALL_GRACE:.0f} s: "
              f"stopping run {run_id} on {cluster.head.name}", flush=True)
        _stop_run(cluster, run_id)

    try:
        code, output = runs.relay(launch_cmd, REPO, on_stall=stop_stalled_run)
    except KeyboardInterrupt:
        _stop_run(cluster, run_id)
        with contextlib.suppress(subprocess.TimeoutExpired):  # what arrived, if it comes quickly
            subprocess.run(pull_cmd, cwd=REPO, capture_output=True, timeout=30,
                           stdin=subprocess.DEVNULL)
        runs.write_info(results, info | {"status": "interrupted",
                                         "wall_time_s": round(time.perf_counter() - start, 1)})
        raise Exit(f"interrupted: every rank of run {run_id} was stopped"
                   f"{runs.resume_hint(results)}", code=130) from None
    subprocess.run(pull_cmd, cwd=REPO, capture_output=True)
    # summary.json is written last by rank 0: mlx.launch exits 0 even when a rank failed.
    finished = code == 0 and (results / "summary.json").exists()
    runs.write_info(results, info | {"status": "finished" if finished else "failed",
                                     "exit_code": code,
                                     "wall_time_s": round(time.perf_counter() - start, 1)})
    if not finished:
        why = launch.describe_failure(cluster, output)
        if runs.STALL_MESSAGE.decode() in output:
            # A stall has a cause elsewhere (a node or link gone): the node checks name it.
            red = _red_node_checks(cluster, None)
            why += "; the nodes now: " + ("; ".join(f"{c.scope}: {c.name}: {c.detail}"
                                                    for c in red) if red else "all checks green")
        raise Exit(f"training failed (exit {code}): {why}; "
                   f"what arrived is in {results}{runs.resume_hint(results)}", code=code or 1)
    if not (results / "loss.png").exists():
        # Nodes need no matplotlib: the controller draws the plot from the metrics.
        _python_module(c, "training.report", [str(results)])
    return results


@task(help={"inventory": INVENTORY_HELP,
            "interface": "Interface MPI traffic is pinned to (default: the Thunderbolt interface)",
            "dry_run": "Print the commands and touch no host"})
def run(c, inventory=None, interface=None, dry_run=False):
    """Run any command on every slot with mpirun: invoke run -- CMD ARGS...

    The cluster's hostfile, interface pinning and env.sh apply as for invoke train, and the
    training code is synced first, so `invoke run -- python -m training.examples.logistic_regression`
    works on a freshly provisioned cluster. (invoke joins the words after --: quote within them.)
    """
    program = shlex.split(c.remainder)
    if not program:
        raise Exit("nothing to run: invoke run -- CMD ARGS...  (e.g. invoke run -- hostname)")
    cluster, _ = _cluster(_inventory(c, inventory))
    head = cluster.head
    paths = sync.node_paths(head)
    for label, cmd in sync.push_code(cluster, REPO / "training"):
        _step(c, label, cmd, dry_run)
    mpirun = launch.mpirun_command(cluster, program, launch.MpiOptions(
        interface=interface, allow_run_as_root=_is_root(head), extra=["--wdir", paths["work"]]))
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    cmd = launch.ssh_command(head, launch.on_launcher(cluster, mpirun, workdir=paths["work"]),
                             tty=interactive)
    if dry_run:
        print(f"# run on {head.name}\n{commands.join(cmd)}")
        return
    code = subprocess.run(cmd, cwd=REPO).returncode
    if code:
        raise Exit(code=code)


def _red_node_checks(cluster: launch.Cluster, model_bytes: int | None) -> list:
    """invoke doctor's per-node checks (not its MPI jobs) that fail."""
    from mlxcluster import doctor as checks

    build_hostfile = "\n".join(cluster.hostfile_lines())
    return [r for r in checks.diagnose(cluster, build_hostfile, model_bytes,
                                       root=_is_root(cluster.head), mpi_jobs=False) if not r.ok]


def _preflight(cluster: launch.Cluster, model_bytes: int | None) -> None:
    """invoke doctor's per-node checks (not its MPI jobs: the launch is one): stop on any red."""
    from rich.console import Console

    from mlxcluster import doctor as checks

    print("==> checking the nodes (invoke doctor has the full set)", flush=True)
    failed = _red_node_checks(cluster, model_bytes)
    if failed:
        checks.render(failed, Console(stderr=True))
        raise Exit(f"not launching: {len(failed)} check(s) failed on the nodes (see the fix column)")


def _model_bytes(model_dir: Path) -> int | None:
    if not model_dir.is_dir():
        return None
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) or None


@task(help={"inventory": INVENTORY_HELP,
            "model": "Model directory whose size memory and disk are checked against "
                     "(default: the embedded SmolLM2, when fetched)",
            "json": "Print the checks as JSON instead of tables"})
def doctor(c, inventory=None, model=None, json_=False):
    """Check the whole cluster, node by node and pair by pair: red checks say how to fix them."""
    from rich.console import Console

    from mlxcluster import doctor as checks

    inv = _inventory(c, inventory)
    build = commands.build_dir_for(inv)
    try:
        cluster = launch.Cluster.load(build / "cluster.json")
    except launch.LaunchError as exc:
        raise Exit(f"cannot check: {exc}") from exc
    hostfile_path = build / "hostfile"
    rendered = hostfile_path.read_text() if hostfile_path.exists() else ""
    start = time.perf_counter()
    model_dir = Path(model) if model else _default_model_dir(
        "float16" if all(n.os_family == "Darwin" for n in cluster.training_nodes) else "float32")
    results = checks.diagnose(cluster, rendered, _model_bytes(model_dir),
                              root=_is_root(cluster.head))
    console = Console()
    if json_:
        print(json.dumps([dataclasses.asdict(r) for r in results], indent=2))
    else:
        checks.render(results, console)
    failed = [r for r in results if not r.ok]
    summary = (f"{len(results) - len(failed)} of {len(results)} checks passed on "
               f"{len(cluster.nodes)} nodes in {time.perf_counter() - start:.1f} s")
    if failed:
        raise Exit(f"{summary}: {len(failed)} failed (see the fix column)")
    if json_:
        print(summary, file=sys.stderr)
    else:
        console.print(f"[green]{summary}[/]")


def _print_run_summary(results: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"run {results.name}", show_header=False)
    summary_file = results / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    for key, value in summary.items():
        if not isinstance(value, (dict, list)):
            table.add_row(key, str(value))
    for name in ("adapters.safetensors", "metrics.jsonl", "loss.png", "config.yaml"):
        table.add_row(name, str(results / name) if (results / name).exists() else "missing")
    Console().print(table)


def _latest_run() -> Path:
    run_dirs = sorted(p for p in (REPO / "runs").glob("2*") if (p / "summary.json").exists())
    if not run_dirs:
        raise Exit("no finished run in runs/: run invoke train first, or pass --adapter")
    return run_dirs[-1]


@task(help={"prompt": "What to ask", "adapter": "Run directory with adapters (default: latest)",
            "model": "Base model directory (default: the run's model)",
            "max_tokens": "Tokens to generate (default 120)"})
def generate(c, prompt, adapter=None, model=None, max_tokens=120):
    """Print the base model's and the fine-tuned model's answers side by side."""
    run = Path(adapter) if adapter else _latest_run()
    if model is None:
        info = run / "run.json"
        if not info.exists():
            raise Exit(f"{run} has no run.json: pass --model <base model directory>")
        model = json.loads(info.read_text())["model"]
    from training.generate import side_by_side

    side_by_side(Path(model), run, prompt, int(max_tokens))


# ------------------------------------------------------------------ training bench

def _on_node(node: launch.Node, line: str, timeout: float = 3600) -> str:
    """Run a shell line on a node (as invoke train reaches it); its stdout, or Exit."""
    proc = subprocess.run(launch.ssh_command(node, line), cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise Exit(f"on {node.name}: {line}\nfailed ({proc.returncode}):\n"
                   f"{(proc.stdout + proc.stderr).strip()[-3000:]}")
    return proc.stdout


def _single_process_summary(head: launch.Node, *, model: str, data: str, run: str, iters: int,
                            batch_size: int, preload_openblas: bool) -> dict:
    """Train without MPI on the launcher, with or without provisioning's OpenBLAS preload."""
    paths = sync.node_paths(head)
    program = ["python", "-m", "training.finetune", "--model", model, "--data", data,
               "--adapter-path", run, "--iters", str(iters), "--batch-size", str(batch_size),
               "--steps-per-report", "1", "--steps-per-eval", str(iters), "--val-batches", "1",
               "--save-every", str(iters)]
    # Stock mlx[cpu]: the same venv and command, only without the LD_PRELOAD env.sh adds.
    prefix = [] if preload_openblas else ["env", "-u", "LD_PRELOAD"]
    _on_node(head, launch.on_launcher(launch.Cluster(head.name, (head,)), [*prefix, *program],
                                      workdir=paths["work"]) + " </dev/null")
    return json.loads(_on_node(head, f"cat {shlex.quote(run)}/summary.json"))


def _pirate_scores(head: launch.Node, model: str, adapter: str | None) -> dict:
    paths = sync.node_paths(head)
    program = ["python", "-m", "training.pirate", "--model", model, "--max-tokens", "80"]
    if adapter:
        program += ["--adapter", adapter]
    return json.loads(_on_node(head, launch.on_launcher(
        launch.Cluster(head.name, (head,)), program, workdir=paths["work"])))


def _tokens_per_second(results: Path) -> float:
    return json.loads((results / "summary.json").read_text())["tokens_per_second"]


def _bench_scaling(c: Context, cluster: launch.Cluster, inventory: str, data_dir: Path,
                   model_dir: Path, iters: int, batch_size: int, rounds: int) -> dict:
    """tokens/s of the same run on 1 rank and on 2 (one per node), launched as invoke train does."""
    head = cluster.head
    one_rank = _first_nodes(cluster, 1)
    # Same global batch and steps; one BLAS thread per rank, so a rank is one core's work.
    overrides = ["--iters", str(iters), "--batch-size", str(batch_size), "--steps-per-report", "5",
                 "--steps-per-eval", str(iters), "--val-batches", "2", "--save-every", str(iters)]
    # Alternate the two so that a slow spell of the (shared) machine hits both alike.
    run_dirs: dict[str, list[Path]] = {"one_rank": [], "two_ranks": []}
    for _ in range(rounds):
        for name, layout in (("one_rank", one_rank), ("two_ranks", cluster)):
            run_dirs[name].append(launch_training(
                c, layout, inventory=inventory, data_dir=data_dir, model_dir=model_dir,
                config=None, overrides=overrides, threads=1))
    speeds = {name: [_tokens_per_second(r) for r in results] for name, results in run_dirs.items()}
    one, two = (sum(v) / len(v) for v in (speeds["one_rank"], speeds["two_ranks"]))
    # What this machine's cores give two independent single-threaded workers: the lab's nodes
    # share it, so this bounds the 2-over-1 ratio here (separate Macs share nothing). A short
    # snapshot: it varies from run to run as much as the machine's load does.
    probe = launch.on_launcher(
        cluster, ["env", "OPENBLAS_NUM_THREADS=1", "python", "-m", "training.matmul_probe"],
        workdir=sync.node_paths(head)["work"])
    alone = json.loads(_on_node(head, probe))["gflops"]
    with concurrent.futures.ThreadPoolExecutor() as pool:
        together = sum(json.loads(out)["gflops"] for out in pool.map(
            lambda node: _on_node(node, probe), cluster.training_nodes))
    return {
        "global_batch_size": batch_size, "iters": iters, "blas_threads_per_rank": 1,
        "rounds": rounds,
        "one_rank_tokens_per_second": round(one, 1),
        "two_ranks_tokens_per_second": round(two, 1),
        "two_over_one": round(two / one, 3),
        "two_over_one_per_round": [round(b / a, 3) for a, b in zip(
            speeds["one_rank"], speeds["two_ranks"], strict=True)],
        "target": 1.8,
        "matmul_gflops_one_node_alone": alone,
        "matmul_gflops_two_nodes_at_once": round(together, 2),
        "machine_ceiling_two_over_one": round(together / alone, 3),
        "runs": {n: [str(r) for r in rs] for n, rs in run_dirs.items()},
    }


def _bench_blas(head: launch.Node, model_dir: Path, data_dir: Path, iters: int,
                batch_size: int) -> dict:
    """tokens/s of one process on a node with provisioning's OpenBLAS, and without (stock)."""
    paths = sync.node_paths(head)
    speeds = {}
    for name, preload in (("openblas", True), ("stock_mlx_cpu", False)):
        print(f"==> BLAS: {iters} steps on {head.name} with {name}", flush=True)
        speeds[name] = _single_process_summary(
            head, model=f"{paths['models']}/{model_dir.name}",
            data=f"{paths['work']}/data/{data_dir.name}", run=f"{paths['runs']}/bench-{name}",
            iters=iters, batch_size=batch_size, preload_openblas=preload)["tokens_per_second"]
    return {
        "iters": iters, "batch_size": batch_size, "threads": "default (all cores)",
        "openblas_tokens_per_second": round(speeds["openblas"], 1),
        "stock_mlx_cpu_tokens_per_second": round(speeds["stock_mlx_cpu"], 1),
        "openblas_over_stock": round(speeds["openblas"] / speeds["stock_mlx_cpu"], 1),
        "target": 20,
    }


def _bench_quality(c: Context, cluster: launch.Cluster, inventory: str, data_dir: Path,
                   model_dir: Path, iters: int | None) -> dict:
    """The pirate fine-tune on 2 ranks, then base vs fine-tuned on the held-out prompts."""
    head = cluster.head
    paths = sync.node_paths(head)
    remote_model = f"{paths['models']}/{model_dir.name}"
    print("==> quality: the pirate fine-tune on 2 ranks", flush=True)
    tuned = launch_training(c, cluster, inventory=inventory, data_dir=data_dir,
                            model_dir=model_dir, config=None,
                            overrides=["--iters", str(iters)] if iters else [], threads=1)
    print("==> quality: base and fine-tuned answers to 20 held-out prompts", flush=True)
    base = _pirate_scores(head, remote_model, None)
    ft = _pirate_scores(head, remote_model, f"{paths['runs']}/{tuned.name}")
    (tuned / "pirate-base.json").write_text(json.dumps(base, indent=2) + "\n")
    (tuned / "pirate-fine-tuned.json").write_text(json.dumps(ft, indent=2) + "\n")
    return {
        "run": str(tuned), "summary": json.loads((tuned / "summary.json").read_text()),
        "base_mean_markers_per_answer": base["mean_markers_per_answer"],
        "fine_tuned_mean_markers_per_answer": ft["mean_markers_per_answer"],
        "base_answers_with_markers": base["answers_with_markers"],
        "fine_tuned_answers_with_markers": ft["answers_with_markers"],
        "prompts": base["answers"],
        "examples": [{"prompt": b["prompt"], "base": b["answer"], "fine_tuned": f["answer"]}
                     for b, f in zip(base["examples"][:3], ft["examples"][:3], strict=True)],
    }


def _first_nodes(cluster: launch.Cluster, count: int) -> launch.Cluster:
    """The cluster cut down to `count` training nodes, the launcher's first (the others get no
    slots): one of bench.scaling's configurations."""
    ordered = sorted(cluster.training_nodes, key=lambda n: n.name != cluster.head.name)
    keep = {n.name for n in ordered[:count]}
    return launch.Cluster(cluster.launcher, tuple(
        n if n.name in keep else dataclasses.replace(n, slots=0) for n in cluster.nodes))


@task(name="scaling", help={
    "inventory": INVENTORY_HELP,
    "nodes": "Node counts to run on, comma-separated (default: 1 and all of them, e.g. 1,3)",
    "iters": "Steps of each run (default 30)",
    "batch_size": "Global batch (default: the smallest multiple of every configuration's ranks "
                  "that is at least 4)",
    "data": "Prepared data directory (default: the bundled pirate demo)",
    "model": "Model directory on the controller (default: SmolLM2-135M)",
    "threads": "BLAS threads per rank (default: all cores, 1 when a node has several slots)",
    "extra": "More training flags for every run",
    "output": "JSON file to write; the PNG goes next to it (default runs/bench/scaling-<time>.json)"})
def bench_scaling(c, inventory=None, nodes=None, iters=30, batch_size=None, data=None, model=None,
                  threads=None, extra="", output=None):
    """The same fine-tune on 1 node and on more: wall time, tokens/s, speedup, efficiency and
    where the time went (sync, model load, training, evaluation), as a table, JSON and PNG."""
    from rich.console import Console

    from mlxcluster import scaling

    inv = _inventory(c, inventory)
    cluster, _ = _cluster(inv)
    available = len(cluster.training_nodes)
    try:
        counts = sorted({int(n) for n in str(nodes).split(",")}) if nodes else sorted({1, available})
    except ValueError:
        raise Exit(f"--nodes {nodes}: node counts separated by commas, e.g. 1,{available}") from None
    if counts[0] != 1 or counts[-1] > available:
        raise Exit(f"--nodes {nodes}: counts from 1 (the baseline) up to the {available} training "
                   "nodes of the inventory")
    layouts = {count: _first_nodes(cluster, count) for count in counts}
    if not batch_size:
        step = math.lcm(*(layout.world_size for layout in layouts.values()))
        batch_size = step * -(-4 // step)
    data_dir, model_dir = _data_and_model(c, cluster, data, model)
    _preflight(cluster, _model_bytes(model_dir))
    overrides = ["--iters", str(iters), "--batch-size", str(batch_size), "--steps-per-report", "5",
                 "--steps-per-eval", str(iters), "--save-every", str(iters), *shlex.split(extra)]
    rows, run_dirs = [], {}
    for count, layout in layouts.items():
        print(f"==> scaling: {iters} steps of global batch {batch_size} on {count} "
              f"node{'s' if count > 1 else ''}", flush=True)
        results = launch_training(c, layout, inventory=inv, data_dir=data_dir, model_dir=model_dir,
                                  config=None, overrides=overrides,
                                  threads=int(threads) if threads else None)
        assert results is not None
        run_dirs[count] = str(results)
        rows.append(scaling.row(count, layout.world_size,
                                json.loads((results / "summary.json").read_text()),
                                json.loads((results / "run.json").read_text())))
    rows = scaling.with_speedup(rows)
    title = f"{model_dir.name}: {iters} steps, global batch {batch_size}"
    out = Path(output) if output else (
        REPO / "runs" / "bench" / f"scaling-{dt.datetime.now():%Y%m%d-%H%M%S}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "scaling", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "inventory": inv, "model": str(model_dir), "data": str(data_dir), "iters": int(iters),
        "global_batch_size": int(batch_size), "host_cpus": os.cpu_count(), "rows": rows,
        "runs": run_dirs}, indent=2) + "\n")
    png = scaling.plot(rows, out.with_suffix(".png"), title)
    Console(width=max(Console().width, 120)).print(scaling.table(rows, title))
    print(f"wrote {out} and {png}")


@task(name="train", help={
    "id": "Lab number (default 8)",
    "iters": "Steps of each scaling run (default 30; 0 skips scaling)",
    "rounds": "Scaling rounds, each a 1-rank then a 2-rank run (default 2)",
    "batch_size": "Global batch of the scaling and BLAS runs (default 4, as in lora.yaml)",
    "blas_iters": "Steps of each BLAS run (default 3, as stock mlx[cpu] takes over a minute a "
                  "step; 0 skips BLAS)",
    "quality_iters": "Steps of the pirate fine-tune that quality is measured on "
                     "(default: the config's, 200; 0 skips quality)",
    "output": "JSON file to write (default runs/bench/train-<time>.json)"})
def bench_train(c, id=8, iters=30, rounds=2, batch_size=4, blas_iters=3, quality_iters=None,
                output=None):
    """Scaling (2 ranks over 1), BLAS (provisioned over stock mlx[cpu]) and pirate quality.

    Runs on a fresh 2-node lab cluster with SmolLM2-135M and the bundled pirate data.
    """
    lab_id = int(id)
    model_dir = _default_model_dir("float32")
    data_dir = REPO / "build" / "data" / "pirate"
    if not (data_dir / "train.jsonl").exists():
        data_prepare(c, output=str(data_dir))
    if not (model_dir / "config.json").exists():
        model_fetch(c, output=str(model_dir), dtype="float32")
    _lab_call(lab.prepare_offline_cache)
    _lab_call(lab.down, lab_id)
    inventory = str(_lab_call(lab.up, 2, lab_id))
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
           "ANSIBLE_CACHE_PLUGIN_CONNECTION": f"/tmp/mlx-bench-facts-{lab_id}"}
    result: dict = {"benchmark": "train", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                    "model": model_dir.name, "data": str(data_dir), "host_cpus": os.cpu_count()}
    try:
        print("==> provisioning a 2-node lab cluster", flush=True)
        _timed_playbook(commands.provision(inventory), env)
        cluster, _ = _cluster(inventory)
        if cluster.world_size != 2 or len(cluster.training_nodes) != 2:
            raise Exit(f"the lab should have one slot per node, not {cluster.hostfile_lines()}")
        if int(iters):
            result["scaling"] = _bench_scaling(c, cluster, inventory, data_dir, model_dir,
                                               int(iters), int(batch_size), int(rounds))
        if int(blas_iters):
            if not int(iters):  # the scaling runs put the model and data on the node
                launch_training(c, cluster, inventory=inventory, data_dir=data_dir,
                                model_dir=model_dir, config=None, overrides=["--iters", "1"])
            result["blas"] = _bench_blas(cluster.head, model_dir, data_dir, int(blas_iters),
                                         int(batch_size))
        if quality_iters is None or int(quality_iters):
            result["quality"] = _bench_quality(c, cluster, inventory, data_dir, model_dir,
                                               int(quality_iters) if quality_iters else None)
    finally:
        _lab_call(lab.down, lab_id)
    out = Path(output) if output else (
        REPO / "runs" / "bench" / f"train-{dt.datetime.now():%Y%m%d-%H%M%S}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    shown = {k: v for k, v in result.items() if k != "quality"}
    if "quality" in result:
        shown["quality"] = {k: v for k, v in result["quality"].items() if k != "summary"}
    print(json.dumps(shown, indent=2))
    print(f"wrote {out}")


def _links_launch(layout: launch.Cluster, cmd: list[str], tag: str,
                  timeout: float) -> tuple[int | None, str, str]:
    """One benchmark launch, its output shown as it comes but for rank 0's result line:
    (exit status, None on timeout; stdout; the output's tail). Interrupted or timed out, its
    ranks are stopped."""
    from mlxcluster import links

    proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    tail: collections.deque[str] = collections.deque(maxlen=200)
    stdout: list[str] = []

    # Both streams: mlx.launch runs remote ranks under ssh -tt, so their stderr arrives on stdout.
    def relay(stream: typing.IO[str] | None, sink: typing.TextIO, keep: list[str]) -> None:
        for line in stream or ():
            keep.append(line)
            if links.MARKER not in line:
                sink.write(line)
                sink.flush()
                tail.append(line)

    threads = [threading.Thread(target=relay, args=(proc.stdout, sys.stdout, stdout), daemon=True),
               threading.Thread(target=relay, args=(proc.stderr, sys.stderr, []), daemon=True)]
    for thread in threads:
        thread.start()
    code: int | None = None
    try:
        code = proc.wait(timeout)
    except (subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
        # Without a tty, ssh going away does not stop mpirun on the launcher: stop it there.
        subprocess.run(links.stop_command(layout, tag), cwd=REPO, capture_output=True,
                       timeout=30, stdin=subprocess.DEVNULL)
        proc.kill()
        if isinstance(exc, KeyboardInterrupt):
            raise Exit("interrupted: the benchmark was stopped on every node", code=130) from None
    for thread in threads:
        thread.join(timeout=10)
    return code, "".join(stdout), "".join(tail)


@task(name="links", help={
    "inventory": INVENTORY_HELP,
    "backends": "Comma-separated: mpi (mpirun + hostfile), ring (mlx.launch); default mpi,ring",
    "max_size": "Largest all-reduce, e.g. 4MB (default 256MB); caps the pair message (64MB) too",
    "output": "JSON file to write, the PNG goes next to it (default runs/bench/links-<time>.json)",
    "timeout": "Seconds each backend's run may take (default 900)"})
def bench_links(c, inventory=None, backends="mpi,ring", max_size="256MB", output=None,
                timeout=900):
    """Latency and bandwidth of every node pair, and all-reduce bandwidth, over the cluster link.

    One rank per node; pairs and all_sum sizes from 4 KB up, with each backend; slow or
    asymmetric links are flagged. Writes JSON and a PNG under runs/bench/.
    """
    from rich.console import Console

    from mlxcluster import links

    try:
        chosen, max_bytes = links.parse_backends(backends), links.parse_size(max_size)
        inv = _inventory(c, inventory)
        cluster, build = _cluster(inv)
        layout = links.one_rank_per_node(cluster)
    except links.LinkBenchError as exc:
        raise Exit(str(exc)) from exc
    for label, cmd in sync.push_code(layout, REPO / "training"):
        _step(c, label, cmd, dry_run=False)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    tag = f"links-{stamp}"
    docs = {}
    for backend in chosen:
        print(f"==> {backend}: pairs and all_sum up to {links.format_bytes(max_bytes)} on "
              f"{layout.world_size} nodes, one rank each", flush=True)
        cmd = links.launch_command(layout, backend, max_bytes=max_bytes, tag=tag,
                                   root=_is_root(cluster.head),
                                   envs=links.rendered_envs(build / "hosts.json"))
        code, stdout, tail = _links_launch(layout, cmd, tag, float(timeout))
        doc = links.extract(stdout)
        if code != 0 or doc is None:  # mlx.launch exits 0 even when a rank failed
            raise Exit(links.launch_failure(backend, code, tail, inv,
                                            [n.name for n in layout.training_nodes]), code=code or 1)
        docs[backend] = doc
    result = links.assemble(layout, docs, inventory=inv, max_bytes=max_bytes,
                            date=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"))
    out = Path(output) if output else REPO / "runs" / "bench" / f"links-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    png = links.plot(result, out.with_suffix(".png"))
    links.render(result, Console())
    print(f"wrote {out} and {png}")


lab_ns = Collection("lab", lab_up, lab_down, lab_status)
bench_ns = Collection("bench", bench_provision, bench_train, bench_links, bench_scaling)
data_ns = Collection("data", data_prepare)
model_ns = Collection("model", model_fetch)
ns = Collection(provision, hostfile, doctor, train, run, generate, lint, test,
                lab_ns, bench_ns, data_ns, model_ns)
ns.configure({"cluster": {"inventory": "inventory/local/hosts.yml"},
              "lab": {"id": 0, "nodes": 3}})
