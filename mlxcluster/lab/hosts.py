"""A cluster of real Debian hosts on this machine, for tests and rehearsals.

Each lab host is a network namespace with its own hostname, private
copy-on-write overlays of /opt /usr /etc /var /root /home (so installs on one
host are invisible to the others), a private /run and /tmp, and its own sshd.
Like a real Mac, a host has two links:

* ``eth0``, the management link (sshd, Ansible), on the bridge ``mlab<id>-mgmt``
  whose host side holds ``10.77.<id>.1/24``; host ``i`` is ``10.77.<id>.<10+i>``;
* ``bridge0``, named like the macOS Thunderbolt bridge, on the isolated bridge
  ``mlab<id>-tb``. It has no address: the ``thunderbolt`` role assigns one from
  inventory (``10.78.<id>.<10+i>``), so the tests exercise that role for real.

Lab hosts have no route to the package registries. Everything they install comes from a cache
the host fills beforehand (cache.py's :func:`prepare_offline_cache`): Debian packages in the
host's ``/var/cache/apt/archives`` and Python wheels in ``/var/cache/mlx-lab/wheels``, both seen
by every lab host through its /var overlay.

Only ever addresses inside namespaces this module created are used.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from mlxcluster.describe.topology import Port
from mlxcluster.lab import limits, ring_wait, veth
from mlxcluster.lab.cache import PIP_ARGS, prepare_offline_cache
from mlxcluster.lab.system import LabError, require_root
from mlxcluster.lab.system import link_exists as _link_exists
from mlxcluster.lab.system import run as _run

LAB_ROOT = Path(os.environ.get("MLX_LAB_ROOT", "/srv/mlx-lab"))
OVERLAID = ("opt", "usr", "etc", "var", "root", "home")
# MLX's CPU backend compiles its kernels with g++ on first use into /tmp/mlx. A lab node's /tmp
# starts empty: every fresh lab paid tens of seconds per training shape for kernels compiled
# before. Every lab node mounts this there: a real node's /tmp keeps its kernels between runs too.
JIT_CACHE = LAB_ROOT / "mlx-jit-cache"
THUNDERBOLT_IFACE = "bridge0"


@dataclasses.dataclass(frozen=True)
class Lab:
    """Names and addresses of lab number ``lab_id`` (several labs can coexist)."""

    lab_id: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.lab_id <= 9:
            raise LabError(f"lab id must be 0-9, got {self.lab_id}")

    @property
    def root(self) -> Path:
        return LAB_ROOT / f"lab{self.lab_id}"

    @property
    def mgmt_bridge(self) -> str:
        return f"mlab{self.lab_id}-mgmt"

    @property
    def tb_bridge(self) -> str:
        return f"mlab{self.lab_id}-tb"

    @property
    def gateway(self) -> str:
        return f"10.77.{self.lab_id}.1"

    def netns(self, i: int) -> str:
        return f"mlab{self.lab_id}n{i}"

    def mgmt_ip(self, i: int) -> str:
        return f"10.77.{self.lab_id}.{10 + i}"

    def tb_ip(self, i: int) -> str:
        return f"10.78.{self.lab_id}.{10 + i}"

    def node_dir(self, i: int) -> Path:
        return self.root / f"node{i}"

    @property
    def key(self) -> Path:
        return self.root / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.root / "known_hosts"

    @property
    def inventory(self) -> Path:
        return self.root / "inventory" / "hosts.yml"

    @property
    def cables_file(self) -> Path:
        """The cables lab.up plugged last, so that another cabling can unplug them first."""
        return self.root / "cables.json"

    def nodes(self) -> list[int]:
        """Numbers of the nodes that are up, from their namespaces."""
        out = _run(["ip", "netns", "list"], capture=True).stdout
        prefix = f"mlab{self.lab_id}n"
        found = []
        for line in out.splitlines():
            name = line.split()[0] if line.strip() else ""
            if name.startswith(prefix) and name[len(prefix):].isdigit():
                found.append(int(name[len(prefix):]))
        return sorted(found)


def _ensure_bridge(name: str, address: str | None) -> None:
    if not _link_exists(name):
        _run(["ip", "link", "add", name, "type", "bridge"])
    if address:
        _run(["ip", "addr", "replace", address, "dev", name])
    _run(["ip", "link", "set", name, "up"])


def _ensure_controller_key(lab: Lab) -> str:
    if not lab.key.exists():
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"mlx-lab{lab.lab_id}-controller",
              "-f", str(lab.key)])
    return Path(f"{lab.key}.pub").read_text().strip()


def _cgroup_mounts(root: Path = limits.CGROUP_ROOT) -> str:
    """`ip netns exec` mounts the network namespace's own /sys, without the machine's control
    groups: mount the memory one again, so that a node sees its memory limit (lab.limit) where a
    Linux host or a container sees its own, and `invoke doctor` checks against it."""
    try:
        unified = limits.layout(root).unified
    except limits.LimitError:
        return "# no cgroup memory controller on this machine"
    if unified:
        return "mount -t cgroup2 cgroup2 /sys/fs/cgroup || true"
    return ("mount -t tmpfs -o mode=0755 cgroup /sys/fs/cgroup && mkdir -p /sys/fs/cgroup/memory && "
            "mount -t cgroup -o memory cgroup /sys/fs/cgroup/memory || true")


# The lab node's sshd: keys only, no PAM or DNS, and room for the many sessions a run opens at once.
# Root's shell files as a fresh Debian's, not this machine's (/root is overlaid on it): a .bashrc
# starting pyenv, read by bash for every ssh command, made each ansible module run 0.2-0.4 s longer.
FRESH_ROOT_SHELL = """  rm -f /root/.bashrc /root/.profile /root/.bash_profile /root/.bash_login
  (cd /usr/share/base-files && cp dot.bashrc /root/.bashrc && cp dot.profile /root/.profile) || :
"""
# Every ssh session's ranks use one BLAS thread (SetEnv; a run's own OPENBLAS_NUM_THREADS wins):
# the nodes share this machine's cores, where a Mac has its own. OpenBLAS's threads on each rank,
# spinning while they wait, took a quarter of a 3-node run's CPU (12 steps: 346 s -> 253 s).
SSHD_CONFIG = """Port 22
SetEnv OPENBLAS_NUM_THREADS=1
HostKey /etc/ssh/ssh_host_ed25519_key
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
UseDNS no
PidFile /run/sshd.pid
AuthorizedKeysFile .ssh/authorized_keys
AcceptEnv LANG LC_*
MaxStartups 100:30:200
MaxSessions 100
Subsystem sftp /usr/lib/openssh/sftp-server
"""


def _node_script(lab: Lab, i: int, authorized_key: str, preload: Path | None) -> str:
    """Shell run inside the node's namespaces: mounts, identity, the ring's waiting library preloaded
    into every process (ring_wait.py: the nodes share this machine's cores), then sshd."""
    d = lab.node_dir(i)
    mounts = "\n".join(
        f"mkdir -p {d}/upper/{p} {d}/work/{p}\n"
        f"mount -t overlay overlay -o lowerdir=/{p},upperdir={d}/upper/{p},workdir={d}/work/{p} /{p}"
        for p in OVERLAID
    )
    hosts = "\n".join(f"{lab.mgmt_ip(j)} node{j}" for j in range(1, 10))
    return f"""set -eu
{mounts}
mount -t tmpfs -o mode=0755 tmpfs /run
mkdir -p /run/sshd /run/lock
mount -t tmpfs -o mode=1777 tmpfs /tmp
mkdir -p {JIT_CACHE} /tmp/mlx
mount --bind {JIT_CACHE} /tmp/mlx
{_cgroup_mounts()}
hostname node{i}
echo node{i} > /etc/hostname
{f"echo {preload} > /etc/ld.so.preload" if preload else "rm -f /etc/ld.so.preload"}
cat > /etc/hosts <<'EOF'
127.0.0.1 localhost
{hosts}
EOF
# A host of its own: fresh host keys, and none of the machine's root keys or known hosts.
# Done on first boot only: a node restarted by lab.up keeps its disk, like a rebooted Mac.
if [ ! -e {d}/booted ]; then
  rm -f /etc/ssh/ssh_host_*
  cp {d}/ssh_host_ed25519_key {d}/ssh_host_ed25519_key.pub /etc/ssh/
  chmod 600 /etc/ssh/ssh_host_ed25519_key
  rm -rf /root/.ssh
  mkdir -m 700 /root/.ssh
{FRESH_ROOT_SHELL}  echo '{authorized_key}' > /root/.ssh/authorized_keys
  chmod 600 /root/.ssh/authorized_keys
  # Packages install as in a slim Debian image: no manuals or docs, and no man-db index
  # rebuilt after each apt run (a lab host has no reader for them; the package set is the same).
  cat > /etc/dpkg/dpkg.cfg.d/mlx-lab-slim <<'EOF'
path-exclude=/usr/share/doc/*
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
EOF
  rm -f /var/lib/man-db/auto-update
  touch {d}/booted
fi
cat > /etc/ssh/sshd_config <<'EOF'
{SSHD_CONFIG}EOF
exec /usr/sbin/sshd -D -e
"""


def _start_node(lab: Lab, i: int, authorized_key: str) -> None:
    ns, d = lab.netns(i), lab.node_dir(i)
    d.mkdir(parents=True, exist_ok=True)
    hostkey = d / "ssh_host_ed25519_key"
    if not hostkey.exists():
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"root@node{i}", "-f", str(hostkey)])
    _run(["ip", "netns", "add", ns])
    for kind, bridge, inner in (("m", lab.mgmt_bridge, "eth0"), ("t", lab.tb_bridge, THUNDERBOLT_IFACE)):
        outer, peer = f"mlab{lab.lab_id}{kind}{i}", f"mlab{lab.lab_id}{kind}p{i}"
        if _link_exists(outer):
            _run(["ip", "link", "del", outer])
        # A fixed MAC per node and link, like real hardware: a restarted node keeps its
        # MAC, so its peers' ARP entries stay right.
        mac = f"02:77:{lab.lab_id:02x}:{ord(kind):02x}:00:{i:02x}"
        _run(["ip", "link", "add", outer, "type", "veth", "peer", "name", peer,
              "address", mac])
        _run(["ip", "link", "set", outer, "master", bridge, "up"])
        _run(["ip", "link", "set", peer, "netns", ns])
        _run(["ip", "-n", ns, "link", "set", peer, "name", inner])
        _run(["ip", "-n", ns, "link", "set", inner, "up"])
    _run(["ip", "-n", ns, "link", "set", "lo", "up"])
    _run(["ip", "-n", ns, "addr", "add", f"{lab.mgmt_ip(i)}/24", "dev", "eth0"])
    _run(["ip", "-n", ns, "route", "add", "default", "via", lab.gateway])
    script = d / "boot.sh"
    script.write_text(_node_script(lab, i, authorized_key, ring_wait.library(LAB_ROOT)))
    # setsid --fork detaches the node's process tree from ours: it outlives this
    # command, and `stop_node` finds it again through the namespace.
    with (d / "sshd.log").open("a") as log:
        subprocess.run(
            ["setsid", "--fork", "ip", "netns", "exec", ns, "unshare", "--uts", "--mount",
             "--propagation", "private", "--fork", "bash", str(script)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, check=True,
        )


def _wait_for_ssh(addresses: Iterable[str], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    for address in addresses:
        while True:
            try:
                with socket.create_connection((address, 22), timeout=1) as sock:
                    if sock.recv(4).startswith(b"SSH"):
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise LabError(f"sshd on {address} did not come up within {timeout:.0f}s; "
                               f"see {LAB_ROOT}/lab*/node*/sshd.log")
            time.sleep(0.1)


def write_inventory(lab: Lab, nodes: list[int], slots: int = 1,
                    links: list[list[str]] | None = None) -> Path:
    """Write an Ansible inventory for the lab hosts that are up; node1 is the launcher. With
    `links`, the hosts are cabled point to point (mlxcluster/lab/veth.py): links mode, a /30 per cable."""
    hosts = {f"node{i}": {"ansible_host": lab.mgmt_ip(i), "mpi_slots": slots} for i in nodes}
    if not links:
        for i in nodes:
            hosts[f"node{i}"] = {**hosts[f"node{i}"], "thunderbolt_ip": lab.tb_ip(i)}
    # The lab's settings are the cluster group's vars in the inventory file itself: they
    # outrank the shipped defaults (playbooks/group_vars/all), and a copy of the file is
    # a whole inventory.
    lab_vars = {
        "ansible_user": "root",
        "ansible_ssh_private_key_file": str(lab.key),
        # The lab made these host keys itself, so the controller pins them too.
        "ansible_ssh_common_args": f"-o UserKnownHostsFile={lab.known_hosts}",
        "ansible_python_interpreter": "/usr/bin/python3",
        "cluster_root": "/opt/mlx-cluster",
        **({"thunderbolt_topology": "links", "thunderbolt_links": links,
            "thunderbolt_link_pool": f"10.78.{lab.lab_id}.0/24"} if links else
           {"thunderbolt_interface": THUNDERBOLT_IFACE, "thunderbolt_prefix": 24}),
        # No registry is reachable from a lab host: install from the host's cache.
        "cluster_apt_update_cache": False,
        "python_env_pip_extra_args": PIP_ARGS,
    }
    inventory = {
        "cluster": {"children": {"linux": {"hosts": hosts}, "macs": {"hosts": {}}},
                    "vars": lab_vars},
        "launcher": {"hosts": {f"node{nodes[0]}": None}} if nodes else {"hosts": {}},
    }
    header = f"# Written by `invoke lab.up` for lab {lab.lab_id}; rewritten on every lab.up.\n"
    lab.inventory.parent.mkdir(parents=True, exist_ok=True)
    tmp = lab.inventory.with_suffix(".tmp")
    tmp.write_text(header + yaml.safe_dump(inventory, sort_keys=False))
    tmp.replace(lab.inventory)
    return lab.inventory


def up(nodes: int, lab_id: int = 0, slots: int = 1, cables: str | None = None) -> Path:
    """Bring nodes 1..``nodes`` up (those already up are kept) and write the inventory; with
    `cables` (ring or mesh), cable them point to point instead of through the lab's bridge."""
    require_root()
    if not 1 <= nodes <= 9:
        raise LabError(f"--nodes must be between 1 and 9, got {nodes}")
    lab = Lab(lab_id)
    lab.root.mkdir(parents=True, exist_ok=True)
    _ensure_bridge(lab.mgmt_bridge, f"{lab.gateway}/24")
    _ensure_bridge(lab.tb_bridge, None)
    authorized_key = _ensure_controller_key(lab)
    running = set(lab.nodes())
    for i in range(1, nodes + 1):
        if i not in running:
            _start_node(lab, i, authorized_key)
    all_nodes = sorted(running | set(range(1, nodes + 1)))
    _wait_for_ssh(lab.mgmt_ip(i) for i in all_nodes)
    lines = []
    for i in all_nodes:
        keytype, key = (lab.node_dir(i) / "ssh_host_ed25519_key.pub").read_text().split()[:2]
        lines.append(f"{lab.mgmt_ip(i)},node{i} {keytype} {key}")
    lab.known_hosts.write_text("\n".join(lines) + "\n")
    links = None
    if cables:
        links = veth.inventory_links(_recable(lab, veth.cabling(all_nodes, cables), all_nodes))
    return write_inventory(lab, all_nodes, slots, links)


def _recable(lab: Lab, made: list[tuple[Port, Port]], nodes: list[int]) -> list[tuple[Port, Port]]:
    """Plug `made`, as a user re-cables Macs: a cable already plugged (lab.up again) stays as it
    is, one of the last cabling that `made` does not have is pulled first (a fourth node joining
    a ring of three takes node3's cable to node1), and the others are plugged."""
    netns = {f"node{n}": lab.netns(n) for n in nodes}
    before = json.loads(lab.cables_file.read_text()) if lab.cables_file.exists() else []
    wanted = veth.inventory_links(made)
    for a, _ in (link for link in before if link not in wanted):
        host, interface = a.split(":")
        if host in netns:  # deleting one end of a veth removes both; a stopped node took its own
            _run(["ip", "-n", netns[host], "link", "del", interface], check=False, capture=True)
    missing = [(a, b) for a, b in made if _run(["ip", "-n", netns[a.host], "link", "show", a.interface],
                                               capture=True, check=False).returncode != 0]
    for command in veth.plug_commands(netns, missing):
        _run(command)
    lab.cables_file.write_text(json.dumps(wanted) + "\n")
    return made


def stop_node(lab: Lab, i: int) -> None:
    """Kill every process of node ``i`` and remove its namespace and links (its disk is kept)."""
    ns = lab.netns(i)
    pids = _run(["ip", "netns", "pids", ns], capture=True, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while _run(["ip", "netns", "pids", ns], capture=True, check=False).stdout.strip():
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    _run(["ip", "netns", "del", ns], check=False, capture=True)
    limits.clear(lab.lab_id, i)
    for kind in ("m", "t"):
        outer = f"mlab{lab.lab_id}{kind}{i}"
        if _link_exists(outer):
            _run(["ip", "link", "del", outer], check=False, capture=True)


def set_link(lab: Lab, i: int, up: bool) -> None:
    """Unplug (up=False) or plug back node ``i``'s Thunderbolt cable: its end of the cluster link
    goes down on the bridge side, while the node and its management link stay up."""
    _run(["ip", "link", "set", f"mlab{lab.lab_id}t{i}", "up" if up else "down"])


def set_carrying(lab: Lab, i: int, carrying: bool) -> None:
    """Make node ``i``'s Thunderbolt link carry nothing (carrying=False) while it stays up, as a
    bad cable or a port that renegotiated does, or carry again: a queue of no packets on both
    ends of its cable drops whatever either side sends (the node's end, and the bridge's)."""
    ends = ((["ip", "netns", "exec", lab.netns(i)], THUNDERBOLT_IFACE), ([], f"mlab{lab.lab_id}t{i}"))
    for inside, device in ends:
        queue = ["replace", "dev", device, "root", "pfifo", "limit", "0"] if not carrying else \
            ["del", "dev", device, "root"]
        # Carrying again: the queue may be gone already (the node restarted), which is as wanted.
        _run([*inside, "tc", "qdisc", *queue], check=not carrying, capture=carrying)


def processes(lab: Lab, i: int, program: bytes, python_only: bool = True) -> list[int]:
    """Node ``i``'s processes whose command line holds `program` (with `python_only`, those whose
    program is a python: a rank, not the mpirun or shell that names it). The nodes share the
    machine's PID namespace, so a node's own are its network namespace's."""
    listed = subprocess.run(["ip", "netns", "pids", lab.netns(i)], capture_output=True, text=True,
                            check=False).stdout.split()
    found = []
    for pid in listed:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if program in b" ".join(argv) and (not python_only or Path(argv[0].decode(errors="replace"))
                                           .name.startswith("python")):
            found.append(int(pid))
    return found


def set_cable(lab: Lab, port: str, up: bool) -> None:
    """Unplug (up=False) or plug back a point-to-point cable at `port` ("node2:en3"): that end
    goes down, and the far end loses its carrier, as when a Thunderbolt cable is pulled."""
    host, interface = port.split(":")
    _run(["ip", "-n", lab.netns(int(host.removeprefix("node"))), "link", "set", interface,
          "up" if up else "down"])


def down(lab_id: int = 0) -> None:
    """Stop every node of the lab and remove bridges and state: nothing is left behind."""
    require_root()
    lab = Lab(lab_id)
    for i in lab.nodes():
        stop_node(lab, i)
    for bridge in (lab.mgmt_bridge, lab.tb_bridge):
        if _link_exists(bridge):
            _run(["ip", "link", "del", bridge], check=False, capture=True)
    shutil.rmtree(lab.root, ignore_errors=True)


@contextmanager
def fresh(nodes: int, lab_id: int, slots: int = 1, cables: str | None = None) -> Iterator[Path]:
    """A lab of `nodes` new hosts, cabled as `up` cables them, taken down afterwards: its inventory."""
    prepare_offline_cache()
    down(lab_id)
    try:
        yield up(nodes, lab_id, slots, cables=cables)
    finally:
        down(lab_id)


def ansible_env(facts_dir: Path) -> dict[str, str]:
    """What ansible-playbook needs on a lab: a fact cache of its own. Every lab gets new hosts
    under the same names, so facts cached for an earlier lab must never be reused."""
    return {"ANSIBLE_CACHE_PLUGIN_CONNECTION": str(facts_dir)}


def status(lab_id: int = 0) -> dict[str, object]:
    lab = Lab(lab_id)
    nodes = lab.nodes()
    return {
        "lab": lab_id,
        "nodes": {f"node{i}": {"management": lab.mgmt_ip(i), "thunderbolt": lab.tb_ip(i)}
                  for i in nodes},
        "inventory": str(lab.inventory) if lab.inventory.exists() else None,
    }


def set_limits(lab: Lab, node: int, cpu_percent: float | None = None, memory_bytes: int | None = None,
               off: bool = False) -> str:
    """invoke lab.limit: node `node` slower (a CPU quota) or smaller (a memory limit), or neither."""
    if os.geteuid() != 0:
        raise limits.LimitError("limiting a lab node needs root (it writes control groups)")
    if node not in lab.nodes():
        raise limits.LimitError(f"lab {lab.lab_id} has no node {node} up (it has {lab.nodes() or 'none'})")
    if off:
        limits.clear(lab.lab_id, node)
        return f"node{node}: no limits"
    if cpu_percent is None and memory_bytes is None:
        raise limits.LimitError("give --cpu PERCENT (of one core), --memory SIZE, or --off")
    limits.limit(lab.lab_id, node, lab.netns(node), cpu_percent=cpu_percent, memory_bytes=memory_bytes)
    said = [*([f"{cpu_percent:g}% of a core"] if cpu_percent is not None else []),
            *([f"{memory_bytes / 2**30:.2f} GiB of memory, no swap"] if memory_bytes is not None else [])]
    return f"node{node}: " + ", ".join(said)


def main(argv: list[str] | None = None) -> None:
    """Command line used by CI scripts: ``python -m mlxcluster.lab up|down|status``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m mlxcluster.lab")
    parser.add_argument("action", choices=["up", "down", "status", "cache"])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--lab", type=int, default=int(os.environ.get("MLX_LAB_ID", "0")))
    parser.add_argument("--cables", choices=veth.KINDS,
                        help="up: cable the hosts point to point (links mode), not through the bridge")
    args = parser.parse_args(argv)
    actions = {
        "up": lambda: print(up(args.nodes, args.lab, cables=args.cables)),
        "cache": prepare_offline_cache,
        "down": lambda: down(args.lab),
        "status": lambda: print(json.dumps(status(args.lab), indent=2)),
    }
    try:
        actions[args.action]()
    except LabError as exc:
        raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    sys.exit(main())
