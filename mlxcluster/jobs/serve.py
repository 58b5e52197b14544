"""`invoke serve`: what was trained, behind an OpenAI-compatible API, across the cluster.

The base model is loaded on the training nodes as the runs trained it: sharded across every rank
(`--parallel tensor`) or a stage of whole layers on each (`--parallel pipeline`, in the stages the
run recorded when the ranks are as many), the ways to serve a model no node holds alone; or whole
in one process on the launcher (a data-parallel run's model fits a node). Every run given (`--run`, again for
more) is an adapter over that one base, picked by a request's `model` field under its run id; the
base answers under its folder's name. The nodes get the code, the model and each run's two adapter
files (nothing else of the run), then every rank starts `python -m training.serve`
(training/serve/): rank 0 listens on the launcher's loopback, and the controller reaches it through an
ssh tunnel from its own loopback (the same port), so nothing listens on a network unless
`--host` says so (with a warning). Ctrl-C stops every rank; a rank that dies ends the server with
the node named and a non-zero exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import shlex
import subprocess
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from mlxcluster.check import doctor, room
from mlxcluster.describe.cluster import Cluster, Node, Recorded
from mlxcluster.errors import Interrupted, UserError
from mlxcluster.launch import builder, parallel, quantized, relay, remote, runs, shipment, stages, sync
from mlxcluster.plan import model as model_files
from mlxcluster.plan import serving as serving_plan
from mlxcluster.provision import inputs
from training.data import shares
from training.serve import READY, front

MODES = ("tensor", "pipeline", "single")
SPREAD = ("tensor", "pipeline")  # the modes that serve on every training node
LOOPBACK = ("127.0.0.1", "localhost", "::1")
EVERY_ADDRESS = ("0.0.0.0", "::")
# Run on the launcher: whether it holds the address (a bind to it fails with EADDRNOTAVAIL if not).
HOLDS_ADDRESS = """import errno, socket, sys
host = sys.argv[1]
probe = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
try:
    probe.bind((host, 0))
except OSError as error:
    print("missing" if error.errno == errno.EADDRNOTAVAIL else "held")
else:
    print("held")
"""
# How long the server's front holds an answer that broke off for this controller's word on which node
# went away (the launcher's output says it; mpirun's exit comes within a second of the rank's death).
AWAIT_REASON_SECONDS = 5


class ServeFailed(UserError):
    """The server stopped on its own: a rank died or could not start; the message names the node."""


@dataclass(frozen=True)
class Options:
    """invoke serve's options, as given."""

    runs: tuple[str, ...] = ()  # run ids or folders (none: the latest finished run)
    model: str | None = None  # the base (default: the runs' own)
    parallel: str | None = None  # tensor, pipeline or single (default: as a run trained)
    host: str = "127.0.0.1"  # where rank 0 listens on the launcher
    port: int = 8080
    api_key_file: str | None = None
    max_tokens: int = 512
    context: int | None = None  # the longest request served, prompt and answer (None: the model's own)
    prompt_cache: int | None = None  # prompts whose caches are kept (None: as many as the nodes hold)
    batch: bool = True  # mlx_lm.server's batching, adapters mixed; False: one request at a time
    backend: str | None = None
    threads: int | None = None
    dry_run: bool = False


@dataclass(frozen=True)
class Served:
    """The adapters of the runs given, the base they share, and how it is loaded."""

    runs: tuple[Path, ...]
    model: Path
    mode: str  # tensor, pipeline or single


def runs_of(given: Sequence[str]) -> list[Path]:
    """The run folders `--run` names (a run id under runs/, or a folder), each with its adapter files;
    none given: the latest finished run."""
    found = [runs.named(item) for item in given or ()] or [runs.named(None)]
    names = [run.name for run in found]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise UserError(f"--run {', '.join(twice)} given twice: each run is one adapter")
    return found


def served(options: Options) -> Served:
    """What to serve: the runs, their one base and the way to load it; a UserError when they do not
    share a base or the mode is unknown."""
    run_dirs = runs_of(options.runs)
    bases = {run.name: runs.model_for(run, options.model).resolve() for run in run_dirs}
    if len(set(bases.values())) > 1:
        listed = "; ".join(f"{name}: {base}" for name, base in bases.items())
        raise UserError(f"the runs were trained on different base models ({listed}): serve the runs of "
                        "one base at a time, or pass --model to serve them all over one")
    if options.parallel not in (None, *MODES):
        raise UserError(f"--parallel must be {', '.join(MODES[:-1])} or {MODES[-1]}, "
                        f"not {options.parallel!r}")
    mode = options.parallel or default_mode(run_dirs)
    for run in run_dirs:
        if _fine_tune_type(run) == "full":
            raise UserError(f"run {run.name} trained the whole model (fine_tune_type full), not an adapter: "
                            f"make it a model folder (mlx_lm fuse --model <base> --adapter-path {run}) "
                            "and serve that with --model")
    return Served(tuple(run_dirs), next(iter(bases.values())), mode)


def default_mode(run_dirs: Sequence[Path]) -> str:
    """How runs are served when --parallel does not say: as they trained. A run trained tensor- or
    pipeline-parallel may be of a model no node holds: then all are served across the nodes, sharded
    if any trained so, else in stages. A folder of adapters alone (no run.json, --model given) was
    not trained here."""
    trained = {runs.read_info(run).get("parallel") for run in run_dirs if (run / "run.json").is_file()}
    return next((mode for mode in SPREAD if mode in trained), "single")


def stage_layers(run_dirs: Sequence[Path], model: Path, ranks: int) -> tuple[tuple[int, ...] | None, str]:
    """Each rank's layers when served in pipeline stages on `ranks` ranks, and where they come from:
    a run's recorded stages (run.json's pipeline_layers) on as many ranks, else as equal as can be
    (None: the model's layers are not known here; the ranks split them equally). A UserError when
    the model has fewer layers than the ranks."""
    layers = stages.layer_count(quantized.model_config(model))
    if layers is not None and ranks > layers:
        raise UserError(f"--parallel pipeline on {ranks} ranks: {model} has {layers} layers, and each stage "
                        f"holds at least one; serve it with --parallel single or tensor, or on an inventory "
                        f"of at most {layers} ranks")
    for run in run_dirs:
        recorded = runs.read_info(run).get("pipeline_layers") if (run / "run.json").is_file() else None
        fits = isinstance(recorded, list) and len(recorded) == ranks and all(
            isinstance(count, int) and count >= 1 for count in recorded)
        if fits and (layers is None or sum(recorded) == layers):
            return tuple(recorded), f"as run {run.name} trained them"
    if layers is None:
        return None, "as equal as can be"
    return tuple(shares.split(layers, [1.0] * ranks)), "as equal as can be"


def _fine_tune_type(run: Path) -> str:
    return json.loads((run / "adapter_config.json").read_text()).get("fine_tune_type", "lora")


@dataclass(frozen=True)
class Plan:
    """One server, whole: where it runs, what is sent, the launch and the tunnel."""

    model: Path  # the base, on the controller
    mode: str  # tensor, pipeline or single
    cluster: Cluster  # the ranks that serve: every training node, or the launcher alone
    steps: list[sync.Step]
    launch: list[str]
    tunnel: list[str] | None  # the controller's ssh that forwards the port (None: not needed)
    url: str  # where clients on the controller reach the API
    port: int
    notices: tuple[str, ...]
    marker: str  # what names the server's processes on the launcher
    stages: tuple[int, ...] | None = None  # each rank's layers in pipeline mode (None: not, or equal)
    adapters: tuple[Path, ...] = ()  # the runs whose adapters are served
    context: int | None = None  # the longest request served (None: the model's own context)


def check_context(context: int | None, model: Path) -> None:
    """--context is at most the model's own context (its config.json's, where it says one)."""
    shape = model_files.Shape.of(model_files.read_config(model)) if context else None
    if context and shape and shape.positions and context > shape.positions:
        raise UserError(f"--context {context}: {model.name} reads at most {shape.positions} tokens "
                        f"(its config.json); give --context {shape.positions} or less, or leave it out")


def server_plan(the_plan: Plan) -> serving_plan.Server | None:
    """Each serving rank's peak (mlxcluster/plan/serving.py; None: the model's files do not say)."""
    return serving_plan.for_server(the_plan.model, the_plan.mode, world=the_plan.cluster.world_size,
                                   context=the_plan.context, adapters=the_plan.adapters,
                                   stages=the_plan.stages)


def layout(rec: Recorded, mode: str) -> Cluster:
    return rec.cluster if mode in SPREAD else rec.cluster.only(rec.cluster.head)


def plan(rec: Recorded, options: Options, serve_id: str) -> Plan:
    """The server as commands; nothing is run."""
    what = served(options)
    cluster = layout(rec, what.mode)
    check_context(options.context, what.model)
    if what.mode == "tensor":
        parallel.check(cluster, what.model, "tensor")
    counts, whence = (stage_layers(what.runs, what.model, cluster.world_size) if what.mode == "pipeline"
                      else (None, ""))
    head = cluster.head
    placed_model, steps = code_and_model(rec, cluster, what.model)
    marker = f"serve-{serve_id}"
    # A run's adapters keep one place on the nodes: serving it again sends nothing.
    adapters_dir = f"{head.work_dir}/adapters"
    flags = []
    for run in what.runs:
        files = shipment.select(run, runs.ADAPTER_FILES, f"run {run.name}'s adapters")
        steps += [(f"send run {run.name}'s adapters to {node.name}",
                   sync.send(files, node, f"{adapters_dir}/{run.name}")) for node in cluster.training_nodes]
        flags.append(f"--adapter={run.name}={adapters_dir}/{run.name}")
    if options.host not in LOOPBACK and not options.api_key_file:
        raise UserError(f"--host {options.host}: a server on a network with no --api-key-file lets anyone "
                        f"who reaches {head.name} use it: give --api-key-file FILE (the key in it), or leave "
                        "--host out (127.0.0.1, reached from here through an ssh tunnel)")
    key_flags = []
    if options.api_key_file:
        key = Path(options.api_key_file)
        if not key.is_file() or not key.read_text().strip():
            raise UserError(f"--api-key-file {key}: no such file, or it is empty; put the key in it")
        # Rank 0, on the launcher, checks every request: the key goes there only.
        steps.append((f"send the API key to {head.name}",
                      sync.push(key.resolve(), head, f"{head.work_dir}/{marker}", delete=False)))
        key_flags = ["--api-key-file", f"{head.work_dir}/{marker}/{key.name}"]
    program = ["python", "-m", "training.serve", "--model", placed_model, "--base-name", what.model.name,
               *flags, "--host", options.host, "--port", str(options.port),
               "--max-tokens", str(options.max_tokens), "--expected-world-size", str(cluster.world_size),
               *(["--context", str(options.context)] if options.context else []),
               *([] if options.prompt_cache is None else ["--prompt-cache-size", str(options.prompt_cache)]),
               "--tag", marker, "--await-reason", str(AWAIT_REASON_SECONDS), *key_flags,
               *([] if options.batch else ["--no-batch"]), *mode_flags(what.mode, counts)]
    choice = builder.choice_for(cluster, options.backend)
    job = builder.Job(program, backend=choice.backend, threads=options.threads, interactive=False,
                      mlx_envs=rec.mlx_envs)
    tunnel = tunnel_command(head, options.host, options.port)
    ranks = f"{cluster.world_size} rank{'s' if cluster.world_size > 1 else ''}"
    how = how_served(what.mode, cluster, counts, whence)
    notices = (f"base {what.model} ({how}, {ranks}); adapters: {', '.join(r.name for r in what.runs)}",
            *([f"listening on {options.host}: whoever reaches {head.name} on port {options.port} with the "
               "key can use the API"] if options.host not in LOOPBACK else []))
    return Plan(what.model, what.mode, cluster, steps, builder.command(cluster, job), tunnel,
                f"http://{reached_at(head, options.host)}:{options.port}/v1", options.port, notices, marker,
                counts, what.runs, options.context)


def mode_flags(mode: str, counts: Sequence[int] | None) -> list[str]:
    """The serving ranks' flags for `mode` (with one rank, or sharded, they need none)."""
    if mode != "pipeline":
        return []
    return ["--parallel", "pipeline", *(["--pipeline-layers", ",".join(map(str, counts))] if counts else [])]


def how_served(mode: str, cluster: Cluster, counts: Sequence[int] | None, whence: str) -> str:
    """The base's way of being served, in the words the console says it."""
    nodes = ", ".join(n.name for n in cluster.training_nodes)
    if mode == "tensor":
        return f"tensor-parallel across {nodes}"
    if mode == "pipeline":
        layers = f" of {','.join(map(str, counts))} layers" if counts else ""
        return f"in pipeline stages{layers} across {nodes}, {whence}"
    return f"one process on {cluster.head.name}"


def check_host(head: Node, host: str) -> None:
    """A --host the launcher holds (asked of it, before anything is sent): the server would
    otherwise fail to start there, after the model went to every node."""
    if host in LOOPBACK or host in EVERY_ADDRESS:
        return
    answer = remote.output(head, remote.ssh_command(head, remote.shell_line(
        head, ["python", "-c", HOLDS_ADDRESS, host])), timeout=60)
    if answer.split()[-1:] == ["missing"]:
        raise UserError(f"--host {host}: not an address of {head.name}, the launcher, where the API listens: "
                        "give one of its own, 0.0.0.0 for all of them, or leave --host out (127.0.0.1)")


def code_and_model(rec: Recorded, cluster: Cluster, model: Path) -> tuple[str, list[sync.Step]]:
    """Where the model is on the nodes, and the steps that put the code and it there (verified
    where provisioning installed it, else copied as `invoke train` copies it)."""
    installed = inputs.installed_model(rec.cluster, str(model))
    shipped = shipment.Shipment(model, ()) if installed else shipment.model(model)
    placed = sync.model_place(cluster, model, installed["path"] if installed else None)
    return placed, [*sync.push_code(cluster),
                    *sync.model_steps(cluster, shipped, placed, installed=bool(installed))]


def tunnel_command(head: Node, host: str, port: int) -> list[str] | None:
    """The controller's ssh that forwards the launcher's loopback `port` to its own (None: the
    launcher is this machine, or the server listens on a network)."""
    if remote.is_local(head) or host not in LOOPBACK:
        return None
    return [*remote.ssh_options(head), "-N", "-o", "ExitOnForwardFailure=yes",
            "-L", f"127.0.0.1:{port}:127.0.0.1:{port}", remote.destination(head)]


def reached_at(head: Node, host: str) -> str:
    """The address clients on the controller use: its loopback (the tunnel's end, or the launcher
    is this machine), else the address the server listens on (the launcher's own, for any)."""
    if host in LOOPBACK:
        return "127.0.0.1"
    if host in ("0.0.0.0", "::"):
        return "127.0.0.1" if remote.is_local(head) else remote.destination(head).rpartition("@")[2]
    return host


@contextlib.contextmanager
def tunnel(command: list[str] | None, port: int) -> Iterator[None]:
    """The controller's end of the API: an ssh forward of the launcher's loopback port (none when
    the launcher is this machine or the server listens on a network)."""
    if command is None:
        yield
        return
    # Its pipe is closed whatever happens: a pipe left open is found by the garbage collector later,
    # as a ResourceWarning in whichever code runs then.
    with subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True) as process:
        time.sleep(0.5)
        if process.poll() is not None:
            raise UserError(f"could not forward port {port} from this machine to the launcher (is it taken "
                            f"here? pass another --port): {process.stderr.read().strip()[-300:]}")
        try:
            yield
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:  # never left holding the port, nor failing the stop
                process.kill()
                process.wait()


def execute(plan: Plan) -> None:
    """Send, start every rank, say where the API is once rank 0 listens, and relay its output until
    Ctrl-C (every rank stopped: Interrupted) or the server stops on its own (ServeFailed)."""
    sync.run_steps(plan.steps)
    for line in plan.notices:
        print(f"==> {line}", flush=True)
    print(f"==> starting the server on {plan.cluster.world_size} rank(s)", flush=True)
    stack = contextlib.ExitStack()

    def on_line(line: str) -> None:
        if READY in line:
            stack.enter_context(tunnel(plan.tunnel, plan.port))
            print(f"==> the API is at {plan.url} (OpenAI-compatible; Ctrl-C stops every rank)", flush=True)

    # A service manager stops a server with SIGTERM: it stops every rank as Ctrl-C does.
    with stack:
        try:
            with relay.terminated_as_interrupted():
                relayed = relay.supervise(plan.cluster, plan.launch, plan.marker, on_line=on_line,
                                          stdin=subprocess.DEVNULL)
        except KeyboardInterrupt:
            raise Interrupted(f"stopped: every rank of the server on {plan.cluster.head.name} was "
                              "stopped") from None
        # The clients still waiting learn which rank and node, while the tunnel still reaches the front.
        if which := builder.which_rank(plan.cluster, relayed.output):
            tell_front(plan.url, which)
    why = builder.describe_failure(plan.cluster, relayed.output, relayed.code, "tensor")
    raise ServeFailed(f"the server stopped (exit {relayed.code}): {why}", code=relayed.code or 1)


def tell_front(url: str, reason: str) -> bool:
    """Post why the server stopped to its front (training/serve/front.py), which tells the clients
    whose answers broke off; False when the front is gone already (nobody was waiting)."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=5)
    try:
        connection.request("POST", front.REASON_PATH, json.dumps({"reason": reason}),
                           {"Content-Type": "application/json"})
        return connection.getresponse().status == 204
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()


def serve(rec: Recorded, options: Options) -> None:
    """invoke serve."""
    serve_id = runs.new_id()
    the_plan = plan(rec, options, serve_id)
    if options.dry_run:
        for line in the_plan.notices:
            print(f"# {line}")
        sync.run_steps(the_plan.steps, dry_run=True)
        print(f"# launch on {the_plan.cluster.head.name}\n{shlex.join(the_plan.launch)}")
        if the_plan.tunnel:
            print(f"# forward the API to this machine\n{shlex.join(the_plan.tunnel)}")
        return
    # The nodes' checks (of the cluster as provisioned: its hostfiles are the whole cluster's),
    # and memory for what each serving rank will hold, before anything is sent.
    check_host(the_plan.cluster.head, options.host)
    gathered = doctor.gather(rec.cluster)
    doctor.preflight(rec.cluster, room.for_server(the_plan.cluster, the_plan.model, the_plan.mode,
                                                    context=the_plan.context, adapters=the_plan.adapters,
                                                    stages=the_plan.stages), gathered)
    if options.prompt_cache is None:
        # The prompt cache keeps whole requests' caches: as many as every node holds beyond the
        # request in flight (mlx-lm's 10 at most), the same number on every rank, so they agree.
        kept = serving_plan.kept_prompts(server_plan(the_plan), the_plan.cluster, doctor.memory_of(gathered))
        the_plan = plan(rec, dataclasses.replace(options, prompt_cache=kept), serve_id)
        print(f"==> keeping the caches of up to {kept} prompts (what the nodes' memory holds)", flush=True)
    execute(the_plan)

