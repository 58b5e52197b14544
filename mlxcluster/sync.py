"""Moving code, data, models and results between the controller and the nodes (rsync).

Code and data go from the controller to every node over the management link. The model
goes to the launcher once and fans out from there over the Thunderbolt link, so the
internet (or the controller's uplink) is used once, not once per node. Results come
back from the launcher, where rank 0 wrote them.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from mlxcluster.launch import Cluster, Node, remote_path, rsync_ssh, ssh_command

# What a node needs of the repo to run the training entry point.
CODE_EXCLUDES = ("__pycache__", "*.pyc", "data/make_pirate.py")


def node_paths(node: Node) -> dict[str, str]:
    """Where things live on a node (under its cluster_root, the same on every node)."""
    root = node.cluster_root or ""
    return {"work": f"{root}/work", "models": f"{root}/models", "runs": f"{root}/runs"}


def push(src: Path, node: Node, dest: str, *, delete: bool = True,
         excludes: tuple[str, ...] = ()) -> list[str]:
    """rsync ``src``'s contents to ``dest`` on ``node`` (only what changed is sent)."""
    # --rsync-path creates the destination first (rsync < 3.2.3, as on macOS, has no --mkpath).
    cmd = ["rsync", "-a", "--itemize-changes", f"--rsync-path=mkdir -p {shlex.quote(dest)} && rsync"]
    if delete:
        cmd.append("--delete")
    for pattern in excludes:
        cmd += ["--exclude", pattern]
    if (ssh := rsync_ssh(node)) is not None:
        cmd += ["-e", ssh]
    return [*cmd, f"{src}/", remote_path(node, f"{dest}/")]


def push_code(cluster: Cluster, training_dir: Path) -> list[tuple[str, list[str]]]:
    """(label, rsync) that bring the training code to every node that trains."""
    work = node_paths(cluster.head)["work"]
    return [(f"sync code to {node.name}",
             push(training_dir, node, f"{work}/training", excludes=CODE_EXCLUDES))
            for node in cluster.training_nodes]


def pull(node: Node, src: str, dest: Path) -> list[str]:
    """rsync a directory on ``node`` back to the controller."""
    cmd = ["rsync", "-a"]
    if (ssh := rsync_ssh(node)) is not None:
        cmd += ["-e", ssh]
    return [*cmd, remote_path(node, f"{src}/"), f"{dest}/"]


def fan_out(cluster: Cluster, path: str) -> list[tuple[str, list[str]]]:
    """(node, command) that copy ``path`` from the launcher to every other node that trains, over
    the cluster link.

    Run on the launcher through ssh: it reaches the others by their Thunderbolt IP with the
    mesh keys that ssh_mesh installed (no prompt: BatchMode).
    """
    head = cluster.head
    commands = []
    for node in cluster.training_nodes:
        if node.name == head.name or not node.reachable:
            continue
        rsync = shlex.join(["rsync", "-a", "--delete", "-e", "ssh -o BatchMode=yes",
                            f"--rsync-path=mkdir -p {shlex.quote(path)} && rsync",
                            f"{path}/", f"{node.thunderbolt_ip}:{path}/"])
        commands.append((node.name, ssh_command(head, rsync)))
    return commands


def verify_model(cluster: Cluster, node: Node, model_dir: str) -> list[str]:
    """Check the model on ``node`` against its manifest (sha256 of every file)."""
    paths = node_paths(node)
    remote = (f". {shlex.quote(str(node.env_file))} && cd {shlex.quote(paths['work'])} && "
              f"python -m training.model verify {shlex.quote(model_dir)}")
    return ssh_command(node, remote)
