"""`invoke run -- CMD ARGS...`: any program on every slot, launched as training is.

The same launch builder as invoke train (mlxcluster/launch/builder.py): the rendered hostfile, the
cluster link pinned, env.sh and the environment training's ranks get; the training code is synced
first, so `python -m training.examples.logistic_regression` works on a freshly provisioned cluster.

What it adds for programs of one's own:
- the words after `--` reach the program exactly as the shell gave them to invoke (`program_of`);
- a script named in the command (`python ./job.py`, `bash /abs/path/job.sh`, `./job.sh`) is sent to
  every node and the command runs it there (`shipped`); `--ship DIR` sends a folder's files, and
  the program runs from it. Of that folder only the job's own files go (`job_files`), chosen and
  checked by the selector every copy to the nodes goes through (mlxcluster/launch/shipment.py):
  never a hidden file or folder (.ssh, .netrc, .aws, .cache/huggingface/token, .env, .git), a file
  named as credentials are (id_rsa, *.pem, service-account*.json, ...), a symlink that leads out of
  the folder or to a hidden or secret file, nor what is not a regular file; what was left out is said
  in one line (`Plan.notices`), and a home folder, / or a folder of too many files is refused. Both
  by rsync, only what changed, each into a place of its own under the work directory (`shipped/`),
  which the training code's sync leaves alone;
- every rank gets its rank and the rendezvous of frameworks that bring their own (PyTorch's
  MASTER_ADDR/MASTER_PORT, XGBoost's tracker, Horovod's names): `RENDEZVOUS_NAMES`;
- the job is tagged (`marker`: builder.JOB_TAG on its launcher's command line), and Ctrl-C or
  SIGTERM stops every rank on every node as invoke train's are stopped (relay.supervise);
- nodes left out after a fault stay out, as for invoke train (restarts.layout): each said in a
  line, let back in once its checks pass.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from mlxcluster.describe.cluster import Cluster, Node, Recorded
from mlxcluster.errors import Interrupted, UserError, shown
from mlxcluster.jobs import restarts
from mlxcluster.launch import builder, relay, remote, runs, shipment, sync
from mlxcluster.paths import REPO

# Interpreters whose first argument that is not an option is the script they run.
INTERPRETERS = ("python", "python3", "bash", "sh", "zsh", "perl", "ruby", "node", "Rscript")
PYTHONS = ("python", "python3")
# Python's options that take the next word as their value (python -W ignore job.py).
PYTHON_VALUED_OPTIONS = ("-W", "-X", "--check-hash-based-pycs")
SHIPPED = "shipped"  # under each node's work directory
DRY_RUN_PORT = 29500  # what a dry run shows: the real launch asks the launcher for a free port
# A --ship folder's files each take a rule of rsync's filter on its command line, whose length the
# system caps (1 MB of arguments and environment on macOS): a job's own files are far fewer.
MOST_SHIPPED_FILES = 10_000
MOST_FILTER_CHARS = 512 * 1024
NAMED_LEFT_OUT = 5  # the names a note shows of what a --ship folder left out; the rest are counted
# Why an entry of a --ship folder stays here, in the order a note names them: first what the job may
# have meant to send (a link out of the folder, a key it reads), then the hidden folders every
# project has (.git, .venv).
LEFT_OUT_KINDS = ("link", "special", "secret", "hidden")

# Set on every rank from the launcher's own variables: Open MPI's, or MLX_RANK (mlx-cluster-launch
# starts one rank per host entry: local rank 0 of 1); one rank alone: 0 of 1.
RANK_SETUP = (
    'export RANK="${OMPI_COMM_WORLD_RANK:-${MLX_RANK:-0}}" LOCAL_RANK="${OMPI_COMM_WORLD_LOCAL_RANK:-0}" '
    'LOCAL_WORLD_SIZE="${OMPI_COMM_WORLD_LOCAL_SIZE:-1}"; '
    'export DMLC_TASK_ID="$RANK" HOROVOD_RANK="$RANK" HOROVOD_LOCAL_RANK="$LOCAL_RANK" '
    'HOROVOD_LOCAL_SIZE="$LOCAL_WORLD_SIZE"')
# Every name a rank gets, documented in docs/any-job.md: per rank (RANK_SETUP), then the same on all.
RENDEZVOUS_NAMES = ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "DMLC_TASK_ID", "DMLC_NUM_WORKER", "DMLC_TRACKER_URI", "DMLC_TRACKER_PORT",
                    "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE")
FREE_PORT = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"


def program_of(argv: Sequence[str], remainder: str = "") -> list[str]:
    """The program: the words after the first `--` of the command line, each as the shell gave it.
    (invoke's own remainder is those words joined by spaces: split again, `python -c "import x;
    ..."` would lose its quoting.) `remainder` is for a caller without a command line."""
    program = list(argv[list(argv).index("--") + 1:]) if "--" in argv else shlex.split(remainder)
    if not program:
        raise UserError("nothing to run: invoke run -- CMD ARGS...  (e.g. invoke run -- hostname)")
    return program


@dataclass(frozen=True)
class Plan:
    """What invoke run does: send, then launch."""

    steps: list[sync.Step]
    command: list[str]
    program: list[str]  # as every rank runs it (shipped paths in place of the controller's)
    workdir: str
    marker: str  # the job's tag: what names its processes on the launcher (builder.stop)
    notices: tuple[str, ...] = ()  # said before the steps, by the dry run as by the run itself


def new_marker() -> str:
    """A job's own tag: when it started, and a few random letters (two jobs of one second)."""
    return f"job-{runs.new_id()}-{secrets.token_hex(3)}"


def _place(node: Node, local: Path) -> str:
    """A shipped file's or folder's place on the nodes: its name, and a digest of its path here
    (two job.py of two folders do not meet)."""
    digest = hashlib.sha256(str(local).encode()).hexdigest()[:10]
    return f"{node.work_dir}/{SHIPPED}/{local.name}-{digest}"


def script_index(program: Sequence[str]) -> int | None:
    """Which word of the program names the script it runs: the program itself when it is a
    relative path (./job.sh), or an interpreter's first word that is not an option (python -u
    job.py); None for `python -m`, `-c` and programs installed on the nodes."""
    first = PurePosixPath(program[0]).name
    if "/" in program[0] and not program[0].startswith("/"):
        return 0
    if first not in INTERPRETERS and not first.startswith("python3."):
        return None
    i = 1
    while i < len(program):
        word = program[i]
        if word in ("-m", "-c", "-e", "--eval", "-"):
            return None
        if not word.startswith("-"):
            return i
        i += 2 if word in PYTHON_VALUED_OPTIONS else 1
    return None


def _left_out_said(left_out: Sequence[tuple[str, str]]) -> str:
    """What a --ship folder left out, in a few words: how many of which kinds, and the first names
    (`left_out`: kind and name, a hidden folder's name ending in /)."""
    many = len(left_out) > 1
    s = "s" if many else ""
    kinds = {kind for kind, _ in left_out}
    adjectives = [kind for kind in ("hidden", "secret") if kind in kinds]
    phrases = [f"{' or '.join(adjectives)} file{s}"] if adjectives else []
    if "link" in kinds:
        phrases.append(f"link{s} out of the folder")
    if "special" in kinds:
        phrases.append("links to folders or special files" if many else "link to a folder or special file")
    said = phrases[0] if len(phrases) == 1 else f"{', '.join(phrases[:-1])} and {phrases[-1]}"
    ordered = sorted(left_out, key=lambda entry: LEFT_OUT_KINDS.index(entry[0]))  # stable: walk order
    names = ", ".join(name for _, name in ordered[:NAMED_LEFT_OUT])
    rest = len(left_out) - NAMED_LEFT_OUT
    return f"{len(left_out)} {said} ({names}{f' and {rest} more' if rest > 0 else ''})"


def _kind_left_out(folder: Path, path: Path, name: str, *, walked: bool) -> str | None:
    """Why the entry `name` (relative to `folder`, resolved) at `path` stays here, or None when it
    goes: a file of the job's own, or a symlink to one inside the folder (it arrives as the file);
    with `walked`, a folder os.walk descends into (not a symlink: one may lead back into its own
    folder, for ever)."""
    if shipment.is_hidden(name):
        return "hidden"
    if not walked and shipment.is_secret(name):
        return "secret"
    if path.is_symlink():
        target = path.resolve()
        if not target.is_relative_to(folder):
            return "link"
        inside = str(target.relative_to(folder))
        if shipment.is_hidden(inside):
            return "hidden"  # tok -> .cache/huggingface/token
        if shipment.is_secret(inside):
            return "secret"  # key -> keys/id_rsa
        return None if path.is_file() and not walked else "special"
    return None if (path.is_dir() if walked else path.is_file()) else "special"


def job_files(folder: Path, what: str) -> tuple[shipment.Shipment, str | None]:
    """The files of a --ship folder (resolved) that go to the nodes, checked by shipment.select,
    and a line that says what was left out (None when nothing was): hidden files and folders
    anywhere on the path (a hidden folder is not walked: .git and .venv can be huge, .ssh secret),
    files named as credentials are (shipment.SECRET_NAMES), symlinks that lead out of the folder or
    to a hidden or secret file in it, and what is not a regular file. A folder of more files than
    rsync's command line can list, or of none that can go, is refused."""
    chosen: list[str] = []
    left_out: list[tuple[str, str]] = []
    too_many = shipment.ShipmentError(  # raised once the walk finds one too many, before the rest
        f"{what}: more than {MOST_SHIPPED_FILES} files to send, more than a job's own: ship a smaller "
        "folder that holds only the job's own files (its code and the data it reads)")
    for top, dirs, files in os.walk(folder):  # symlinked folders are listed, not walked
        here = Path(top)
        for name in sorted(dirs):
            relative = str((here / name).relative_to(folder))
            if (kind := _kind_left_out(folder, here / name, relative, walked=True)) is not None:
                left_out.append((kind, f"{relative}/" if kind == "hidden" else relative))
                dirs.remove(name)
        dirs.sort()
        for name in sorted(files):
            relative = str((here / name).relative_to(folder))
            if (kind := _kind_left_out(folder, here / name, relative, walked=False)) is not None:
                left_out.append((kind, relative))
            elif len(chosen) == MOST_SHIPPED_FILES:
                raise too_many
            else:
                chosen.append(relative)
    if not chosen:
        left = f": it holds only {_left_out_said(left_out)}, which never go to the nodes" if left_out else ""
        raise shipment.ShipmentError(f"{what}: no file of {shown(folder)} can be sent{left}; "
                                     "ship a folder that holds the job's own files")
    shipped_files = shipment.select(folder, chosen, what)
    if len(" ".join(shipped_files.rsync_filter())) > MOST_FILTER_CHARS:
        raise too_many
    if not left_out:
        return shipped_files, None
    link_advice = ("; copy into the folder a file the job needs instead of linking it"
                   if any(kind == "link" for kind, _ in left_out) else "")
    return shipped_files, (f"{what}: left out {_left_out_said(left_out)}: "
                           f"{'they never go' if len(left_out) > 1 else 'it never goes'} to the nodes"
                           f"{link_advice}")


def shipped(cluster: Cluster, program: Sequence[str], ship: Path | None, cwd: Path,
            ) -> tuple[list[sync.Step], list[str], str | None, list[str]]:
    """The steps that send the script the program names (a file here) and the job's own files of
    the folder `ship` (`job_files`) to every node, the program with the script's place on the
    nodes, the folder to run from, and what to tell the user (what the folder left out)."""
    steps: list[sync.Step] = []
    notices: list[str] = []
    program = list(program)
    head = cluster.head
    workdir = None
    folder = None
    files: tuple[str, ...] = ()
    if ship is not None:
        what = f"--ship {ship}"
        folder = (cwd / ship).resolve()
        if not folder.is_dir():
            raise UserError(f"{what}: not a folder on this machine")
        shipment.refuse_broad(folder, what)
        if folder == REPO or REPO.is_relative_to(folder):
            raise UserError(f"{what}: holds this repository; ship the folder of your job only")
        job, notice = job_files(folder, what)
        files = job.files
        notices += [notice] if notice else []
        workdir = _place(head, folder)
        # delete: the nodes' copy is the shipment, so a file gone from the folder goes from the nodes.
        steps += [(f"send {folder.name}/ ({len(files)} file{'s' * (len(files) > 1)}) to {node.name}",
                   sync.send(job, node, _place(node, folder), delete=True))
                  for node in cluster.training_nodes]
    index = script_index(program)
    if index is not None:
        # A relative script of a shipped folder is the folder's (the command runs from it), else
        # the one here.
        inside = folder is not None and not Path(program[index]).is_absolute() \
            and (folder / program[index]).is_file()
        script = (folder / program[index] if inside else cwd / program[index]).absolute()
        if script.is_file():
            if folder is not None and script.resolve().is_relative_to(folder):
                name = str(script.resolve().relative_to(folder))
                if name not in files:
                    raise UserError(f"{program[index]}: left out of --ship {ship}, as every hidden or "
                                    "secret file is: give the script a name that is neither, outside "
                                    "hidden folders")
                program[index] = name  # run from the shipped folder
            else:
                # Through the selector as every copy: the file alone, never one named as a key is.
                if shipment.is_secret(script.name) or shipment.is_hidden(str(script.resolve()).lstrip("/")):
                    raise UserError(f"{program[index]}: a hidden or secret file, which is never sent to the "
                                    "nodes: put the script in a folder of its own, named plainly")
                alone = shipment.select(script.parent, [script.name], program[index])
                steps += [(f"send {script.name} to {node.name}",
                           sync.send(alone, node, _place(node, script.parent), delete=False))
                          for node in cluster.training_nodes]
                program[index] = f"{_place(head, script.parent)}/{script.name}"
        elif index == 0 or script.suffix in (".py", ".sh", ".pl", ".rb", ".js", ".R"):
            raise UserError(f"{program[index]}: no such file here ({cwd}); name a script on this machine, "
                            "or `python -m` a module of the training code")
    return steps, program, workdir, notices


def rendezvous(cluster: Cluster, port: int) -> dict[str, str]:
    """What every rank gets alike: the world's size and where rank 0's launcher meets the others
    (its address on the cluster link; in links mode, where no one address reaches every node, its
    management address)."""
    head = cluster.head
    address = (head.management_ip or str(head.connection.get("host") or head.name)) if cluster.cables \
        else head.thunderbolt_ip
    size = str(cluster.world_size)
    return {"WORLD_SIZE": size, "MASTER_ADDR": address, "MASTER_PORT": str(port),
            "DMLC_NUM_WORKER": size, "DMLC_TRACKER_URI": address, "DMLC_TRACKER_PORT": str(port),
            "HOROVOD_SIZE": size}


def free_port(head: Node) -> int:
    """A port free on the launcher now, for the job's rendezvous."""
    output = remote.output(head, remote.ssh_command(head, remote.shell_line(
        head, ["python", "-c", FREE_PORT])), timeout=60)
    return int(output.split()[-1])


def launcher_for(cluster: Cluster, program: Sequence[str], backend: str | None) -> str:
    """The backend that starts the program: mpirun by default, as it starts any program; MLX's own
    (ring, jaccl, jaccl-ring: the venv's mlx-cluster-launch) when asked, for Python programs only."""
    backend = builder.backend_for(cluster, backend or "mpi")
    name = PurePosixPath(program[0]).name
    if backend in builder.MLX_BACKENDS and name not in PYTHONS and not name.startswith("python3."):
        raise UserError(f"--backend {backend}: MLX's backends start Python programs only, not "
                        f"{program[0]!r}: invoke run --backend {backend} -- python job.py ...; or leave "
                        "out --backend (mpirun starts any program)")
    return backend


def plan(cluster: Cluster, program: Sequence[str], *, ship: Path | None = None, cwd: Path | None = None,
         interface: str | None = None, interactive: bool = False, port: int = DRY_RUN_PORT,
         backend: str | None = None, marker: str | None = None) -> Plan:
    """invoke run's steps and command; nothing is run. `marker`: the job's tag (default: a new one)."""
    launcher = launcher_for(cluster, program, backend)
    steps = sync.push_code(cluster)
    sent, program, workdir, notices = shipped(cluster, program, ship, cwd or Path.cwd())
    steps += sent
    marker = marker or new_marker()
    # The launcher of MLX's backends runs the venv's python whatever the program calls it.
    job = builder.Job(["python", *program[1:]] if launcher in builder.MLX_BACKENDS else program,
                      backend=launcher, interface=interface, interactive=interactive, workdir=workdir,
                      env=tuple(rendezvous(cluster, port).items()), rank_setup=RANK_SETUP, tag=marker)
    return Plan(steps, builder.command(cluster, job), program, workdir or cluster.head.work_dir, marker,
                tuple(notices))


def run(cluster: Cluster | Recorded, program: list[str], *, ship: Path | None = None,
        interface: str | None = None, backend: str | None = None, dry_run: bool = False) -> None:
    """Send the code (and the job's script or folder), then run `program` on every slot; a
    UserError with its exit status if it fails, Interrupted once every rank was stopped on Ctrl-C
    or SIGTERM. `cluster`: the recorded one, less the nodes left out after a fault (as for invoke
    train: each said in a line, let back in once its checks pass), or a layout run as it is."""
    if isinstance(cluster, Recorded):
        cluster, notes = restarts.layout(cluster, dry_run=dry_run, doing="running")
        for note in notes:
            print(f"# {note}")
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    port = DRY_RUN_PORT if dry_run else free_port(cluster.head)
    the_plan = plan(cluster, program, ship=ship, interface=interface, interactive=interactive, port=port,
                    backend=backend)
    for notice in the_plan.notices:
        print(f"# {notice}" if dry_run else f"==> {notice}", flush=True)
    sync.run_steps(the_plan.steps, dry_run=dry_run)
    if dry_run:
        print(f"# run on {cluster.head.name} (in {the_plan.workdir}; MASTER_PORT: a free port of "
              f"{cluster.head.name} at launch)\n{shlex.join(the_plan.command)}")
        return
    try:
        # Without a tty (output piped, CI, a service), ssh hangs nothing up on the launcher: the
        # job is stopped there, and mpirun or mlx-cluster-launch stops every rank. Its stderr stays its own.
        with relay.terminated_as_interrupted():
            relayed = relay.supervise(cluster, the_plan.command, the_plan.marker, stderr=None)
    except KeyboardInterrupt:
        nodes = ", ".join(n.name for n in cluster.training_nodes)
        raise Interrupted(f"interrupted: every rank of the job was stopped ({nodes})") from None
    if relayed.code:
        raise UserError(code=relayed.code)

