"""Launcher command lines: how a program starts on every rank of a cluster, and how it stops.

One builder, `command(cluster, job)`, makes the controller's command for invoke train, invoke run,
invoke doctor's jobs and the benchmarks: ssh to the launcher, source its env.sh, then mpirun
with the rendered hostfile pinned to the cluster link, the venv's `mlx-cluster-launch --backend
ring|jaccl|jaccl-ring` (mlx.launch's place: roles/python_env/files/mlx_cluster_launch.py), or (one
rank on the launcher) the program alone. `choice_for` says which, and why (`--backend
auto`: mlxcluster/describe/backends.py). Every rank gets the same environment from `rank_env`, whoever
launches it. `describe_failure` and `failure_report` say what a failed launch's output means.

All plain functions of the recorded layout (mlxcluster/describe/cluster.py), so tests assert on exact
command lines without any host.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from mlxcluster.describe.backends import RDMA_HOWTO, Choice, rdma_missing
from mlxcluster.describe.cluster import Cluster, Node
from mlxcluster.describe.topology import BACKENDS, backend_problem, mlx_hostfile
from mlxcluster.errors import UserError
from mlxcluster.launch import remote
from training.loop import heartbeat

# The backends of MLX's own that the cluster's launcher starts (as mlx.launch would), from MLX's
# hosts file. It is in every venv (roles/python_env), run by the venv's python.
MLX_BACKENDS = ("ring", "jaccl", "jaccl-ring")
LAUNCHER = "mlx-cluster-launch"
JACCL_HOSTS_FILE = "jaccl-hosts.json"  # written into the work directory at launch
# A layout of fewer ranks than provisioned (bench.scaling's, bench.tensor's one process) cannot use
# the provisioned hosts.json, which lists every node: its own is written there at launch.
LAYOUT_HOSTS_FILE = "layout-hosts.json"
# mpirun's of such a layout: the provisioned hostfile lists every node in inventory order, so -np 2
# on node1, node2, node3 would place a rank on node2 even when the layout has node1 and node3.
LAYOUT_HOSTFILE = "layout-hostfile"
# Variables env.sh (roles/python_env) sets that every mpirun rank needs, per launcher OS.
ENV_FILE_VARS = {
    "Debian": ("PATH", "VIRTUAL_ENV", "LD_PRELOAD"),
    "Darwin": ("PATH", "VIRTUAL_ENV", "DYLD_LIBRARY_PATH"),
}
# Markers name a run's processes for pkill: letters, digits, dashes, dots, slashes and spaces.
_MARKER = re.compile(r"^[\w./ -]+$")
# Names a job on its launcher's command line when the program's own words may not (invoke run's
# `hostname`): mpirun (-x) and LAUNCHER (--env) hand it to every rank, so their command lines hold
# it and stop_command finds them by it; each rank can read its job's tag.
JOB_TAG = "MLX_CLUSTER_JOB"
# One process run directly has no launcher: a tagged one runs under the launcher's python, which
# waits for it and passes SIGTERM (stop_command's) on, so that the tag stays on a command line
# whatever the program is; its exit status is the program's. A SIGTERM that comes while the program
# starts is kept and passed on once it has. A terminal's Ctrl-C and hang-up reach the program itself
# (ssh -tt: the same process group), so this python only waits for its end. One line, so that
# stop_command's `.*` spans it whatever a pkill's regex makes of a newline.
TAG_WAITS = ("import signal, subprocess, sys; program, stops = [], []; "
             "[signal.signal(n, lambda *_: None) for n in (signal.SIGINT, signal.SIGHUP)]; "
             "signal.signal(signal.SIGTERM, "
             "lambda n, _: stops.append(n) or [p.send_signal(n) for p in program]); "
             "program.append(subprocess.Popen(sys.argv[2:])); "
             "[program[0].send_signal(n) for n in stops[:1]]; "
             "code = program[0].wait(); sys.exit(128 - code if code < 0 else code)")


@dataclass(frozen=True)
class Job:
    """What to start on every rank of a cluster, and how.

    program: the argv of every rank; a leading "python" is the venv's python.
    backend: mpi (mpirun + the rendered hostfile), ring or jaccl (LAUNCHER), or direct (one process on
      the launcher, no launcher program: see `backend_for`).
    ring_hosts_file: ring only: a file name in the work directory to write this layout's hosts
      file to, instead of using the rendered <cluster_root>/hosts.json.
    hostfile: mpi only: a file name in the work directory to write this layout's hostfile to,
      instead of using the rendered <cluster_root>/hostfile.
    mlx_envs: what LAUNCHER exports on every rank, in a hosts file written at launch (a
      ring_hosts_file, or JACCL's).
    map_by_node: mpi only: rank i on the i-th node, whatever the hostfile's slots.
    rank_setup: shell commands each rank runs before the program, where the launcher's own
      variables (its rank) are known: invoke run's RANK and the like.
    tag: names the job on its launcher's command line (JOB_TAG), for `stop`, when the program's
      own words do not (invoke run's).
    """

    program: Sequence[str]
    backend: str = "mpi"
    interface: str | None = None  # default: the launcher's thunderbolt_interface
    btl_tcp_links: int | None = None
    threads: int | None = None  # BLAS threads per rank
    interactive: bool = False  # the controller has a terminal: ssh gets a tty, rank 0 draws bars
    workdir: str | None = None  # default: the launcher's work directory
    map_by_node: bool = False
    ring_hosts_file: str | None = None
    hostfile: str | None = None
    mlx_envs: Sequence[str] = ()
    env: Sequence[tuple[str, str]] = ()  # more variables every rank gets (invoke run's rendezvous)
    rank_setup: str = ""
    tag: str = ""
    beats: bool = False  # the ranks beat (training/loop/heartbeat.py): a training run's, watched


def checked_backend(requested: str | None) -> str | None:
    """--backend as asked (None: auto), or a UserError that lists what may be asked: the one
    check of it, made before anything is asked of the nodes."""
    if requested not in (None, "auto", *BACKENDS):
        raise UserError(f"--backend must be auto, {', '.join(BACKENDS)}, not {requested!r}")
    return requested


def choice_for(cluster: Cluster, requested: str | None) -> Choice:
    """The backend of a launch and why: the one asked for, else what `auto` means for this
    cluster (recorded by provisioning: mlxcluster/describe/backends.py). One MPI rank on the launcher
    runs directly: under `mpirun -np 1` mlx-lm's trainer initializes MPI, which MLX never
    finalizes for a group of one, and mpirun fails the job after training finished."""
    checked_backend(requested)
    try:
        choice = cluster.backend_choice(requested)
    except ValueError as exc:
        raise UserError(f"no backend can run on this cluster: {exc}") from None
    training = [n.name for n in cluster.training_nodes]
    if choice.backend == "mpi" and cluster.cables and len(training) > 1:
        # Open MPI's TCP transport offers a peer all of a node's addresses: on a full mesh the
        # thunderbolt role routes each across the cable to that node; a ring has no such cable.
        if problem := backend_problem("mpi", training, cluster.links()):
            raise UserError(problem)
    if choice.backend.startswith("jaccl"):
        if not cluster.cables:
            raise UserError(f"--backend {choice.backend} needs per-cable networks "
                            "(thunderbolt_topology: links): JACCL runs on each cable's RDMA device")
        if len(training) > 1 and (problem := backend_problem(choice.backend, training, cluster.links())):
            raise UserError(problem)
        rdma = {n.name: n.rdma_devices for n in cluster.nodes}
        if missing := rdma_missing(training, cluster.links(), rdma):
            raise UserError(f"--backend {choice.backend}: no RDMA device on {', '.join(missing)} "
                            f"(ibv_devices, as provisioning recorded it): {RDMA_HOWTO}, then "
                            "invoke provision again; or train with --backend ring")
    if (cluster.world_size == 1 and cluster.head.slots == 1
            and (choice.backend == "mpi" or requested in (None, "auto"))):
        # One rank alone needs no launcher (in links mode `auto` says ring: no cable is used).
        return Choice("direct", choice.why)
    return choice


def backend_for(cluster: Cluster, requested: str | None) -> str:
    """The backend of a launch (choice_for, without why)."""
    return choice_for(cluster, requested).backend


def rank_env(cluster: Cluster, job: Job) -> dict[str, str]:
    """What every rank gets besides env.sh, whatever the backend."""
    env = {"HF_HUB_OFFLINE": "1"}  # the model is on the node: never ask the hub
    if not job.interactive:
        # Open MPI gives ranks a pty: without this rank 0 would draw a progress bar into a log.
        env["TTY_COMPATIBLE"] = "0"
    if job.threads:
        env["OPENBLAS_NUM_THREADS"] = str(job.threads)
    elif max((n.slots for n in cluster.training_nodes), default=1) > 1:
        env["OPENBLAS_NUM_THREADS"] = "1"  # several ranks share a machine's cores
    if job.tag:
        env[JOB_TAG] = _checked(job.tag)
    if job.beats:
        env[heartbeat.ENV] = str(heartbeat.BEAT_EVERY)
        if fault := os.environ.get(heartbeat.FAULT):  # the faults' tests and bench inject one
            env[heartbeat.FAULT] = fault
    return env | dict(job.env)


def venv_program(cluster: Cluster, program: Sequence[str]) -> list[str]:
    """The program with a leading "python" the launcher's venv's."""
    if program and program[0] == "python":
        return [f"{cluster.head.venv}/bin/python", *program[1:]]
    return list(program)


def mpirun_command(cluster: Cluster, job: Job, env: Mapping[str, str]) -> list[str]:
    """The mpirun command run on the launcher (after sourcing env.sh) to start the job."""
    head = cluster.head
    # In links mode each cable is its own network: MPI takes every one in the pool (a CIDR).
    interface = job.interface or head.thunderbolt_link_pool or head.thunderbolt_interface
    cmd = [f"{head.openmpi_prefix}/bin/mpirun" if head.openmpi_prefix else "mpirun"]
    if remote.logs_in_as_root(head):
        cmd.append("--allow-run-as-root")
    # Open MPI binds each rank to one core when np <= 2 (and to a socket above): a rank alone on
    # a Linux node would then run all its BLAS threads on a single core, and two nodes' ranks
    # sharing one box (the lab) would share core 0. Leave placement to the OS.
    hostfile = (f"{job.workdir or head.work_dir}/{job.hostfile}" if job.hostfile
                else f"{head.cluster_root}/hostfile")
    cmd += ["--hostfile", hostfile, "-np", str(cluster.world_size),
            "--bind-to", "none"]
    if head.openmpi_prefix and head.os_family == "Darwin":
        # Non-interactive ssh on a Mac has no Homebrew on PATH: tell orted where it lives.
        cmd += ["--prefix", head.openmpi_prefix]
    if interface:
        # Pin both MPI's data path and its out-of-band wire-up to the cluster link,
        # or Open MPI may pick Wi-Fi (or a docker bridge) on its own.
        cmd += ["--mca", "btl_tcp_if_include", interface, "--mca", "oob_tcp_if_include", interface]
    if job.btl_tcp_links:
        cmd += ["--mca", "btl_tcp_links", str(job.btl_tcp_links)]
    cmd += ["--mca", "plm_rsh_args", " ".join(remote.BATCH_MODE)]
    for name in ENV_FILE_VARS.get(head.os_family, ENV_FILE_VARS["Debian"]):
        cmd += ["-x", name]
    for name, value in sorted(env.items()):
        cmd += ["-x", f"{name}={value}"]
    if job.map_by_node:
        cmd += ["--map-by", "node"]
    cmd += ["--wdir", job.workdir or head.work_dir]
    return [*cmd, *set_up(job, venv_program(cluster, job.program))]


def set_up(job: Job, program: Sequence[str]) -> list[str]:
    """The program, run after the job's rank_setup by a shell of its own on each rank."""
    if not job.rank_setup:
        return list(program)
    return ["sh", "-c", f'{job.rank_setup}; exec "$@"', "rank", *program]


def _reach(cluster: Cluster, node: Node) -> str:
    """Where LAUNCHER on the launcher reaches `node` by ssh (Cluster.path_towards: a cable
    between them, the bridge, else its management address); the launcher itself at its own."""
    head = cluster.head
    return node.thunderbolt_ip if node.name == head.name else cluster.address_towards(head, node)


def ring_hosts(cluster: Cluster, envs: Sequence[str] = ()) -> dict[str, object]:
    """MLX's ring hosts file for this layout: one entry per rank, the launcher first. In
    links mode MLX's own (mlxcluster/describe/topology.py): each rank's address on the cable to its left
    neighbour, the ranks in ring order as recorded."""
    training = cluster.training_nodes
    if cluster.cables and len(training) > 1:
        # The nodes a fault left may be a line of cables, closed over the management network.
        management = {n.name: n.management_address for n in training} if cluster.left_out else None
        return mlx_hostfile("ring", [n.name for n in training], cluster.links(),
                            {n.name: _reach(cluster, n) for n in training}, envs=envs,
                            management=management)
    return {"backend": "ring", "envs": list(envs),
            "hosts": [{"ssh": n.thunderbolt_ip, "ips": [n.thunderbolt_ip]}
                      for n in training for _ in range(n.slots)]}


def jaccl_hosts(cluster: Cluster, backend: str, envs: Sequence[str] = ()) -> dict[str, object]:
    """MLX's hosts file for JACCL (jaccl or jaccl-ring), in MLX's own format: per rank the
    RDMA device towards each peer, and rank 0's management address, where the ranks meet."""
    training = cluster.training_nodes
    ssh = {n.name: _reach(cluster, n) for n in training}
    meet = {n.name: n.management_ip or str(n.connection.get("host") or n.name) for n in training}
    return mlx_hostfile(backend, [n.name for n in training], cluster.links(), ssh, meet, envs)


# How a rank of LAUNCHER runs python: as bash's child, not exec'd, so that a rank killed by a
# signal exits 128 + the signal as a shell reports it (the launcher says "Node with rank 2 exited
# with code 137"), where ssh would exit 255 for a remote process killed outright, as for a lost
# connection. The launcher stops a rank by ending its ssh: the hang-up is passed on to python.
RANK_WAITS = ("trap 'kill -TERM $p 2>/dev/null' TERM HUP INT; python \"$@\" & p=$!; wait $p; s=$?; "
              "while kill -0 $p 2>/dev/null; do wait $p; s=$?; done; exit $s")
# The shell that waits must not hold the program's arguments on its command line: a user's
# `pkill -9 -f training.finetune` on a node would kill it with python, and ssh would exit 255 as
# for a lost connection. So the shell the launcher starts hands them on in the environment and
# execs one whose command line is only its script.
RANK_ARGS = "MLX_CLUSTER_RANK_ARGS"


def rank_script(env_file: str, setup: str = "") -> str:
    """The `bash -c` script of one LAUNCHER rank (its arguments: python's): env.sh sourced,
    the job's setup, then python run as RANK_WAITS says, by a shell without them in its argv."""
    waits = (f". {shlex.quote(env_file)} || exit $?; {f'{setup}; ' if setup else ''}"
             f'eval "set -- ${RANK_ARGS}"; unset {RANK_ARGS}; {RANK_WAITS}')
    return f'export {RANK_ARGS}="$(printf \'%q \' "$@")"; exec bash -c {shlex.quote(waits)}'


def launcher_command(cluster: Cluster, job: Job, env: Mapping[str, str]) -> list[str]:
    """LAUNCHER --backend ring, jaccl or jaccl-ring, run on the launcher node, to start the job."""
    head = cluster.head
    workdir = job.workdir or head.work_dir
    hosts = (f"{workdir}/{JACCL_HOSTS_FILE}" if job.backend != "ring" else
             f"{workdir}/{job.ring_hosts_file}" if job.ring_hosts_file
             else f"{head.cluster_root}/hosts.json")
    cmd = [f"{head.venv}/bin/python", f"{head.venv}/bin/{LAUNCHER}", "--backend", job.backend,
           "--hostfile", hosts, "--cwd", workdir]
    for name, value in env.items():
        cmd += ["--env", f"{name}={value}"]
    # The launcher passes fixed values, but each rank needs what its own env.sh sets (the venv
    # first on PATH, OpenBLAS preloaded): so every rank runs bash, which sources env.sh and then
    # runs the venv's python. The program's own "python" is bash's $0.
    return [*cmd, "--", "bash", "-c", rank_script(str(head.env_file), job.rank_setup), *job.program]


def command(cluster: Cluster, job: Job) -> list[str]:
    """The controller's command that starts `job` on every rank of `cluster` from its launcher."""
    head = cluster.head
    env = rank_env(cluster, job)
    workdir = job.workdir or head.work_dir
    prefix = ""
    if job.backend == "ring" and not job.ring_hosts_file and not cluster.provisioned:
        job = dataclasses.replace(job, ring_hosts_file=LAYOUT_HOSTS_FILE)
    if job.backend == "mpi":
        if not cluster.provisioned and not job.hostfile and not job.map_by_node:
            job = dataclasses.replace(job, hostfile=LAYOUT_HOSTFILE)
        argv = mpirun_command(cluster, job, env)
        if job.hostfile:
            lines = shlex.quote("\n".join(cluster.hostfile_lines()))
            prefix = f"printf '%s\\n' {lines} > {shlex.quote(f'{workdir}/{job.hostfile}')} && "
    elif job.backend in MLX_BACKENDS:
        argv = launcher_command(cluster, job, env)
        # A hosts file of this layout's own, written where the launcher reads it.
        written = ((ring_hosts(cluster, job.mlx_envs), job.ring_hosts_file) if job.backend == "ring"
                   else (jaccl_hosts(cluster, job.backend, job.mlx_envs), JACCL_HOSTS_FILE))
        if written[1]:
            content = shlex.quote(json.dumps(written[0]))
            prefix = f"printf '%s\\n' {content} > {shlex.quote(f'{workdir}/{written[1]}')} && "
    elif job.backend == "direct":
        waits = venv_program(cluster, ["python", "-c", TAG_WAITS, job.tag]) if job.tag else []
        argv = ["env", *(f"{k}={v}" for k, v in sorted(env.items())), *waits,
                *set_up(job, venv_program(cluster, job.program))]
    else:
        raise UserError(f"unknown backend {job.backend!r}: choose from {', '.join(BACKENDS)}")
    line = remote.shell_line(head, argv, workdir=workdir)
    return remote.ssh_command(head, prefix + line, tty=job.interactive)


def _checked(marker: str) -> str:
    """A marker safe in a pattern and a shell line, or a ValueError."""
    if not _MARKER.match(marker):
        raise ValueError(f"marker {marker!r}: letters, digits, dashes, dots and slashes only")
    return marker


def stop_pattern(marker: str) -> str:
    """The pkill pattern of stop_command: a launcher's or a program's command line holding `marker`."""
    return f"(mpirun|{LAUNCHER}|python) .*{_checked(marker)}"


def stop_command(cluster: Cluster, marker: str) -> list[str]:
    """Stops a job's launcher (and with it every rank): the processes whose command line holds
    `marker` (a run's directory, a benchmark's tag, invoke run's JOB_TAG). mpirun and LAUNCHER stop
    every rank as they end. Should LAUNCHER have ended without (killed outright), its children (an
    ssh -tt or a shell per rank, listed first) are stopped once it has: a rank's shell stops its
    program on their hang-up or TERM (RANK_WAITS), on every node."""
    launchers = f"{LAUNCHER} .*{_checked(marker)}"
    return remote.ssh_command(cluster.head, (
        f'ranks=$(for p in $(pgrep -f {shlex.quote(launchers)}); do pgrep -P "$p"; done); '
        f"pkill -TERM -f {shlex.quote(stop_pattern(marker))}; "
        'for p in $(echo $ranks); do kill -TERM "$p" 2>/dev/null; done'))


def stop(cluster: Cluster, marker: str) -> None:
    """Stop a job on the launcher. Needed when ssh had no tty (output piped, CI, a timeout): then
    closing ssh does not hang up the remote side, and the launcher would run on unattended."""
    if not remote.run_quietly(cluster.head, stop_command(cluster, marker)[-1]):
        print(f"warning: could not reach {cluster.head.name} to stop {marker} there: check for "
              "its processes (invoke doctor)", flush=True)


# How long a rank has, once asked to stop (SIGTERM), before it is killed (SIGKILL): a rank waiting
# in a JACCL collective ignores SIGTERM (mlx #3910).
TERM_GRACE = 3.0


def stop_everywhere_line(marker: str, grace: float = TERM_GRACE) -> str:
    """A shell line that stops the job's processes on one node: SIGTERM, then SIGKILL to those
    still there after `grace` seconds."""
    pattern = shlex.quote(stop_pattern(marker))
    tries = max(1, int(grace / 0.5))
    return (f"pkill -TERM -f {pattern}; for i in $(seq {tries}); do pgrep -f {pattern} >/dev/null || "
            f"exit 0; sleep 0.5; done; pkill -KILL -f {pattern}; exit 0")


def stop_everywhere(cluster: Cluster, marker: str) -> list[str]:
    """Stop the job's launcher and ranks on every training node at once, not through the
    launcher, which a rank stuck in a collective can keep waiting. The nodes that did not
    answer (a node gone: its ranks went with it, or stop when it is back)."""
    line = stop_everywhere_line(marker)
    nodes = list({n.name: n for n in (cluster.head, *cluster.training_nodes)}.values())
    with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
        answered = list(pool.map(lambda node: remote.run_quietly(node, line, timeout=15), nodes))
    return [node.name for node, ok in zip(nodes, answered, strict=True) if not ok]


def frozen_nodes(cluster: Cluster, marker: str, timeout: float = 5) -> list[str]:
    """The training nodes where a process of the job (its command line holds `marker`) is stopped
    (state T: SIGSTOP, a debugger, a suspended job): a rank frozen there holds every other rank up
    in their collectives. A node that does not answer within `timeout` is not named (the node
    checks name it)."""
    # This shell holds the marker too, but it runs: only a stopped process is a T. Nodes that share
    # one Linux kernel (containers, the lab) see each other's processes: a node's own are those of
    # its network namespace (a Mac has no /proc: all its processes are its own).
    line = ("own=$(readlink /proc/self/ns/net 2>/dev/null); "
            f"for pid in $(pgrep -f -- {shlex.quote(_checked(marker))}); "
            'do [ -n "$own" ] && [ "$(readlink /proc/$pid/ns/net 2>/dev/null)" != "$own" ] && continue; '
            'ps -o stat= -p "$pid"; done | grep -c "^ *T"')

    def frozen(node: Node) -> bool:
        try:
            said = remote.output(node, remote.ssh_command(node, line, connect_timeout=3), timeout=timeout)
        except (remote.RemoteError, subprocess.TimeoutExpired):
            return False  # grep -c exits 1 on no match: nothing frozen there (or no answer)
        return said.strip().isdigit() and int(said) > 0

    nodes = cluster.training_nodes
    with ThreadPoolExecutor(max_workers=max(len(nodes), 1)) as pool:
        return [node.name for node, stopped in zip(nodes, pool.map(frozen, nodes), strict=True) if stopped]


# --- what a failed launch says ---------------------------------------------------------------------

_SIGNALLED = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+)")
_FIRST_FAILED = re.compile(r"Process name:\s*\[\[\d+,\d+\],(\d+)\]\s*Exit code:\s*(\d+)")
_RING_EXIT = re.compile(r"Node with rank (\d+) exited with code (-?\d+)")  # LAUNCHER; -N: signal N
_RANK_ERROR = re.compile(r"^rank (\d+): (?:error: )?(.+)$", re.MULTILINE)
_LAST_STEP = re.compile(r"iter\s+(\d+)/(\d+)\s+loss")


def which_rank(cluster: Cluster, output: str) -> str | None:
    """Which rank on which node failed, and how, as a launch's output says it (None: it does not)."""
    if match := _SIGNALLED.search(output):
        by_ip = {n.thunderbolt_ip: n.name for n in cluster.nodes}
        return (f"rank {match[1]} on {by_ip.get(match[2], match[2])} was killed by signal "
                f"{match[3]}")
    # LAUNCHER says each rank's end as it comes: a rank killed by a signal is the cause, the
    # others' ends (their peer gone) its effect, whichever is said first.
    for match in _RING_EXIT.finditer(output):
        if signal := _ring_signal(match[2]):
            return f"rank {match[1]} on {cluster.node_of_rank(int(match[1]))} was killed by signal {signal}"
    exited = "rank {rank} on {node} exited with status {detail}"
    for pattern, template in ((_FIRST_FAILED, exited), (_RING_EXIT, exited),
                              (_RANK_ERROR, "rank {rank} on {node}: {detail}")):
        if match := pattern.search(output):
            rank = int(match[1])
            return template.format(rank=rank, node=cluster.node_of_rank(rank), detail=match[2])
    return None


def _ring_signal(code: str) -> int | None:
    """The signal a LAUNCHER rank's exit code says it was killed by: -N for a rank run on the
    launcher itself (Python's returncode), 128 + N for one behind ssh (RANK_WAITS); None: none."""
    number = int(code)
    return -number if number < 0 else number - 128 if 128 < number < 160 else None


def rank_error(output: str) -> bool:
    """Whether a rank said why it failed (its error line, or a traceback): the run's own failure,
    not a node's."""
    return bool(_RANK_ERROR.search(output)) or "Traceback (most recent call last)" in output


def killed(output: str, code: int | None = None) -> bool:
    """Whether a rank was killed by SIGKILL: what the kernel's out-of-memory killer sends (and
    macOS's, jetsam). One process run directly exits 137 (128 + 9) through the shell."""
    signalled = [int(m[3]) for m in _SIGNALLED.finditer(output)]
    signalled += [_ring_signal(m[2]) for m in _RING_EXIT.finditer(output)]
    return 9 in signalled or code in (137, -9)


def killed_on(cluster: Cluster, output: str, code: int | None = None) -> str | None:
    """The node of a rank killed by SIGKILL, as the launch's output (or one process's exit status)
    says it; None when none was, or the output does not say where."""
    by_ip = {n.thunderbolt_ip: n.name for n in cluster.nodes}
    for match in _SIGNALLED.finditer(output):
        if match[3] == "9":
            return by_ip.get(match[2], match[2])
    for match in _RING_EXIT.finditer(output):
        if _ring_signal(match[2]) == 9:
            return cluster.node_of_rank(int(match[1]))
    return cluster.head.name if code in (137, -9) and cluster.world_size == 1 else None


def out_of_memory_hint(parallel: str, sure: bool = False) -> str:
    fix = ("--parallel tensor splits the model across the nodes, each holding a shard of it"
           if parallel != "tensor" else "more nodes give each a smaller shard of the model")
    why = "" if sure else "a rank killed with SIGKILL is most often out of memory: "
    return (f"{why}{fix}; a smaller batch_size or max_micro_batch, or grad_checkpoint, shrink the "
            "activations")


def describe_failure(cluster: Cluster, output: str, code: int | None = None, parallel: str = "data",
                     out_of_memory: Sequence[str] = (), counted: Sequence[str] = ()) -> str:
    """What a failed training launch's output says: which rank on which node, the last step, and
    what to do when the nodes `out_of_memory` ran out of it (their kernel's count of out-of-memory
    kills rose), or a rank was killed as the out-of-memory killer kills: from outside the run when
    its node's count is known (`counted`: read before and after) and did not rise."""
    parts = [part] if (part := which_rank(cluster, output)) else []
    steps = _LAST_STEP.findall(output)
    parts.append(f"last step reported: {steps[-1][0]} of {steps[-1][1]}" if steps
                 else "no step was reported")
    if out_of_memory:
        parts.append(f"out of memory: the kernel's out-of-memory killer ended a process on "
                     f"{', '.join(out_of_memory)} during the run; {out_of_memory_hint(parallel, sure=True)}")
    elif killed(output, code):
        node = killed_on(cluster, output, code)
        if node is not None and node in counted:
            parts.append(f"killed from outside the run, not for memory: SIGKILL, while {node}'s "
                         "out-of-memory count did not rise (a kill -9, a supervisor, a shutdown); "
                         "nothing in the run's settings caused it")
        else:
            parts.append(out_of_memory_hint(parallel))
    return "; ".join(parts)


# Lines of a failed launch's output that say why (the rest is mpirun's and LAUNCHER's boilerplate).
_CAUSE = re.compile(r"rank \d+: error|^ssh: |Node with rank \d+ exited|Error: |ORTE was unable|"
                    r"exited on signal|Process name:|Exit code:")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def failure_report(cluster: Cluster, backend: str, code: int | None, output: str,
                   inventory: str) -> str:
    """What to tell the user when a program's launch failed: how, the lines that say why, which
    node each rank was, and what to run next."""
    what = "timed out (raise --timeout if it was still making progress)" if code is None else (
        f"exited {code}" if code else "exited 0 but rank 0 printed no result")
    lines = [_ANSI.sub("", line).strip() for line in output.splitlines()]
    causes = list(dict.fromkeys(line for line in lines if _CAUSE.search(line)))[-8:]
    shown = "\n".join(f"  {line}" for line in causes) or "  (see the output above)"
    ranks = ", ".join(f"{rank} {name}" for rank, name in enumerate(cluster.rank_nodes()))
    return (f"the {backend} launch {what}:\n{shown}\n" + (f"ranks: {ranks}\n" if ranks else "")
            + f"check the cluster with: invoke doctor -i {inventory}")
