"""What `invoke doctor` learns about one node, in one ssh round trip.

This file is sent to each node and run there with its own Python (`python3 - ARGS < probe.py`),
so it uses the standard library only and never fails: every fact it cannot get is reported as
an error string instead. It prints one JSON object.

Arguments (JSON, argv[1]): {"cluster_root", "venv", "interfaces": [its ports on the cluster link],
"peers": [the peers' addresses on the cluster link], "macos_links": on a Mac in links mode, the
name of its Thunderbolt Bridge's network service}.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

TIMEOUT = 10


def _run(cmd: list[str], timeout: float = TIMEOUT, env: dict[str, str] | None = None) -> tuple[int, str]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, str(exc)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def openmpi_version() -> str | None:
    code, out = _run(["mpirun", "--version"])
    match = re.search(r"Open MPI\)? (\d+\.\d+\.\d+)", out) if code == 0 else None
    return match.group(1) if match else None


def venv_versions(venv: str) -> dict[str, Any]:
    python = os.path.join(venv, "bin", "python")
    if not os.access(python, os.X_OK):
        return {"error": f"{python} does not exist"}
    code, out = _run([python, "-c", (
        "import json, platform\n"
        "from importlib.metadata import distributions, version\n"
        "import mlx.core as mx\n"
        "packages = {d.metadata['Name'].lower().replace('_', '-'): d.version for d in distributions()}\n"
        # What Metal lets MLX's GPU hold at once (macOS wires at most this: iogpu.wired_limit_mb).
        "info = getattr(mx, 'device_info', None) or mx.metal.device_info\n"
        "gpu = info().get('max_recommended_working_set_size') if mx.metal.is_available() else None\n"
        "print(json.dumps({'python': platform.python_version(), 'mlx': version('mlx'),"
        " 'mlx_lm': version('mlx-lm'), 'distributed': mx.distributed.is_available(),"
        " 'gpu_limit': gpu, 'packages': packages}))")],
        timeout=60)
    if code != 0:
        return {"error": out.splitlines()[-1] if out else f"exit {code}"}
    return json.loads(out.splitlines()[-1])


def interface(name: str) -> dict[str, Any]:
    """State, IPv4 addresses (with prefix) and MTU of a network interface."""
    if sys.platform == "darwin":
        code, out = _run(["ifconfig", name])
        if code != 0:
            return {"error": out or f"no interface {name}"}
        mtu = re.search(r"mtu (\d+)", out)
        addresses = [f"{ip}/{bin(int(mask, 16)).count('1')}"
                     for ip, mask in re.findall(r"inet (\S+) netmask (0x[0-9a-f]+)", out)]
        return {"up": "<UP" in out or ",UP" in out, "mtu": int(mtu.group(1)) if mtu else None,
                "addresses": addresses, "loopback": "LOOPBACK" in out}
    code, out = _run(["ip", "-j", "addr", "show", "dev", name])
    if code != 0:
        return {"error": out or f"no interface {name}"}
    info = json.loads(out)[0]
    return {"up": "UP" in info.get("flags", []) and info.get("operstate") != "DOWN",
            "mtu": info.get("mtu"),
            "loopback": info.get("link_type") == "loopback",
            "addresses": [f"{a['local']}/{a['prefixlen']}" for a in info.get("addr_info", [])
                          if a.get("family") == "inet"]}


def memory_bytes() -> dict[str, int | None]:
    if sys.platform == "darwin":
        _, total = _run(["sysctl", "-n", "hw.memsize"])
        _, vm = _run(["vm_stat"])
        page = re.search(r"page size of (\d+)", vm)
        free = sum(int(n) for n in re.findall(r"Pages (?:free|inactive|speculative):\s+(\d+)", vm))
        return {"total": int(total) if total.isdigit() else None,
                "available": free * int(page.group(1)) if page else None}
    fields = {}
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            key, value = line.split(":", 1)
            fields[key] = int(value.split()[0]) * 1024
    total, available = fields.get("MemTotal"), fields.get("MemAvailable")
    # A control group's limit (a container, a systemd slice, a lab node) is what this node's
    # processes may take, whatever the machine has: /proc/meminfo does not show it.
    for limit, room in cgroup_memory():
        total = min(total, limit) if total is not None else limit
        available = min(available, room) if available is not None else room
    return {"total": total, "available": available}


# A cgroup v1 "no limit" is the largest page-aligned 63-bit number; anything this large is none.
_NO_LIMIT = 1 << 60


def cgroup_memory(proc_self: str = "/proc/self/cgroup",
                  root: str = "/sys/fs/cgroup") -> list[tuple[int, int]]:
    """(limit, room) of every memory limit over this process: its control group and each above it,
    v2 (`memory.max`) or v1 (`memory.limit_in_bytes`); room is the limit less what the group uses,
    its reclaimable file cache not counted. None found (no limit, no cgroups): []."""
    try:
        with open(proc_self) as cgroups:
            lines = cgroups.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2's unified tree
            base, names = root, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base, names = os.path.join(root, "memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                         "total_inactive_file")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), 0, -1):
            folder = os.path.join(base, *parts[:depth])
            limit = _number(os.path.join(folder, names[0]))
            if limit is None or limit >= _NO_LIMIT:
                continue
            used = _number(os.path.join(folder, names[1])) or 0
            cache = _stat(os.path.join(folder, "memory.stat"), names[2]) or 0
            found.append((limit, max(limit - max(used - cache, 0), 0)))
    return found


def _number(path: str) -> int | None:
    text = read(path)
    return int(text) if text is not None and text.strip().isdigit() else None


def _stat(path: str, key: str) -> int | None:
    for line in (read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None


def disk_free(path: str) -> int | None:
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path or "/").free


def ssh_to(ip: str) -> dict[str, Any]:
    """Can this node ssh to a peer by its Thunderbolt IP with no prompt (as mpirun does)?"""
    code, out = _run(["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", ip, "true"])
    return {"ok": code == 0, "error": None if code == 0 else out.splitlines()[-1:] or [f"exit {code}"]}


# A TCP connect to each peer's sshd from the venv's own Python, started as the launcher starts a
# rank (over ssh): macOS Local Network Privacy can refuse a Python its local network (errno 65,
# EHOSTUNREACH) although ping and ssh, which it exempts, reach the peer (mlx #3755; Apple TN3179).
PYTHON_REACH = """import json, socket, sys
from concurrent.futures import ThreadPoolExecutor
def reach(peer):
    try:
        socket.create_connection((peer, 22), timeout=5).close()
    except OSError as exc:
        return [exc.errno, exc.strerror or str(exc)]
    return None
peers = json.loads(sys.argv[1])
with ThreadPoolExecutor(max(len(peers), 1)) as pool:
    print(json.dumps(dict(zip(peers, pool.map(reach, peers)))))
"""


def python_reach(venv: str, peers: list[str]) -> dict[str, Any]:
    """Each peer's answer to a connect from the venv's Python: None (it connected) or [errno,
    what it means]; {"error": ...} when that Python could not run at all."""
    python = os.path.join(venv, "bin", "python")
    if not peers or not os.access(python, os.X_OK):
        return {}
    code, out = _run([python, "-c", PYTHON_REACH, json.dumps(peers)], timeout=30)
    try:
        return json.loads(out.splitlines()[-1]) if code == 0 else {"error": out[-300:] or f"exit {code}"}
    except (ValueError, IndexError):
        return {"error": out[-300:]}


def macos_links(bridge_service: str) -> dict[str, Any]:
    """A Mac in links mode: its macOS version, RDMA (rdma_ctl status, ibv_devices' devices) and
    whether its Thunderbolt Bridge's service (`bridge_service`) is on (its ports would be bridged)."""
    # macOS's own tools, wherever this shell's PATH leaves out the system folders.
    env = {**os.environ, "PATH": os.environ.get("PATH", "") + ":/usr/bin:/bin:/usr/sbin:/sbin"}
    _, version = _run(["sw_vers", "-productVersion"], env=env)
    code, status = _run(["rdma_ctl", "status"], env=env)
    _, devices = _run(["ibv_devices"], env=env)
    _, bridge = _run(["networksetup", "-getnetworkserviceenabled", bridge_service], env=env)
    return {"version": version or None, "rdma": status.lower() if code == 0 else f"unknown ({status})",
            "rdma_devices": sorted({w for w in devices.split() if w.startswith("rdma_")}),
            "bridge_service": bridge}


def read(path: str) -> str | None:
    try:
        with open(path) as handle:
            return handle.read()
    except OSError:
        return None


def probe(args: dict[str, Any]) -> dict[str, Any]:
    root = args["cluster_root"]
    # Everything at once: a peer whose link carries nothing costs one wait (ssh's and the
    # connect's 5 s), not one after the other.
    with ThreadPoolExecutor(max_workers=len(args["peers"]) + 2) as pool:
        versions = pool.submit(venv_versions, args["venv"])
        reached = pool.submit(python_reach, args["venv"], args["peers"])
        ssh = dict(zip(args["peers"], pool.map(ssh_to, args["peers"]), strict=True))
        return {
            "hostname": platform.node(),
            "os": platform.system(),
            "openmpi": openmpi_version(),
            "venv": versions.result(),
            "hostfile": read(os.path.join(root, "hostfile")),
            "interfaces": {name: interface(name) for name in args["interfaces"]},
            "memory": {**memory_bytes(), "gpu_limit": versions.result().get("gpu_limit")},
            "disk_free": disk_free(root),
            "ssh": ssh,
            "python_reach": reached.result(),
            **({"macos": macos_links(args["macos_links"])} if args.get("macos_links") else {}),
        }


if __name__ == "__main__":
    print(json.dumps(probe(json.loads(sys.argv[1]))))
