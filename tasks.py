"""Entry point: `invoke --list` shows what you can do.

Each task is a thin wrapper over a module of mlxcluster/ (where the command lines, plans and checks
live, and are tested); the bench.* tasks are in bench_tasks.py. A flag's help, default and reader
are said once, in the task's `Flags`, and its body gets the values read. What a user can fix
arrives here as a `UserError` and leaves as invoke's `Exit` with its message, in one place: `task`
(mlxcluster/jobs/flags.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from invoke.collection import Collection
from invoke.context import Context

import bench_tasks
from mlxcluster import devtools, local, paths
from mlxcluster.check import cabling
from mlxcluster.check import doctor as checkup
from mlxcluster.describe.cluster import recorded
from mlxcluster.jobs import everywhere, flags, restarts
from mlxcluster.jobs import fuse as fusing
from mlxcluster.jobs import plan as planning
from mlxcluster.jobs import serve as serving
from mlxcluster.jobs import train as train_job
from mlxcluster.jobs.flags import SHARED_HELP, Flags, choice, helps, real, task, whole
from mlxcluster.jobs.request import Options
from mlxcluster.lab import cache, hosts, limits
from mlxcluster.launch import runs
from mlxcluster.launch.parallel import MODES
from mlxcluster.provision import ansible, inputs

_inventory = flags.inventory_of


def _lab_id(c: Context, given: str | int | None) -> int:
    return flags.whole_number(given if given is not None else c.config.lab.id, "--id", 0, 9) or 0


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
                 parallel="Check memory as a data (default), tensor or pipeline run would hold the model"))
def doctor(c, inventory=None, model=None, json_=False, parallel="data"):
    """Check the whole cluster, node by node and pair by pair: red checks say how to fix them."""
    checkup.run(recorded(_inventory(c, inventory), ready=False), model, as_json=json_, parallel=parallel)


# ---------------------------------------------------------------------------- training

@task(name="prepare", flags=Flags(
    input=f"Instruction data: .jsonl ({inputs.DATA_FORMATS} rows) or a .json list",
    output="Directory for train.jsonl / valid.jsonl (/ test.jsonl)",
    valid_fraction=real("Expected share of validation examples ({default})", 0.2, 0, 1),
    test_fraction=real("Expected share of test examples ({default}: none)", 0.0, 0, 1),
    seed=whole("Seed of the split ({default})", 0, 0, 2**32 - 1),
    max_tokens=whole("Drop examples longer than this many tokens (needs --model)"),
    model="Local model directory whose tokenizer counts tokens",
    system_prompt="System message for examples that have none"))
def data_prepare(c, input=str(inputs.DEMO_DATA), output="build/data/pirate", valid_fraction=None,
                 test_fraction=None, seed=None, max_tokens=None, model=None, system_prompt=None):
    """Turn instruction data into mlx-lm chat format, split deterministically."""
    inputs.prepare_data(input, output, valid_fraction=valid_fraction, test_fraction=test_fraction, seed=seed,
                        max_tokens=max_tokens, model=model, system_prompt=system_prompt)


@task(name="fetch", help={
    "source": "Hugging Face repo id (org/name), a local model directory, or smollm2 (default)",
    "output": "Model directory on the controller (default models/<name>)",
    "dtype": "float16 or float32 for float weights (default: float32 on Linux, where 16-bit matmul is slow)",
    "dequantize": "Dequantize a quantized model to --dtype (default: keep it quantized; nodes whose "
                  "inventory says model_dequantize: true dequantize it at load)"})
def model_fetch(c, source=inputs.DEFAULT_MODEL, output=None, dtype=None, dequantize=False):
    """Get the model onto the controller once (invoke train fans it out to the nodes)."""
    inputs.fetch_model(source, output, dtype, dequantize=dequantize)


@task(flags=Flags(
    "inventory", "config", "data", "extra", "threads", "interface", "dry_run",
    model="Model directory on the controller, copied to the nodes (default: the model "
          "provisioning installed, only verified; else SmolLM2-135M, fetched on first use)",
    iters=whole("Optimizer steps"),
    batch_size=whole("GLOBAL batch size (at least one example per rank; shared by batch_share)"),
    backend="auto (default: jaccl on a full mesh of cables with RDMA, then jaccl-ring, ring, "
            "mpi on a bridge; says why), mpi, ring, jaccl or jaccl-ring",
    btl_tcp_links=whole("TCP connections per peer for Open MPI (btl_tcp_links)", None, 1, 64),
    parallel=choice("data (default: a whole model per rank), tensor (each rank a shard of every layer), "
                    "pipeline (each rank a stage of whole layers) or auto (the layout invoke plan picks)",
                    (*MODES, planning.AUTO)),
    resume="Continue an interrupted run from its latest checkpoint: --resume (the latest "
           "unfinished run in runs/) or --resume=RUN_ID; its data, model and settings are kept",
    max_restarts=whole("After a node's fault (killed, frozen, lost), leave it out and restart from the "
                       "latest checkpoint on the others, at most this many times (default {default}; 0: "
                       "never)", restarts.DEFAULT_MAX_RESTARTS, 0, 100),
    min_nodes=whole("The fewest nodes a run starts or goes on with (default {default})", 1, 1, 1024)),
    optional=["resume"])
def train(c, inventory=None, config=None, data=None, model=None, iters=None, batch_size=None,
          extra="", backend=None, interface=None, btl_tcp_links=None, threads=None,
          parallel=None, resume=None, dry_run=False, max_restarts=None, min_nodes=None):
    """Fine-tune on the cluster: sync data, code and model, mpirun on every slot, fetch results."""
    results = train_job.train(_inventory(c, inventory), Options(
        config=config, data=data, model=model, iters=iters, batch_size=batch_size, extra=extra,
        backend=backend, interface=interface, btl_tcp_links=btl_tcp_links, threads=threads,
        parallel=parallel, resume=resume, dry_run=dry_run, max_restarts=max_restarts, min_nodes=min_nodes))
    if results:
        runs.print_summary(results, _inventory(c, inventory))


@task(flags=Flags(
    "inventory", "config", "data", "extra",
    model="Model directory on the controller (default: the model provisioning installed, else SmolLM2)",
    batch_size=whole("GLOBAL batch size (default: the config's)"),
    json="Print the plan as JSON instead of tables"))
def plan(c, inventory=None, config=None, data=None, model=None, batch_size=None, extra="", json_=False):
    """Will it fit, and how: each layout's memory per node at its peak, the pick and why, the
    largest batch and longest sequence each fits, the pick's peak per rank term by term."""
    planning.run(recorded(_inventory(c, inventory)), Options(
        config=config, data=data, model=model, batch_size=batch_size, extra=extra), as_json_output=json_)


@task(help=helps("inventory", "interface", "dry_run",
                 ship="A folder of this machine whose files go to every node, to run the command from "
                      "(never its hidden files, keys, tokens or links out of it)",
                 backend="mpi (default: mpirun starts any program), ring, jaccl or jaccl-ring "
                         "(mlx.launch: Python programs only)"))
def run(c, inventory=None, interface=None, ship=None, backend=None, dry_run=False):
    """Run any command on every slot with mpirun: invoke run -- CMD ARGS...

    The cluster's hostfile, interface pinning, env.sh and the environment of training's ranks
    apply, and the training code is synced first, so `invoke run -- python -m
    training.examples.logistic_regression` works on a freshly provisioned cluster. A script the
    command names (python ./job.py) is sent to every node, as are the files of --ship DIR (never
    its hidden files, keys, tokens nor links out of it: a line names what was left out); the words
    after -- arrive as typed; every rank gets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and the like.
    --backend ring starts a Python program with mlx.launch instead, for MLX's own backends.
    """
    program = everywhere.program_of(sys.argv, c.remainder)
    everywhere.run(recorded(_inventory(c, inventory)), program, ship=Path(ship) if ship else None,
                   interface=flags.interface(interface), backend=backend, dry_run=dry_run)


@task(flags=Flags(
    "inventory", "threads", "dry_run",
    run="A run id (or folder) whose adapters to serve; again for more (default: the latest finished run)",
    model="Base model directory on the controller (default: the runs' own)",
    parallel="tensor (the base sharded across every node), pipeline (a stage of whole layers per rank) "
             "or single (one process on the launcher); default: as a run trained, else single",
    host=flags.Flag("Address the server listens on, on the launcher (default {default}, reached from here "
                    "through an ssh tunnel; another one of the launcher's, or 0.0.0.0, needs "
                    "--api-key-file)", serving.Options.host, flags.address),
    port=whole("Port of the API, on the launcher and here (default {default})", serving.Options.port,
               1, 65535),
    api_key_file="A file holding the key every request must send (Authorization: Bearer <key>)",
    max_tokens=whole("Default max_tokens of a request (default {default})", serving.Options.max_tokens,
                     1, 1_000_000),
    context=whole("The longest request served, its prompt and answer, in tokens (default: the model's "
                  "own context); a shorter one needs less memory for its key-value cache", None, 16,
                  10_000_000),
    prompt_cache=whole("Prompts whose caches the server keeps for a later request that begins alike "
                       "(default: as many as the nodes' memory holds, at most 10)", None, 0, 1000),
    batch="Batch the requests as mlx_lm.server does, adapters mixed in a batch (default); "
          "--no-batch: one at a time, each as mlx_lm generate answers it",
    backend="auto (default), mpi, ring, jaccl or jaccl-ring"), iterable=["run"])
def serve(c, inventory=None, run=None, model=None, parallel=None, host=None, port=None,
          api_key_file=None, max_tokens=None, context=None, prompt_cache=None, batch=True, backend=None,
          threads=None, dry_run=False):
    """Serve what was trained behind an OpenAI-compatible API, across the cluster (Ctrl-C stops it)."""
    serving.serve(recorded(_inventory(c, inventory)), serving.Options(
        runs=tuple(run or ()), model=model, parallel=parallel, host=host, port=port,
        api_key_file=api_key_file, max_tokens=max_tokens, context=context, prompt_cache=prompt_cache,
        batch=batch, backend=backend, threads=threads, dry_run=dry_run))


@task(flags=Flags(
    run="A run id (or folder) whose adapters to fuse (default: the latest finished run)",
    model="Base model directory on the controller (default: the run's own)",
    output="The fused model's folder (default: runs/<id>/fused; never written over)",
    dequantize="Write a quantized base's fused model in float",
    gguf="Also write model.gguf for llama.cpp (llama, mistral and mixtral models; float)",
    by_file="Fuse one file of weights at a time even where the model fits this machine's memory "
            "(default: only where it does not; stock mlx_lm fuse where it does)",
    max_file_mb=whole("Weights per file when fusing file by file (default {default})",
                      fusing.Options.max_file_mb, 1, 1 << 20),
    dry_run="Say how it would fuse, fuse nothing"))
def fuse(c, run=None, model=None, output=None, dequantize=False, gguf=False, by_file=False,
         max_file_mb=None, dry_run=False):
    """Fuse a run's adapters into its base: a model folder that mlx_lm generate and mlx_lm.server load."""
    fusing.fuse(fusing.Options(run=run, model=model, output=output, dequantize=dequantize, gguf=gguf,
                               by_file=by_file, max_file_mb=max_file_mb, dry_run=dry_run))


@task(flags=Flags(prompt="What to ask", adapter="Run directory with adapters (default: latest)",
                  model="Base model directory (default: the run's model)",
                  max_tokens=whole("Tokens to generate (default {default})", 120, 1, 100_000)))
def generate(c, prompt, adapter=None, model=None, max_tokens=None):
    """Print the base model's and the fine-tuned model's answers side by side."""
    runs.side_by_side(prompt, adapter, model, max_tokens)


# ------------------------------------------------------------------------ development

@task
def lint(c):
    """Lint everything: ruff, yamllint, ansible-lint (production profile)."""
    devtools.lint()


@task(help={"unit": "Only the fast unit tests (no root, no hosts)",
            "benches": "Only the benches' own runs end to end, on a lab (root): measurements, not in CI",
            "k": "Only tests matching this pytest -k expression",
            "lint_first": "Lint before testing (default yes)"})
def test(c, unit=False, benches=False, k=None, lint_first=True):
    """Run the linters, the unit tests and the lab-cluster tests."""
    if lint_first:
        devtools.lint()
    devtools.test(unit=unit, benches=benches, k=k)


@task(name="up", help={"nodes": "Number of hosts (1-9; existing ones are kept)",
                       "id": SHARED_HELP["id"],
                       "cables": "ring or mesh: cable the hosts point to point, like Macs "
                                 "(thunderbolt_topology: links), instead of one bridge"})
def lab_up(c, nodes=None, id=None, cables=None):
    """Bring up a lab cluster of real Debian hosts in network namespaces (root)."""
    lab_id = _lab_id(c, id)
    count = flags.whole_number(nodes or c.config.lab.nodes, "--nodes", 1, 9) or 1
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


@task(name="limit", flags=Flags(
    "id", node=whole("Node number", None, 1, 9),
    cpu=real("Percent of one core its processes may use, e.g. 30", None, 1, 100 * 1024),
    memory="Memory its processes may use, e.g. 1.5GB (no swap)", off="Lift the node's limits"))
def lab_limit(c, node, id=None, cpu=None, memory=None, off=False):
    """Make a lab node slower or smaller (a control group over its processes), like a lesser Mac."""
    print(hosts.set_limits(hosts.Lab(_lab_id(c, id)), node, cpu,
                           limits.parse_memory(memory) if memory else None, off))


ns = Collection(provision, hostfile, topology, doctor, plan, train, run, serve, fuse, generate, lint, test,
                Collection("lab", lab_up, lab_down, lab_status, lab_limit),
                Collection.from_module(bench_tasks, name="bench"),
                Collection("data", data_prepare), Collection("model", model_fetch))
ns.configure({"cluster": {"inventory": paths.DEFAULT_INVENTORY},
              "lab": {"id": 0, "nodes": 3}})
