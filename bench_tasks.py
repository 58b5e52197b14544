"""The `invoke bench.*` tasks (tasks.py gathers them as the bench collection): one task per
benchmark of mlxcluster/bench/, each a docstring, its flags and a call into it.

Each flag's help, default and reader are said once, in the task's `Flags`; the task's body gets the
values read (mlxcluster/jobs/flags.py), so it only hands them on.
"""

from __future__ import annotations

from mlxcluster.bench import calibrate as calibrate_bench
from mlxcluster.bench import faults as faults_bench
from mlxcluster.bench import links as links_bench
from mlxcluster.bench import overhead as overhead_bench
from mlxcluster.bench import pipeline as pipeline_bench
from mlxcluster.bench import plan as plan_bench
from mlxcluster.bench import provision as provision_bench
from mlxcluster.bench import rehearsal as rehearsal_bench
from mlxcluster.bench import scaling as scaling_bench
from mlxcluster.bench import serve as serve_bench
from mlxcluster.bench import shares as shares_bench
from mlxcluster.bench import tensor as tensor_bench
from mlxcluster.bench import train as train_bench
from mlxcluster.describe.cluster import recorded
from mlxcluster.jobs.flags import (
    SHARED,
    Flag,
    Flags,
    choice,
    inventory_of,
    real,
    several,
    task,
    whole,
    wholes,
)
from mlxcluster.lab.veth import KINDS as CABLES

LAB = SHARED["lab"]
LAB_HOSTS = whole("Lab hosts (default {default})", 3, 2, 9)
# The options every training benchmark reads alike (run as invoke train runs).
TRAINING = ("inventory", "iters", "batch_size", "data", "model", "threads", "extra", "output")


@task(flags=Flags(
    "output", id=LAB,
    nodes=wholes("Lab hosts, or several counts for a curve, e.g. 2,4,8 (default {default})", [3], 1, 9),
    cables=choice("ring or mesh: cable the hosts point to point, like Macs, instead of one bridge", CABLES)))
def provision(c, nodes=None, id=None, output=None, cables=None):
    """Time a first and an idempotent second site.yml run on a fresh lab cluster of each size."""
    provision_bench.run(nodes, id, output, cables=cables)


@task(flags=Flags(
    "output", id=LAB, nodes=LAB_HOSTS.with_default(8),
    cables=choice("{default} (default) or mesh: how the hosts are cabled, like Macs", CABLES, "ring"),
    steps=whole("Steps of each training run (default {default})", 3)))
def rehearsal(c, nodes=None, cables=None, steps=None, id=None, output=None):
    """A fresh lab cabled like Macs, from nothing to training as a new user goes: provision twice,
    doctor, train, --backend mpi, and tensor parallelism on every node against one process."""
    rehearsal_bench.run(nodes, cables, id, steps, output)


@task(flags=Flags(
    "data", "output", id=LAB,
    iters=whole("Steps of each scaling run (default {default}; 0 skips scaling)", 30, 0),
    rounds=whole("Scaling rounds, each a 1-rank then a 2-rank run (default {default})", 2),
    batch_size=whole("Global batch of the scaling and BLAS runs (default {default}, as in lora.yaml)", 4),
    blas_iters=whole("Steps of each BLAS run (default {default}, as stock mlx[cpu] takes over a minute a "
                     "step; 0 skips BLAS)", 3, 0),
    quality_iters=whole("Steps of the pirate fine-tune that quality is measured on "
                        "(default: the config's, 40; 0 skips quality)", None, 0),
    overhead_iters=whole("Steps of each overhead run, ours and stock mlx_lm lora (default {default}; 0 "
                         "skips the overhead comparison)", 40, 0),
    overhead_rounds=whole("Overhead rounds, each our run then stock's (default {default})", 2),
    model="Model directory (default: SmolLM2-135M in float32, fetched on first use)"))
def train(c, id=None, iters=None, rounds=None, batch_size=None, blas_iters=None, quality_iters=None,
          overhead_iters=None, overhead_rounds=None, data=None, model=None, output=None):
    """Scaling (2 ranks over 1), BLAS, pirate quality and overhead over stock mlx-lm.

    Runs on a fresh 2-node lab cluster with SmolLM2-135M and the bundled pirate data.
    """
    parts = train_bench.Parts(iters=iters, rounds=rounds, batch_size=batch_size, blas_iters=blas_iters,
                              quality_iters=quality_iters, overhead_iters=overhead_iters,
                              overhead_rounds=overhead_rounds)
    train_bench.run(lab_id=id, parts=parts, data=data, model=model, output=output)


@task(flags=Flags(
    "inventory", "data", output="JSON file to write (default runs/bench/overhead-<time>.json)",
    model="Model directory (default: SmolLM2-135M in the nodes' dtype, fetched on first use)",
    iters=whole("Steps of each run (default {default}; at least 15)", 40),
    rounds=whole("Rounds per fine-tune type, each our run then stock's (default {default}: a median that "
                 "a slow spell in one round does not move)", 3),
    types="Fine-tune types, comma-separated (default lora,dora,full)"))
def overhead(c, inventory=None, iters=None, rounds=None, types=None, data=None, model=None, output=None):
    """Ours against stock `mlx_lm lora` on the launcher, both given one config file per fine-tune
    type: tokens/s of each, ours over stock (target 0.97x) and the losses report by report."""
    overhead_bench.run(recorded(inventory_of(c, inventory)), iters=iters, rounds=rounds, types=types,
                       data=data, model=model, output=output)


@task(flags=Flags(
    "inventory", "output",
    backends="Comma-separated: mpi, ring, jaccl, jaccl-ring; default mpi,ring on a bridge, "
             "the training backend on per-cable networks",
    max_size=Flag("Largest all-reduce, e.g. 4MB (default {default}); caps the pair message (64MB) too",
                  "256MB"),
    timeout=real("Seconds each backend's run may take (default {default})", 900.0, 1, 86400)))
def links(c, inventory=None, backends=None, max_size=None, output=None, timeout=None):
    """Latency and bandwidth of every node pair, and all-reduce bandwidth, over the cluster link.

    One rank per node; pairs and all_sum sizes from 4 KB up, with each backend; slow or
    asymmetric links are flagged. Writes JSON and a PNG under runs/bench/.
    """
    links_bench.run(recorded(inventory_of(c, inventory)), backends=backends, max_size=max_size, output=output,
                    timeout=timeout)


@task(flags=Flags(
    *TRAINING, "nodes",
    parallel="How the runs on more than 1 node split the work: data, tensor, pipeline, or several "
             "(data,tensor) (default data; the 1-node baseline runs once)",
    stock="Also run stock mlx_lm lora as one process on the first node, same model, data and settings"))
def scaling(c, inventory=None, nodes=None, iters=None, batch_size=None, data=None, model=None,
            threads=None, extra="", output=None, parallel=None, stock=False):
    """The same fine-tune on 1 node and on more: wall time, tokens/s, speedup, efficiency, peak
    memory per rank and where the time went (sync, model load, training, evaluation), as a table,
    JSON and PNG; with --stock, stock mlx_lm lora on one process beside them."""
    scaling_bench.run(recorded(inventory_of(c, inventory)), nodes=nodes, parallel=parallel, stock=bool(stock),
                      iters=iters, batch_size=batch_size, data=data, model=model, threads=threads,
                      extra=extra, output=output)


@task(flags=Flags(
    *TRAINING, iters=SHARED["iters"].with_default(20),
    nodes="Node counts, comma-separated, each run in data, tensor and pipeline (default 2,3,4: those "
          "there are)",
    pipeline_stages=whole("Also pipeline and data together: this many stages, replicated on each count "
                          "they divide (e.g. 2: 2 replicas of 2 stages on 4 nodes)")))
def pipeline(c, inventory=None, nodes=None, pipeline_stages=None, iters=None, batch_size=None, data=None,
             model=None, threads=None, extra="", output=None):
    """Data, tensor and pipeline on the same model and batch, and one process: tokens/s, each rank's
    peak, each stage's idle time against the bubble, each cable's bytes per step; aims judged."""
    pipeline_bench.run(recorded(inventory_of(c, inventory)), nodes=nodes, pipeline_stages=pipeline_stages,
                       iters=iters, batch_size=batch_size, data=data, model=model, threads=threads,
                       extra=extra, output=output)


@task(flags=Flags(
    "inventory", "data", "model", "threads", "extra", "output", iters=SHARED["iters"].with_default(8),
    nodes=wholes("Node counts, comma-separated (default {default}); 1 node runs data parallel only",
                 list(plan_bench.COUNTS), 1, 9),
    parallel=several("Parallelisms on more than 1 node, comma-separated (default all: data,tensor,pipeline)",
                     plan_bench.PARALLELS),
    weights=several("The base's weights: float, 4bit (a 4-bit copy of the float model, made once), or "
                    "both (default)", plan_bench.WEIGHTS),
    batch_sizes=wholes("Global batch sizes, comma-separated (default {default})", list(plan_bench.BATCHES)),
    lengths=wholes("max_seq_length values, comma-separated (default {default})", list(plan_bench.LENGTHS),
                   16, 1 << 20),
    grad_checkpoint=several("Grad checkpointing: off, on, or both (default)", plan_bench.CHECKPOINTING)))
def plan(c, inventory=None, nodes=None, parallel=None, weights=None, batch_sizes=None, lengths=None,
         grad_checkpoint=None, iters=None, data=None, model=None, threads=None, extra="", output=None):
    """How good `invoke plan` is: a grid of real runs (nodes x parallelism x float and 4-bit x batch x
    sequence length x grad checkpointing), each rank's planned peak and step time against the
    measured ones, with the aims (memory -5 % to +15 %, step within 25 %) judged; JSON and PNG."""
    plan_bench.run(recorded(inventory_of(c, inventory)), nodes=nodes, parallel=parallel, weights=weights,
                   batch_sizes=batch_sizes, lengths=lengths, grad_checkpoint=grad_checkpoint, iters=iters,
                   data=data, model=model, threads=threads, extra=extra, output=output)


@task(flags=Flags(*TRAINING))
def shares(c, inventory=None, iters=None, batch_size=None, data=None, model=None, threads=None,
           extra="", output=None):
    """On a mixed cluster: each node alone (a calibration), then every node with equal and with
    calibrated batch shares; the steps' time and the nodes' idle time, as a table and JSON."""
    shares_bench.run(recorded(inventory_of(c, inventory)), iters=iters, batch_size=batch_size, data=data,
                     model=model, threads=threads, extra=extra, output=output)


@task(flags=Flags(*TRAINING, nodes="Nodes holding a shard (default: every training node)"))
def tensor(c, inventory=None, nodes=None, iters=None, batch_size=None, data=None, model=None,
           threads=None, extra="", output=None):
    """One process holding the whole model, then every node holding a shard (--parallel tensor):
    peak memory per rank and the time of a step, as a table, JSON and PNG."""
    tensor_bench.run(recorded(inventory_of(c, inventory)), nodes=nodes, iters=iters, batch_size=batch_size,
                     data=data, model=model, threads=threads, extra=extra, output=output)


@task(flags=Flags(
    "inventory", "threads",
    nodes="Layouts, e.g. 1,2,3: 1 is one process on the launcher, more is tensor-parallel across that "
          "many nodes (default: 1 to every training node)",
    model="Model directory on the controller (default: the one provisioning installed, else SmolLM2)",
    requests=whole("Requests per load, at 1 and at 4 at once (default {default})", 8, 1, 1000),
    max_tokens=whole("Tokens per answer (default {default})", 64, 1, 100_000),
    port=whole("Port of the servers, on the launcher and here (default {default})", 18080, 1, 65535),
    stock="Stock mlx_lm.server on the same ranks too (default; --no-stock leaves it out)",
    rounds=whole("Rounds, each server started afresh, the programs alternating; medians reported "
                 "(default {default})", 1, 1, 100),
    output="JSON path (default runs/bench/serve-<time>.json)"))
def serve(c, inventory=None, nodes=None, model=None, requests=None, max_tokens=None, port=None,
          threads=None, stock=True, rounds=None, output=None):
    """Our server against stock mlx_lm.server: time to first token, tokens/s at 1 and 4 requests at
    once, each rank's peak memory; one process, then tensor-parallel."""
    serve_bench.run(recorded(inventory_of(c, inventory)), nodes=nodes, model=model, requests=requests,
                    max_tokens=max_tokens, port=port, threads=threads, stock_too=stock, rounds=rounds,
                    output=output)


@task(flags=Flags(
    "inventory", "data", "model", "extra", "output",
    iters=whole("Steps on each node (default {default})", 10),
    batch_size=whole("The training run's global batch (default: the config's); each node runs its equal "
                     "share"),
    config="YAML training config the runs will use (its max_seq_length keys the calibration)",
    threads=whole("BLAS threads (default: all cores)", maximum=1024)))
def calibrate(c, inventory=None, iters=None, batch_size=None, data=None, model=None, config=None,
              threads=None, extra="", output=None):
    """Each node's tokens/s and peak memory at this fine-tune, alone, one node after the other:
    kept in build/<inventory>/calibration.json for batch_share: auto."""
    calibrate_bench.run(recorded(inventory_of(c, inventory)), iters=iters, batch_size=batch_size, data=data,
                        model=model, config=config, threads=threads, extra=extra, output=output)


@task(flags=Flags(
    "output", id=LAB, nodes=LAB_HOSTS, iters=SHARED["iters"].with_default(40),
    save_every=whole("Steps between checkpoints (default {default})", 10),
    faults=several(f"Which, comma-separated: {', '.join(faults_bench.FAULTS)} (default: all)",
                   faults_bench.FAULTS),
    parallel=choice("{default} (default) or tensor: the stand-in model sharded across the nodes, then the "
                    "nodes left", faults_bench.PARALLEL, "data"),
    shares=wholes("A batch_share weight per node, comma-separated (mixed Macs), e.g. 3,3,1,1", ())))
def faults(c, nodes=None, iters=None, save_every=None, faults=None, id=None, output=None, parallel=None,
           shares=None):
    """A fresh lab; a run per fault on its last node (or the controller), a few steps after a
    checkpoint: time to training again, steps lost, adapters against an uninterrupted run's."""
    faults_bench.run(nodes, id, iters, save_every, faults, output, parallel, shares)
