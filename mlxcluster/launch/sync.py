"""Moving code, data, models and results between the controller and the nodes (rsync).

Of a user's folder (data, model, a run's checkpoints, a job's own: invoke run --ship) only the files
mlxcluster/launch/shipment.py selected and checked are sent; the training code is the repository's own.

Code and data go from the controller to every node over the management link. The model
goes to the launcher once and fans out from there over the Thunderbolt link, so the
internet (or the controller's uplink) is used once, not once per node. Results come
back from the launcher, where rank 0 wrote them.

Each step is a (label, command) pair: plain data that `--dry-run` prints and `run_steps` runs.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from mlxcluster.describe.cluster import Cluster, Node
from mlxcluster.errors import UserError, shown
from mlxcluster.launch import remote, shipment
from mlxcluster.launch.shipment import Shipment
from mlxcluster.paths import PLAIN_NAME, REPO, TRAINING_CODE

# What a node needs of the repo to run the training entry point.
CODE_EXCLUDES = ("__pycache__", "*.pyc", "data/make_pirate.py")

Step = tuple[str, list[str]]
# Not a copy: in waves (run_steps), the steps after it wait for every step before it. Between the
# model's copy to the launcher and its copies from there, and before the checks of the copies.
WAIT: Step = ("wait for the copies before", [])


class SyncError(UserError):
    """A copy to or from a node failed; the message names the step and rsync's error."""


def _rsync(dest: str) -> list[str]:
    # --rsync-path creates the destination first (rsync < 3.2.3, as on macOS, has no --mkpath).
    return ["rsync", "-a", "--itemize-changes", f"--rsync-path=mkdir -p {shlex.quote(dest)} && rsync"]


def push(src: Path, node: Node, dest: str, *, delete: bool = True,
         excludes: tuple[str, ...] = ()) -> list[str]:
    """rsync `src`'s contents to `dest` on `node` (only what changed is sent): the repository's
    own code, or one file. A file `src` is sent alone into the folder `dest`: never the folder it
    sits in (a config kept in the home folder would take ~/.ssh with it). A user's folder (data, a
    model, a job's own: invoke run --ship) goes by `send`, never by this."""
    cmd = _rsync(dest)
    if delete:
        cmd.append("--delete")
    for pattern in excludes:
        cmd += ["--exclude", pattern]
    if (ssh := remote.rsync_ssh(node)) is not None:
        cmd += ["-e", ssh]
    cmd += [str(src) if src.is_file() else f"{src}/", remote.remote_path(node, f"{dest}/")]
    if remote.is_local(node):  # no remote side to run --rsync-path's mkdir: make the folder first
        return ["sh", "-c", 'mkdir -p "$1" && shift && exec "$@"', "push", dest, *cmd]
    return cmd


def send(shipment: Shipment, node: Node, dest: str, *, delete: bool = True) -> list[str]:
    """rsync exactly the shipment's files to the folder `dest` on `node`, nothing else of its folder
    (mlxcluster/launch/shipment.py checked each of them). A symlink among them, checked to stay inside
    the folder, arrives as the file it names. With `delete`, whatever else `dest` holds goes (a
    split an earlier data set of that name had), so that the copy is the shipment."""
    cmd = [*_rsync(dest), "--copy-links"]
    if delete:
        cmd += ["--delete", "--delete-excluded"]
    cmd += shipment.rsync_filter()
    if (ssh := remote.rsync_ssh(node)) is not None:
        cmd += ["-e", ssh]
    return [*cmd, f"{shipment.root}/", remote.remote_path(node, f"{dest}/")]


def push_checkpoints(results: Path, node: Node, run_dir: str) -> Step | None:
    """The step that gives the launcher the run's checkpoints it lacks (a cleaned or replaced
    launcher would otherwise restart the run from step 0); None when the run has none. What it
    has is kept: rank 0 checks every checkpoint before resuming from it."""
    if (checkpoints := shipment.checkpoints(results)) is None:
        return None
    cmd = send(checkpoints, node, f"{run_dir}/checkpoints", delete=False)
    return (f"restore the run's checkpoints on {node.name}", [cmd[0], "--ignore-existing", *cmd[1:]])


def push_code(cluster: Cluster, training_dir: Path = TRAINING_CODE) -> list[Step]:
    """The steps that bring the training code to every node that trains."""
    return [(f"sync code to {node.name}",
             push(training_dir, node, f"{node.work_dir}/training", excludes=CODE_EXCLUDES))
            for node in cluster.training_nodes]


def pull(node: Node, src: str, dest: Path, excludes: tuple[str, ...] = ()) -> list[str]:
    """rsync a directory on `node` back to the controller."""
    cmd = ["rsync", "-a", *(arg for pattern in excludes for arg in ("--exclude", pattern))]
    if (ssh := remote.rsync_ssh(node)) is not None:
        cmd += ["-e", ssh]
    return [*cmd, remote.remote_path(node, f"{src}/"), f"{dest}/"]


class CheckpointPulls:
    """The run's folder brought back to the controller each time rank 0 reports a checkpoint
    saved, in the background: a launcher lost for good (powered off, not only unplugged), or a
    controller killed before it collected, still leaves the controller the latest checkpoint and
    the settings (config.yaml) that --resume and a restart on the other nodes go on from. One pull
    at a time; a save reported during one is pulled after it. Hidden files (a checkpoint or a file
    still being written) stay behind."""

    SAVED = re.compile(r"saved \S*checkpoints/\d{7}\s*$")

    def __init__(self, node: Node, run_dir: str, results: Path):
        self.command = pull(node, run_dir, results, excludes=(".*",))
        self._due, self._stop = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    def __call__(self, line: str) -> None:
        """relay's on_line: a save reported starts (or queues) a pull."""
        if not self.SAVED.search(line):
            return
        self._due.set()
        if self._thread is None:
            self._thread = threading.Thread(target=self._pulls, name="checkpoint-pulls", daemon=True)
            self._thread.start()

    def _pulls(self) -> None:
        while not self._stop.is_set() or self._due.is_set():
            if self._due.wait(timeout=0.2):
                self._due.clear()
                subprocess.run(self.command, cwd=REPO, capture_output=True, timeout=600,
                               stdin=subprocess.DEVNULL)

    def wait(self, timeout: float = 60) -> None:
        """Let the pull under way (and one queued) end, before the run's results are collected."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)


def fan_out(cluster: Cluster, model: Shipment, path: str) -> list[Step]:
    """The steps that copy the model's files at `path` from the launcher to every other node that
    trains: the same files the launcher got, by the same filter.

    Run on the launcher through ssh: it reaches each node over the cable between them (on a
    bridge, the bridge), or its management address when no cable joins them
    (Cluster.path_towards), with the mesh keys that ssh_mesh installed (no prompt: BatchMode).
    """
    head = cluster.head
    steps = []
    for node in cluster.training_nodes:
        if node.name == head.name or not node.reachable:
            continue
        route = cluster.path_towards(head, node)
        rsync = shlex.join(["rsync", "-a", "--delete", "--delete-excluded", *model.rsync_filter(),
                            "-e", shlex.join(["ssh", *remote.BATCH_MODE]),
                            f"--rsync-path=mkdir -p {shlex.quote(path)} && rsync",
                            f"{path}/", f"{route.address}:{path}/"])
        way = "over the cluster link" if route.cabled else "over the management network (no cable)"
        steps.append((f"copy the model from {head.name} to {node.name} {way}",
                      remote.ssh_command(head, rsync)))
    return steps


def verify_model(node: Node, model_dir: str) -> list[str]:
    """Check the model on `node` against its manifest (sha256 of every file)."""
    check = ["python", "-m", "training.model", "verify", model_dir]
    return remote.ssh_command(node, remote.shell_line(node, check, workdir=node.work_dir))


@dataclass(frozen=True)
class Placed:
    """Where a run's inputs are on every node (the same paths everywhere)."""

    data: str
    model: str
    config: str | None


def plain_name(path: Path, what: str) -> str:
    # A name at all: `--data /` would make the destination the folder of every dataset, which
    # rsync --delete would empty.
    name = path.resolve().name if path.name in ("", ".", "..") else path.name
    if not PLAIN_NAME.fullmatch(name):
        raise UserError(f"--{what} {shown(path)}: its name {name!r} cannot be a folder name on the nodes; "
                        f"give a {what} whose name has letters, digits and . _ - + @ = , only "
                        "(and is not / or a hidden folder)")
    return name


def model_place(cluster: Cluster, model: Path, installed: str | None = None) -> str:
    """Where the model is on every node: where provisioning `installed` it, else under models/."""
    if installed:
        return installed
    head = cluster.head
    given = f"{head.models_dir}/{plain_name(model, 'model')}"
    if head.model and given == head.model.get("path"):
        # Another model under the provisioned one's name: copying it there would replace the
        # provisioned copy, and the next provisioning would replace it back.
        given = f"{head.models_dir}/given/{model.name}"
    return given


def placement(cluster: Cluster, data: Path, model: Path, config: Path | None = None,
              installed: str | None = None) -> Placed:
    head = cluster.head
    for path, what in ((data, "data"), (config, "config")):
        if path is not None:
            plain_name(path, what)
    return Placed(data=f"{head.work_dir}/data/{data.name}", model=model_place(cluster, model, installed),
                  config=f"{head.work_dir}/config/{config.name}" if config else None)


def training_inputs(cluster: Cluster, data: Shipment, model: Shipment, config: Path | None,
                    installed: str | None = None) -> tuple[list[Step], Placed]:
    """The steps that put code, data, config and model on every node that trains, and where: of
    the data and the model, only the files the shipments name.

    A model `installed` on every node by provisioning (its path there) is only verified.
    """
    head = cluster.head
    placed = placement(cluster, data.root, model.root, config, installed)
    steps: list[Step] = []
    for node, code in zip(cluster.training_nodes, push_code(cluster), strict=True):
        steps.append(code)
        steps.append((f"sync data to {node.name}", send(data, node, placed.data)))
        if config:
            steps.append((f"sync config to {node.name}",
                          push(config, node, f"{head.work_dir}/config", delete=False)))
    return [*steps, *model_steps(cluster, model, placed.model, installed=bool(installed))], placed


def model_steps(cluster: Cluster, model: Shipment, path: str, *, installed: bool) -> list[Step]:
    """The steps that put the model at `path` on every node that trains: to the launcher, then
    over the cluster link from it (none when provisioning `installed` it there), and verified."""
    head = cluster.head
    steps: list[Step] = []
    if not installed:
        steps += [(f"copy the model to {head.name}", send(model, head, path)), WAIT]
        steps += fan_out(cluster, model, path)
    # A check runs the training code (synced with the steps before) on the node's copy.
    return [*steps, WAIT, *((f"verify the model's checksums on {node.name}", verify_model(node, path))
                            for node in cluster.training_nodes)]


def waves(steps: list[Step]) -> list[list[Step]]:
    """The steps between one WAIT and the next, each group in order (none empty)."""
    grouped: list[list[Step]] = [[]]
    for step in steps:
        if step == WAIT:
            grouped.append([])
        else:
            grouped[-1].append(step)
    return [wave for wave in grouped if wave]


def run_steps(steps: list[Step], *, dry_run: bool = False, in_waves: bool = False) -> None:
    """Run each step, announcing it, one after the other; `in_waves`: the steps between two WAITs
    at once (each node's copies, which go to different nodes, or from the launcher to each), the
    first failure raised once its wave is over. With dry_run print the commands instead."""
    for wave in waves(steps) if in_waves else [[step] for step in steps if step != WAIT]:
        if dry_run:
            for label, cmd in wave:
                print(f"# {label}\n{shlex.join(cmd)}", flush=True)
            continue
        for label, _ in wave:
            print(f"==> {label}", flush=True)
        with ThreadPoolExecutor(max_workers=len(wave)) as pool:
            failed = [problem for problem in pool.map(_run_step, wave) if problem]
        if failed:
            raise SyncError("\n".join(failed))


def _run_step(step: Step) -> str:
    """Run one step: "" when it succeeded, else what failed and rsync's (or ssh's) words."""
    label, cmd = step
    if cmd[0] == "rsync" and ":" not in cmd[-1]:
        # To a local node: rsync's --rsync-path (which makes the destination) is not used.
        Path(cmd[-1]).mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        return f"{label} failed ({proc.returncode}):\n{proc.stderr.strip()[-3000:]}"
    return ""
