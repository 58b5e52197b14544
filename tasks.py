"""Entry point: `invoke --list` shows what you can do.

Each task is a thin wrapper over a module of mlxcluster/ (where the command lines, plans and checks
live, and are tested). What a user can fix arrives here as a `UserError` and leaves as invoke's
`Exit` with its message, in one place: `_Task`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from invoke.collection import Collection
from invoke.context import Context
from invoke.exceptions import Exit
from invoke.tasks import Task
from invoke.tasks import task as invoke_task

from mlxcluster import devtools, local, paths
from mlxcluster.bench import calibrate as bench_calibrate_module
from mlxcluster.bench import faults as bench_faults_module
from mlxcluster.bench import links as bench_links_module
from mlxcluster.bench import overhead as bench_overhead_module
from mlxcluster.bench import provision as bench_provision_module
from mlxcluster.bench import rehearsal as bench_rehearsal_module
from mlxcluster.bench import scaling as bench_scaling_module
from mlxcluster.bench import serve as bench_serve_module
from mlxcluster.bench import shares as bench_shares_module
from mlxcluster.bench import tensor as bench_tensor_module
from mlxcluster.bench import train as bench_train_module
from mlxcluster.check import cabling
from mlxcluster.check import doctor as checkup
from mlxcluster.describe.cluster import recorded
from mlxcluster.errors import UserError
from mlxcluster.jobs import everywhere, flags
from mlxcluster.jobs import fuse as fusing
from mlxcluster.jobs import serve as serving
from mlxcluster.jobs import train as training
from mlxcluster.jobs.flags import SHARED_HELP, helps
from mlxcluster.jobs.request import Options
from mlxcluster.lab import cache, hosts, limits
from mlxcluster.launch import runs
from mlxcluster.launch.parallel import MODES
from mlxcluster.provision import ansible, inputs


class _Task(Task):
    """A task whose user errors end the program with their message and exit status."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except UserError as error:
            raise Exit(str(error) or None, code=error.code) from None


def task(*args: Any, **kwargs: Any) -> Any:
    return invoke_task(*args, klass=_Task, **kwargs)


def _inventory(c: Context, inventory: str | None) -> str:
    return paths.inventory_path(inventory or c.config.cluster.inventory)


def _lab_id(c: Context, given: str | int | None) -> int:
    return flags.whole_number(given if given is not None else c.config.lab.id, "--id", 0, 9) or 0


# Flags with a number default None, not the number: invoke would cast a bad value itself, with a
# traceback; mlxcluster/jobs/flags.py refuses it in one line instead. Their defaults are in their help.
_whole = flags.whole_number


# ------------------------------------------------------------------------- provisioning

@task(help=helps("inventory", check="Dry run: report what would change, change nothing",
                 diff="Show file differences", tags="Only these plays, e.g. ssh,hostfile (see site.yml)",
                 limit="Only these hosts"))
def provision(c, inventory=None, check=False, diff=False, tags=None, limit=None):
    """Provision every node of the inventory (ansible-playbook site.yml)."""
    local.run(ansible.provision(_inventory(c, inventory), check=check, diff=diff, tags=tags,
                                limit=limit))


@task(help=helps("inventory", output="Directory to write hostfile and hosts.json"))
def hostfile(c, inventory=None, output=None):
    """Render the Open MPI hostfile and MLX hosts.json from inventory, touching no host."""
    inv = _inventory(c, inventory)
    out = Path(output) if output else paths.build_dir_for(inv)
    local.run(ansible.render_hostfiles(inv, out))
    print(f"wrote {out / 'hostfile'} and {out / 'hosts.json'}")


@task(help=helps("inventory", output="Where to draw the cabling (default: build/<inventory>/topology.png)"))
def topology(c, inventory=None, output=None):
    """Read the Thunderbolt cabling from every Mac: print the thunderbolt_links block to paste
    into the inventory, and draw it."""
    cabling.run(_inventory(c, inventory), output)


@task(help=helps("inventory", model="Model directory whose size memory and disk are checked against "
                                   "(default: the provisioned model, else the embedded SmolLM2 when fetched)",
                 json="Print the checks as JSON instead of tables",
                 parallel="Check memory as a data (default) or tensor run would hold the model"))
def doctor(c, inventory=None, model=None, json_=False, parallel="data"):
    """Check the whole cluster, node by node and pair by pair: red checks say how to fix them."""
    checkup.run(recorded(_inventory(c, inventory), ready=False), model, as_json=json_, parallel=parallel)


# ---------------------------------------------------------------------------- training

@task(name="prepare", help={
    "input": "Instruction data: .jsonl (dolly, alpaca or chat rows) or a .json list",
    "output": "Directory for train.jsonl / valid.jsonl (/ test.jsonl)",
    "valid_fraction": "Expected share of validation examples (0.2)",
    "test_fraction": "Expected share of test examples (0: none)",
    "seed": "Seed of the split (0)",
    "max_tokens": "Drop examples longer than this many tokens (needs --model)",
    "model": "Local model directory whose tokenizer counts tokens",
    "system_prompt": "System message for examples that have none"})
def data_prepare(c, input=str(inputs.DEMO_DATA), output="build/data/pirate", valid_fraction=None,
                 test_fraction=None, seed=None, max_tokens=None, model=None, system_prompt=None):
    """Turn instruction data into mlx-lm chat format, split deterministically."""
    valid = flags.number(valid_fraction, "--valid-fraction", 0, 1)
    inputs.prepare_data(input, output, valid_fraction=0.2 if valid is None else valid,
                        test_fraction=flags.number(test_fraction, "--test-fraction", 0, 1) or 0.0,
                        seed=_whole(seed, "--seed", 0, 2**32 - 1) or 0,
                        max_tokens=_whole(max_tokens, "--max-tokens"), model=model,
                        system_prompt=system_prompt)


@task(name="fetch", help={
    "source": "Hugging Face repo id (org/name), a local model directory, or smollm2 (default)",
    "output": "Model directory on the controller (default models/<name>)",
    "dtype": "float16 or float32 for float weights (default: float32 on Linux, where 16-bit matmul is slow)",
    "dequantize": "Dequantize a quantized model to --dtype (default: keep it quantized; nodes whose "
                  "inventory says model_dequantize: true dequantize it at load)"})
def model_fetch(c, source=inputs.DEFAULT_MODEL, output=None, dtype=None, dequantize=False):
    """Get the model onto the controller once (invoke train fans it out to the nodes)."""
    inputs.fetch_model(source, output, dtype, dequantize=dequantize)


@task(help=helps(
    "inventory", "config", "data", "extra", "threads", "interface", "dry_run",
    model="Model directory on the controller, copied to the nodes (default: the model "
          "provisioning installed, only verified; else SmolLM2-135M, fetched on first use)",
    iters="Optimizer steps",
    batch_size="GLOBAL batch size (at least one example per rank; shared by batch_share)",
    backend="auto (default: jaccl on a full mesh of cables with RDMA, then jaccl-ring, ring, "
            "mpi on a bridge; says why), mpi, ring, jaccl or jaccl-ring",
    btl_tcp_links="TCP connections per peer for Open MPI (btl_tcp_links)",
    parallel="data (default: a whole model per rank) or tensor (each rank a shard of the model)",
    resume="Continue an interrupted run from its latest checkpoint: --resume (the latest "
           "unfinished run in runs/) or --resume=RUN_ID; its data, model and settings are kept",
    max_restarts="After a node's fault (killed, frozen, lost), leave it out and restart from the "
                 "latest checkpoint on the others, at most this many times (default 3; 0: never)",
    min_nodes="The fewest nodes a run starts or goes on with (default 1)"),
    optional=["resume"])
def train(c, inventory=None, config=None, data=None, model=None, iters=None, batch_size=None,
          extra="", backend=None, interface=None, btl_tcp_links=None, threads=None,
          parallel=None, resume=None, dry_run=False, max_restarts=None, min_nodes=None):
    """Fine-tune on the cluster: sync data, code and model, mpirun on every slot, fetch results."""
    results = training.train(_inventory(c, inventory), Options(
        config=config, data=data, model=model, iters=_whole(iters, "--iters"),
        batch_size=_whole(batch_size, "--batch-size"), extra=extra, backend=backend,
        interface=interface, btl_tcp_links=_whole(btl_tcp_links, "--btl-tcp-links", 1, 64),
        threads=_whole(threads, "--threads", 1, 1024), parallel=flags.one_of(parallel, "--parallel", MODES),
        resume=resume, dry_run=dry_run,
        max_restarts=_whole(max_restarts, "--max-restarts", 0, 100),
        min_nodes=_whole(min_nodes, "--min-nodes", 1, 1024)))
    if results:
        runs.print_summary(results, _inventory(c, inventory))


@task(help=helps("inventory", "interface", "dry_run",
                 ship="A folder of this machine to send to every node and run the command from",
                 backend="mpi (default: mpirun starts any program), ring, jaccl or jaccl-ring "
                         "(mlx.launch: Python programs only)"))
def run(c, inventory=None, interface=None, ship=None, backend=None, dry_run=False):
    """Run any command on every slot with mpirun: invoke run -- CMD ARGS...

    The cluster's hostfile, interface pinning, env.sh and the environment of training's ranks
    apply, and the training code is synced first, so `invoke run -- python -m
    training.examples.logistic_regression` works on a freshly provisioned cluster. A script the
    command names (python ./job.py) is sent to every node, as is --ship DIR; the words after --
    arrive as typed; every rank gets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and the like.
    --backend ring starts a Python program with mlx.launch instead, for MLX's own backends.
    """
    program = everywhere.program_of(sys.argv, c.remainder)
    everywhere.run(recorded(_inventory(c, inventory)).cluster, program, ship=Path(ship) if ship else None,
                   interface=flags.interface(interface), backend=backend, dry_run=dry_run)


@task(help=helps(
    "inventory", "threads", "dry_run",
    run="A run id (or folder) whose adapters to serve; again for more (default: the latest finished run)",
    model="Base model directory on the controller (default: the runs' own)",
    parallel="tensor (the base sharded across every node) or single (one process on the launcher); "
             "default: tensor if a run trained so, else single",
    host="Address the server listens on, on the launcher (default 127.0.0.1, reached from here "
         "through an ssh tunnel; another is warned about)",
    port="Port of the API, on the launcher and here (default 8080)",
    api_key_file="A file holding the key every request must send (Authorization: Bearer <key>)",
    max_tokens="Default max_tokens of a request (default 512)",
    batch="Batch the requests as mlx_lm.server does, adapters mixed in a batch (default); "
          "--no-batch: one at a time, each as mlx_lm generate answers it",
    backend="auto (default), mpi, ring, jaccl or jaccl-ring"), iterable=["run"])
def serve(c, inventory=None, run=None, model=None, parallel=None, host="127.0.0.1", port=None,
          api_key_file=None, max_tokens=None, batch=True, backend=None, threads=None, dry_run=False):
    """Serve what was trained behind an OpenAI-compatible API, across the cluster (Ctrl-C stops it)."""
    serving.serve(recorded(_inventory(c, inventory)), serving.Options(
        runs=tuple(run or ()), model=model, parallel=parallel, host=host,
        port=_whole(port, "--port", 1, 65535) or 8080, api_key_file=api_key_file,
        max_tokens=_whole(max_tokens, "--max-tokens", 1, 1_000_000) or 512, batch=batch, backend=backend,
        threads=_whole(threads, "--threads", 1, 1024), dry_run=dry_run))


@task(help={
    "run": "A run id (or folder) whose adapters to fuse (default: the latest finished run)",
    "model": "Base model directory on the controller (default: the run's own)",
    "output": "The fused model's folder (default: runs/<id>/fused; never written over)",
    "dequantize": "Write a quantized base's fused model in float",
    "gguf": "Also write model.gguf for llama.cpp (llama, mistral and mixtral models; float)",
    "by_file": "Fuse one file of weights at a time even where the model fits this machine's memory "
               "(default: only where it does not; stock mlx_lm fuse where it does)",
    "max_file_mb": "Weights per file when fusing file by file (default 1024)",
    "dry_run": "Say how it would fuse, fuse nothing"})
def fuse(c, run=None, model=None, output=None, dequantize=False, gguf=False, by_file=False,
         max_file_mb=None, dry_run=False):
    """Fuse a run's adapters into its base: a model folder that mlx_lm generate and mlx_lm.server load."""
    fusing.fuse(fusing.Options(run=run, model=model, output=output, dequantize=dequantize, gguf=gguf,
                               by_file=by_file, max_file_mb=_whole(max_file_mb, "--max-file-mb", 1, 1 << 20)
                               or 1024, dry_run=dry_run))


@task(help={"prompt": "What to ask", "adapter": "Run directory with adapters (default: latest)",
            "model": "Base model directory (default: the run's model)",
            "max_tokens": "Tokens to generate (default 120)"})
def generate(c, prompt, adapter=None, model=None, max_tokens=None):
    """Print the base model's and the fine-tuned model's answers side by side."""
    runs.side_by_side(prompt, adapter, model, _whole(max_tokens, "--max-tokens", 1, 100_000) or 120)


# ------------------------------------------------------------------------ development

@task
def lint(c):
    """Lint everything: ruff, yamllint, ansible-lint (production profile)."""
    devtools.lint()


@task(help={"unit": "Only the fast unit tests (no root, no hosts)",
            "k": "Only tests matching this pytest -k expression",
            "lint_first": "Lint before testing (default yes)"})
def test(c, unit=False, k=None, lint_first=True):
    """Run the linters, the unit tests and the lab-cluster tests."""
    if lint_first:
        devtools.lint()
    devtools.test(unit=unit, k=k)


@task(name="up", help={"nodes": "Number of hosts (1-9; existing ones are kept)",
                       "id": SHARED_HELP["id"],
                       "cables": "ring or mesh: cable the hosts point to point, like Macs "
                                 "(thunderbolt_topology: links), instead of one bridge"})
def lab_up(c, nodes=None, id=None, cables=None):
    """Bring up a lab cluster of real Debian hosts in network namespaces (root)."""
    lab_id, count = _lab_id(c, id), _whole(nodes or c.config.lab.nodes, "--nodes", 1, 9) or 1
    cache.prepare_offline_cache()
    inventory = hosts.up(count, lab_id, cables=cables)
    print(f"lab {lab_id}: {count} hosts up; inventory: {inventory}")
    print(f"provision it with: invoke provision -i {inventory}")


@task(name="down", help=helps("id"))
def lab_down(c, id=None):
    """Tear the lab cluster down, leaving nothing behind."""
    hosts.down(_lab_id(c, id))


@task(name="status", help=helps("id"))
def lab_status(c, id=None):
    """Show the lab's hosts and inventory."""
    print(json.dumps(hosts.status(_lab_id(c, id)), indent=2))


@task(name="limit", help={"node": "Node number", "id": SHARED_HELP["id"],
                          "cpu": "Percent of one core its processes may use, e.g. 30",
                          "memory": "Memory its processes may use, e.g. 1.5GB (no swap)",
                          "off": "Lift the node's limits"})
def lab_limit(c, node, id=None, cpu=None, memory=None, off=False):
    """Make a lab node slower or smaller (a control group over its processes), like a lesser Mac."""
    print(hosts.set_limits(hosts.Lab(_lab_id(c, id)), _whole(node, "--node", 1, 9) or 1,
                           flags.number(cpu, "--cpu", 1, 100 * 1024),
                           limits.parse_memory(memory) if memory else None, off))


# -------------------------------------------------------------------------- benchmarks

@task(name="provision", help=helps(
    "output", id=SHARED_HELP["lab"],
    nodes="Lab hosts, or several counts for a curve, e.g. 2,4,8 (default 3)",
    cables="ring or mesh: cable the hosts point to point, like Macs, instead of one bridge"))
def bench_provision(c, nodes=None, id=None, output=None, cables=None):
    """Time a first and an idempotent second site.yml run on a fresh lab cluster of each size."""
    bench_provision_module.run(flags.whole_numbers(nodes, "--nodes", 1, 9) or [3],
                               _whole(id, "--id", 0, 9) or 8, output,
                               cables=flags.one_of(cables, "--cables", ("ring", "mesh")))


@task(name="rehearsal", help=helps(
    "output", id=SHARED_HELP["lab"], nodes="Lab hosts (default 8)",
    cables="ring (default) or mesh: how the hosts are cabled, like Macs",
    steps="Steps of each training run (default 3)"))
def bench_rehearsal(c, nodes=None, cables=None, steps=None, id=None, output=None):
    """A fresh lab cabled like Macs, from nothing to training as a new user goes: provision twice,
    doctor, train, --backend mpi, and tensor parallelism on every node against one process."""
    bench_rehearsal_module.run(_whole(nodes, "--nodes", 2, 9) or 8,
                               flags.one_of(cables, "--cables", ("ring", "mesh")) or "ring",
                               _whole(id, "--id", 0, 9) or 8, _whole(steps, "--steps", 1) or 3, output)


@task(name="train", help={
    "id": SHARED_HELP["lab"],
    "iters": "Steps of each scaling run (default 30; 0 skips scaling)",
    "rounds": "Scaling rounds, each a 1-rank then a 2-rank run (default 2)",
    "batch_size": "Global batch of the scaling and BLAS runs (default 4, as in lora.yaml)",
    "blas_iters": "Steps of each BLAS run (default 3, as stock mlx[cpu] takes over a minute a "
                  "step; 0 skips BLAS)",
    "quality_iters": "Steps of the pirate fine-tune that quality is measured on "
                     "(default: the config's, 40; 0 skips quality)",
    "overhead_iters": "Steps of each overhead run, ours and stock mlx_lm lora (default 40; 0 "
                      "skips the overhead comparison)",
    "overhead_rounds": "Overhead rounds, each our run then stock's (default 2)",
    "data": SHARED_HELP["data"],
    "model": "Model directory (default: SmolLM2-135M in float32, fetched on first use)",
    "output": SHARED_HELP["output"]})
def bench_train(c, id=None, iters=None, rounds=None, batch_size=None, blas_iters=None, quality_iters=None,
                overhead_iters=None, overhead_rounds=None, data=None, model=None, output=None):
    """Scaling (2 ranks over 1), BLAS, pirate quality and overhead over stock mlx-lm.

    Runs on a fresh 2-node lab cluster with SmolLM2-135M and the bundled pirate data.
    """
    def count(value: str | None, flag: str, default: int, minimum: int = 0) -> int:
        read = _whole(value, flag, minimum)
        return default if read is None else read

    parts = bench_train_module.Parts(
        iters=count(iters, "--iters", 30), rounds=count(rounds, "--rounds", 2, 1),
        batch_size=count(batch_size, "--batch-size", 4, 1), blas_iters=count(blas_iters, "--blas-iters", 3),
        quality_iters=_whole(quality_iters, "--quality-iters", 0),
        overhead_iters=count(overhead_iters, "--overhead-iters", 40),
        overhead_rounds=count(overhead_rounds, "--overhead-rounds", 2, 1))
    bench_train_module.run(lab_id=count(id, "--id", 8), parts=parts, data=data, model=model, output=output)


@task(name="overhead", help=helps(
    "inventory", "data", output="JSON file to write (default runs/bench/overhead-<time>.json)",
    model="Model directory (default: SmolLM2-135M in the nodes' dtype, fetched on first use)",
    iters="Steps of each run (default 40; at least 15)",
    rounds="Rounds per fine-tune type, each our run then stock's (default 3: a median that "
           "a slow spell in one round does not move)",
    types="Fine-tune types, comma-separated (default lora,dora,full)"))
def bench_overhead(c, inventory=None, iters=None, rounds=None, types=None, data=None, model=None,
                   output=None):
    """Ours against stock `mlx_lm lora` on the launcher, both given one config file per fine-tune
    type: tokens/s of each, ours over stock (target 0.97x) and the losses report by report."""
    bench_overhead_module.run(recorded(_inventory(c, inventory)), iters=_whole(iters, "--iters") or 40,
                              rounds=_whole(rounds, "--rounds") or 3, types=types, data=data, model=model,
                              output=output)


@task(name="links", help={
    "inventory": SHARED_HELP["inventory"],
    "backends": "Comma-separated: mpi, ring, jaccl, jaccl-ring; default mpi,ring on a bridge, "
                "the training backend on per-cable networks",
    "max_size": "Largest all-reduce, e.g. 4MB (default 256MB); caps the pair message (64MB) too",
    "output": SHARED_HELP["output"],
    "timeout": "Seconds each backend's run may take (default 900)"})
def bench_links(c, inventory=None, backends=None, max_size="256MB", output=None,
                timeout=None):
    """Latency and bandwidth of every node pair, and all-reduce bandwidth, over the cluster link.

    One rank per node; pairs and all_sum sizes from 4 KB up, with each backend; slow or
    asymmetric links are flagged. Writes JSON and a PNG under runs/bench/.
    """
    bench_links_module.run(recorded(_inventory(c, inventory)), backends=backends,
                           max_size=max_size, output=output,
                           timeout=flags.number(timeout, "--timeout", 1, 86400) or 900.0)


def _runs(c: Context, inventory: str | None, iters: str | None, batch_size: str | None, threads: str | None,
          **rest: Any) -> tuple[Any, dict[str, Any]]:
    """The recorded cluster and the options every training benchmark reads alike."""
    return recorded(_inventory(c, inventory)), {
        "iters": _whole(iters, "--iters") or 30, "batch_size": _whole(batch_size, "--batch-size"),
        "threads": _whole(threads, "--threads", 1, 1024), **rest}


@task(name="scaling", help=helps(
    "inventory", "nodes", "iters", "batch_size", "data", "model", "threads", "extra", "output",
    parallel="How the runs on more than 1 node split the work: data, tensor, or data,tensor for both "
             "(default data; the 1-node baseline runs once)",
    stock="Also run stock mlx_lm lora as one process on the first node, same model, data and settings"))
def bench_scaling(c, inventory=None, nodes=None, iters=None, batch_size=None, data=None, model=None,
                  threads=None, extra="", output=None, parallel=None, stock=False):
    """The same fine-tune on 1 node and on more: wall time, tokens/s, speedup, efficiency, peak
    memory per rank and where the time went (sync, model load, training, evaluation), as a table,
    JSON and PNG; with --stock, stock mlx_lm lora on one process beside them."""
    rec, common = _runs(c, inventory, iters, batch_size, threads, data=data, model=model, extra=extra,
                        output=output)
    bench_scaling_module.run(rec, nodes=nodes, parallel=parallel, stock=bool(stock), **common)


@task(name="shares", help=helps("inventory", "iters", "batch_size", "data", "model", "threads", "extra",
                                "output"))
def bench_shares(c, inventory=None, iters=None, batch_size=None, data=None, model=None, threads=None,
                 extra="", output=None):
    """On a mixed cluster: each node alone (a calibration), then every node with equal and with
    calibrated batch shares; the steps' time and the nodes' idle time, as a table and JSON."""
    rec, common = _runs(c, inventory, iters, batch_size, threads, data=data, model=model, extra=extra,
                        output=output)
    bench_shares_module.run(rec, **common)


@task(name="tensor", help=helps("inventory", "iters", "batch_size", "data", "model", "threads", "extra",
                                "output", nodes="Nodes holding a shard (default: every training node)"))
def bench_tensor(c, inventory=None, nodes=None, iters=None, batch_size=None, data=None, model=None,
                 threads=None, extra="", output=None):
    """One process holding the whole model, then every node holding a shard (--parallel tensor):
    peak memory per rank and the time of a step, as a table, JSON and PNG."""
    rec, common = _runs(c, inventory, iters, batch_size, threads, data=data, model=model, extra=extra,
                        output=output)
    bench_tensor_module.run(rec, nodes=nodes, **common)


@task(name="serve", help=helps(
    "inventory", "threads",
    nodes="Layouts, e.g. 1,2,3: 1 is one process on the launcher, more is tensor-parallel across that "
          "many nodes (default: 1 to every training node)",
    model="Model directory on the controller (default: the one provisioning installed, else SmolLM2)",
    requests="Requests per load, at 1 and at 4 at once (default 8)",
    max_tokens="Tokens per answer (default 64)",
    port="Port of the servers, on the launcher and here (default 18080)",
    stock="Stock mlx_lm.server on the same ranks too (default; --no-stock leaves it out)",
    rounds="Rounds, each server started afresh, the programs alternating; medians reported (default 1)",
    output="JSON path (default runs/bench/serve-<time>.json)"))
def bench_serve(c, inventory=None, nodes=None, model=None, requests=None, max_tokens=None, port=None,
                threads=None, stock=True, rounds=None, output=None):
    """Our server against stock mlx_lm.server: time to first token, tokens/s at 1 and 4 requests at
    once, each rank's peak memory; one process, then tensor-parallel."""
    bench_serve_module.run(recorded(_inventory(c, inventory)), nodes=nodes, model=model,
                           requests=_whole(requests, "--requests", 1, 1000) or 8,
                           max_tokens=_whole(max_tokens, "--max-tokens", 1, 100_000) or 64,
                           port=_whole(port, "--port", 1, 65535) or 18080,
                           threads=_whole(threads, "--threads", 1, 1024), stock_too=stock,
                           rounds=_whole(rounds, "--rounds", 1, 100) or 1, output=output)


@task(name="calibrate", help=helps(
    "inventory", "data", "model", "extra", "output",
    iters="Steps on each node (default 10)",
    batch_size="The training run's global batch (default: the config's); each node runs its equal share",
    config="YAML training config the runs will use (its max_seq_length keys the calibration)",
    threads="BLAS threads (default: all cores)"))
def bench_calibrate(c, inventory=None, iters=None, batch_size=None, data=None, model=None, config=None,
                    threads=None, extra="", output=None):
    """Each node's tokens/s and peak memory at this fine-tune, alone, one node after the other:
    kept in build/<inventory>/calibration.json for batch_share: auto."""
    bench_calibrate_module.run(recorded(_inventory(c, inventory)), iters=_whole(iters, "--iters") or 10,
                               batch_size=_whole(batch_size, "--batch-size"), data=data, model=model,
                               config=config, threads=_whole(threads, "--threads", 1, 1024), extra=extra,
                               output=output)


@task(name="faults", help=helps(
    "output", id=SHARED_HELP["lab"], nodes="Lab hosts (default 3)",
    iters="Steps of each run (default 40)", save_every="Steps between checkpoints (default 10)",
    faults="Which, comma-separated: kill, freeze, unplug, disk, controller (default: all)",
    parallel="data (default) or tensor: the stand-in model sharded across the nodes, then the nodes left",
    shares="A batch_share weight per node, comma-separated (mixed Macs), e.g. 3,3,1,1"))
def bench_faults(c, nodes=None, iters=None, save_every=None, faults=None, id=None, output=None,
                 parallel=None, shares=None):
    """A fresh lab; a run per fault on its last node (or the controller), a few steps after a
    checkpoint: time to training again, steps lost, adapters against an uninterrupted run's."""
    bench_faults_module.run(_whole(nodes, "--nodes", 2, 9) or 3, _whole(id, "--id", 0, 9) or 8,
                            _whole(iters, "--iters") or 40, _whole(save_every, "--save-every") or 10,
                            faults.split(",") if faults else bench_faults_module.FAULTS, output,
                            flags.one_of(parallel, "--parallel", MODES) or "data",
                            flags.whole_numbers(shares, "--shares") or ())


ns = Collection(provision, hostfile, topology, doctor, train, run, serve, fuse, generate, lint, test,
                Collection("lab", lab_up, lab_down, lab_status, lab_limit),
                Collection("bench", bench_provision, bench_rehearsal, bench_train, bench_overhead,
                           bench_links, bench_scaling, bench_shares, bench_tensor, bench_calibrate,
                           bench_serve, bench_faults),
                Collection("data", data_prepare), Collection("model", model_fetch))
ns.configure({"cluster": {"inventory": paths.DEFAULT_INVENTORY},
              "lab": {"id": 0, "nodes": 3}})
