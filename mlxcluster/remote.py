"""Reaching a node from the controller: ssh and rsync options in one place, and running there.

A node is reached the way Ansible reaches it (the connection provisioning recorded: user, key,
port, ssh_common_args), or locally when Ansible's connection is `local`. No prompt may ever block
a command: ssh runs in BatchMode and fails instead of asking.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Sequence

from mlxcluster.cluster import Node
from mlxcluster.errors import UserError
from mlxcluster.paths import REPO

BATCH_MODE = ("-o", "BatchMode=yes")


class RemoteError(UserError):
    """A command on a node failed; the message names the node, the command and its output."""


def is_local(node: Node) -> bool:
    return (node.connection or {}).get("type") == "local"


def ssh_options(node: Node) -> list[str]:
    """`ssh` and its options to reach `node`, without the destination."""
    conn = node.connection or {}
    cmd = ["ssh", *BATCH_MODE]
    if conn.get("private_key_file"):
        cmd += ["-i", str(conn["private_key_file"])]
    if conn.get("port"):
        cmd += ["-p", str(conn["port"])]
    return cmd + shlex.split(conn.get("ssh_common_args") or "")


def destination(node: Node) -> str:
    conn = node.connection or {}
    user = conn.get("user")
    return f"{user}@{conn.get('host')}" if user else str(conn.get("host"))


def ssh_command(node: Node, remote: str, *, tty: bool = False,
                connect_timeout: int | None = None) -> list[str]:
    """How the controller runs the shell line `remote` on `node`: ssh as Ansible would, or bash."""
    if is_local(node):
        return ["bash", "-c", remote]
    cmd = ssh_options(node)
    if tty:
        # A tty makes Ctrl-C on the controller hang up mpirun, which then stops every rank.
        cmd.append("-tt")
    if connect_timeout:
        cmd += ["-o", f"ConnectTimeout={connect_timeout}"]
    return [*cmd, destination(node), remote]


def rsync_ssh(node: Node) -> str | None:
    """The -e argument for rsync to reach `node` like Ansible does (None: local)."""
    return None if is_local(node) else shlex.join(ssh_options(node))


def remote_path(node: Node, path: str) -> str:
    """`path` on `node` as rsync names it."""
    return path if is_local(node) else f"{destination(node)}:{path}"


def logs_in_as_root(node: Node) -> bool:
    """Whether commands on `node` run as root (mpirun then needs --allow-run-as-root)."""
    user = (node.connection or {}).get("user")
    if is_local(node) or user is None:
        return os.geteuid() == 0
    return user == "root"


def shell_line(node: Node, command: Sequence[str], workdir: str | None = None) -> str:
    """The shell line run on `node`: its env.sh sourced (venv, BLAS, libmpi), then the command."""
    line = f". {shlex.quote(str(node.env_file))} && "
    if workdir:
        line += f"cd {shlex.quote(workdir)} && "
    return line + shlex.join(command)


def output(node: Node, cmd: list[str], timeout: float = 3600) -> str:
    """Run a controller command that works on `node`; its stdout, or a RemoteError."""
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RemoteError(f"on {node.name}: {cmd[-1]}\nfailed ({proc.returncode}):\n"
                          f"{(proc.stdout + proc.stderr).strip()[-3000:]}")
    return proc.stdout


def run_quietly(node: Node, line: str, timeout: float = 20) -> bool:
    """Run a shell line on `node`, ignoring its output and status; False if it timed out."""
    try:
        subprocess.run(ssh_command(node, line), cwd=REPO, capture_output=True, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return False
    return True
