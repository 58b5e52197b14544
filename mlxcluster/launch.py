"""How jobs are launched on the cluster: the mpirun (or mlx.launch) command line, and ssh.

Everything here is a plain function of the cluster layout that provisioning recorded in
``build/<inventory>/cluster.json`` (see roles/hostfile/templates/cluster.json.j2), so the
tests assert on exact command lines without any host.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Variables env.sh (roles/python_env) sets that every rank needs, per launcher OS.
ENV_FILE_VARS = {
    "Debian": ("PATH", "VIRTUAL_ENV", "LD_PRELOAD"),
    "Darwin": ("PATH", "VIRTUAL_ENV", "DYLD_LIBRARY_PATH"),
}


class LaunchError(RuntimeError):
    """The cluster cannot be launched as it is; the message says what to fix."""


@dataclass(frozen=True)
class Node:
    name: str
    thunderbolt_ip: str
    slots: int
    os_family: str = "Debian"
    thunderbolt_interface: str | None = None
    thunderbolt_prefix: int = 24
    thunderbolt_mtu: int = 0  # 0: not recorded
    cluster_root: str | None = None
    venv: str | None = None
    env_file: str | None = None
    openmpi_prefix: str | None = None
    reachable: bool = True
    connection: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Cluster:
    launcher: str
    nodes: tuple[Node, ...]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Cluster:
        nodes = tuple(Node(**{k: v for k, v in node.items() if k in Node.__dataclass_fields__})
                      for node in data["nodes"])
        return cls(launcher=data["launcher"], nodes=nodes)

    @classmethod
    def load(cls, path: Path) -> Cluster:
        if not path.exists():
            raise LaunchError(f"{path} is missing: provision the cluster first "
                              "(invoke provision -i <inventory>)")
        return cls.from_json(json.loads(path.read_text()))

    @property
    def head(self) -> Node:
        return next(n for n in self.nodes if n.name == self.launcher)

    @property
    def training_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.slots > 0]

    @property
    def world_size(self) -> int:
        return sum(n.slots for n in self.training_nodes)

    def hostfile_lines(self) -> list[str]:
        return [f"{n.thunderbolt_ip} slots={n.slots}" for n in self.training_nodes]


def hostfile_entries(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def check_ready(cluster: Cluster, hostfile_text: str) -> None:
    """Refuse to launch on a cluster that provisioning has not (fully) prepared."""
    down = [n.name for n in cluster.training_nodes if not n.reachable]
    if down:
        raise LaunchError(f"{', '.join(down)} could not be reached when the cluster was last "
                          "provisioned: bring it back and run invoke provision, or set its "
                          "mpi_slots: 0")
    if hostfile_entries(hostfile_text) != cluster.hostfile_lines():
        raise LaunchError("the rendered hostfile does not match the inventory: run invoke "
                          "provision (or invoke hostfile) after editing the inventory")
    head = cluster.head
    if not head.venv or not head.env_file or not head.cluster_root:
        raise LaunchError(f"the launcher {head.name} has no venv recorded: run invoke provision")


@dataclass(frozen=True)
class MpiOptions:
    interface: str | None = None  # default: the launcher's thunderbolt_interface
    btl_tcp_links: int | None = None
    env: Mapping[str, str] = field(default_factory=dict)  # exported with -x NAME=value
    allow_run_as_root: bool = False
    extra: Sequence[str] = ()


def mpirun_command(cluster: Cluster, program: Sequence[str], options: MpiOptions) -> list[str]:
    """The mpirun command run on the launcher (after sourcing env.sh) to start ``program``."""
    head = cluster.head
    interface = options.interface or head.thunderbolt_interface
    hostfile = f"{head.cluster_root}/hostfile"
    cmd = [f"{head.openmpi_prefix}/bin/mpirun" if head.openmpi_prefix else "mpirun"]
    if options.allow_run_as_root:
        cmd.append("--allow-run-as-root")
    # Open MPI binds each rank to one core when np <= 2 (and to a socket above): a rank alone on
    # a Linux node would then run all its BLAS threads on a single core, and two nodes' ranks
    # sharing one box (the lab) would share core 0. Leave placement to the OS.
    cmd += ["--hostfile", hostfile, "-np", str(cluster.world_size), "--bind-to", "none"]
    if head.openmpi_prefix and head.os_family == "Darwin":
        # Non-interactive ssh on a Mac has no Homebrew on PATH: tell orted where it lives.
        cmd += ["--prefix", head.openmpi_prefix]
    if interface:
        # Pin both MPI's data path and its out-of-band wire-up to the cluster link,
        # or Open MPI may pick Wi-Fi (or a docker bridge) on its own.
        cmd += ["--mca", "btl_tcp_if_include", interface, "--mca", "oob_tcp_if_include", interface]
    if options.btl_tcp_links:
        cmd += ["--mca", "btl_tcp_links", str(options.btl_tcp_links)]
    # No prompt may ever block a launch: ssh must fail instead of asking.
    cmd += ["--mca", "plm_rsh_args", "-o BatchMode=yes"]
    for name in ENV_FILE_VARS.get(head.os_family, ENV_FILE_VARS["Debian"]):
        cmd += ["-x", name]
    for name, value in sorted(options.env.items()):
        cmd += ["-x", f"{name}={value}"]
    cmd += list(options.extra)
    return [*cmd, *program]


def on_launcher(cluster: Cluster, command: Sequence[str], workdir: str | None = None) -> str:
    """The shell line run on the launcher: env.sh sourced, then the command."""
    head = cluster.head
    line = f". {shlex.quote(str(head.env_file))} && "
    if workdir:
        line += f"cd {shlex.quote(workdir)} && "
    return line + shlex.join(command)


def ssh_command(node: Node, remote: str, *, tty: bool = False) -> list[str]:
    """How the controller runs ``remote`` on ``node``: ssh as Ansible would, or locally."""
    conn = node.connection or {}
    if conn.get("type") == "local":
        return ["bash", "-c", remote]
    cmd = ["ssh", "-o", "BatchMode=yes"]
    if tty:
        # A tty makes Ctrl-C on the controller hang up mpirun, which then stops every rank.
        cmd.append("-tt")
    if conn.get("private_key_file"):
        cmd += ["-i", str(conn["private_key_file"])]
    if conn.get("port"):
        cmd += ["-p", str(conn["port"])]
    cmd += shlex.split(conn.get("ssh_common_args") or "")
    user = conn.get("user")
    cmd.append(f"{user}@{conn.get('host')}" if user else str(conn.get("host")))
    cmd.append(remote)
    return cmd


def rsync_ssh(node: Node) -> str | None:
    """The -e argument for rsync to reach ``node`` like Ansible does (None: local)."""
    conn = node.connection or {}
    if conn.get("type") == "local":
        return None
    parts = ["ssh", "-o", "BatchMode=yes"]
    if conn.get("private_key_file"):
        parts += ["-i", str(conn["private_key_file"])]
    if conn.get("port"):
        parts += ["-p", str(conn["port"])]
    parts += shlex.split(conn.get("ssh_common_args") or "")
    return shlex.join(parts)


def remote_path(node: Node, path: str) -> str:
    conn = node.connection or {}
    if conn.get("type") == "local":
        return path
    user = conn.get("user")
    host = conn.get("host")
    return f"{user}@{host}:{path}" if user else f"{host}:{path}"


def rank_nodes(cluster: Cluster) -> list[str]:
    """Node name of each rank: mpirun fills the hostfile's hosts in order, slot by slot."""
    return [n.name for n in cluster.training_nodes for _ in range(n.slots)]


_SIGNALLED = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+)")
_FIRST_FAILED = re.compile(r"Process name:\s*\[\[\d+,\d+\],(\d+)\]\s*Exit code:\s*(\d+)")
_RANK_ERROR = re.compile(r"^rank (\d+): (?:error: )?(.+)$", re.MULTILINE)
_RING_EXIT = re.compile(r"Node with rank (\d+) exited with code (\d+)")  # mlx.launch
_LAST_STEP = re.compile(r"iter\s+(\d+)/(\d+)\s+loss")


def describe_failure(cluster: Cluster, output: str) -> str:
    """What a failed launch's output says: which rank on which node, and the last step reported."""
    names = rank_nodes(cluster)
    by_ip = {n.thunderbolt_ip: n.name for n in cluster.nodes}
    parts = []
    if match := _SIGNALLED.search(output):
        rank, node, signum = int(match[1]), match[2], int(match[3])
        node = by_ip.get(node, node)
        parts.append(f"rank {rank} on {node} was killed by signal {signum}")
    elif match := _FIRST_FAILED.search(output):
        rank = int(match[1])
        node = names[rank] if rank < len(names) else "?"
        parts.append(f"rank {rank} on {node} exited with status {match[2]}")
    elif match := _RING_EXIT.search(output):
        rank = int(match[1])
        node = names[rank] if rank < len(names) else "?"
        parts.append(f"rank {rank} on {node} exited with status {match[2]}")
    elif match := _RANK_ERROR.search(output):
        rank = int(match[1])
        node = names[rank] if rank < len(names) else "?"
        parts.append(f"rank {rank} on {node}: {match[2]}")
    steps = _LAST_STEP.findall(output)
    parts.append(f"last step reported: {steps[-1][0]} of {steps[-1][1]}" if steps
                 else "no step was reported")
    return "; ".join(parts)
