"""Reaching a node from the controller: ssh and rsync options in one place, and running there.

A node is reached the way Ansible reaches it (the connection provisioning recorded: user, key,
port, ssh_common_args), or locally when Ansible's connection is `local`. No prompt may ever block
a command: ssh runs in BatchMode and fails instead of asking.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
from collections.abc import Sequence

from mlxcluster.describe.cluster import Node
from mlxcluster.errors import UserError
from mlxcluster.paths import REPO

BATCH_MODE = ("-o", "BatchMode=yes")
# The first rsync that escapes remote paths for the remote shell itself (its --old-args undoes it).
RSYNC_ESCAPES_ARGS = (3, 2, 4)
_RSYNC_VERSION = re.compile(r"rsync\s+version\s+v?(\d+)\.(\d+)(?:\.(\d+))?")


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
    """`path` on `node` as rsync names it, quoted for the remote shell when this machine's rsync
    hands remote paths to it as they are (a plain path is the same either way)."""
    if is_local(node):
        return path
    return f"{destination(node)}:{shlex.quote(path) if rsync_passes_old_args() else path}"


def rsync_passes_old_args() -> bool:
    """Whether the local rsync passes remote paths to the remote shell unescaped, as rsync < 3.2.4
    (macOS's 2.6.9, openrsync) does and a newer one does under RSYNC_OLD_ARGS: quoting them
    ourselves is then needed, and would be escaped a second time otherwise."""
    # rsync reads the variable as a number: "0" keeps the new way.
    if _leading_int(os.environ.get("RSYNC_OLD_ARGS", "")):
        return True
    version = local_rsync_version()
    return version is not None and version < RSYNC_ESCAPES_ARGS


def _leading_int(text: str) -> int:
    """The number `text` starts with, as C's atoi reads it (0 when none)."""
    found = re.match(r"\s*([+-]?\d+)", text)
    return int(found.group(1)) if found else 0


def rsync_version(version_output: str) -> tuple[int, int, int] | None:
    """The version `rsync --version` reports (GNU rsync, or openrsync's "2.6.9 compatible")."""
    found = _RSYNC_VERSION.search(version_output)
    if found is None:
        return None
    major, minor, patch = found.groups()
    return int(major), int(minor), int(patch or 0)


@functools.cache
def local_rsync_version() -> tuple[int, int, int] | None:
    """This machine's rsync version; None when there is no rsync (or it says no version), taken as
    new: then no copy runs anyway, and a path is not escaped twice."""
    try:
        proc = subprocess.run(["rsync", "--version"], capture_output=True, text=True, timeout=10,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return rsync_version(proc.stdout)


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
