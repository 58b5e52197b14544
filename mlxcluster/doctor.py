"""`invoke doctor`: is the cluster fit to train, and if not, what to do about it.

Gathering is separate from judging: `gather` runs mlxcluster/probe.py on every node at once (one
ssh round trip each) and two tiny MPI jobs on the launcher; `evaluate` turns what came back into
checks, each green or red with the fix for red, and is a plain function the unit tests drive.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcluster import launch

PROBE = Path(__file__).with_name("probe.py")
REPROVISION = "run invoke provision -i <inventory>"
# A LoRA run holds the model once in memory (plus activations); on disk the nodes keep one copy.
MEMORY_FACTOR = 1.5
DISK_FACTOR = 2.0
ALL_SUM = ("import mlx.core as mx; g = mx.distributed.init(strict=True); "
           "print(int(mx.distributed.all_sum(mx.array(1), group=g).item()))")


@dataclass(frozen=True)
class Check:
    scope: str  # a node, "node1 -> node2", or "cluster"
    name: str
    ok: bool
    detail: str
    fix: str = ""


# --- gathering -------------------------------------------------------------------------------------


def probe_command(cluster: launch.Cluster, node: launch.Node) -> list[str]:
    """ssh (or local bash) that runs probe.py on `node`, fed on stdin, with the node's env.sh."""
    args = {"cluster_root": node.cluster_root or "", "venv": node.venv or "",
            "interface": node.thunderbolt_interface or "",
            "peers": [n.thunderbolt_ip for n in cluster.nodes if n.name != node.name]}
    env = shlex.quote(node.env_file or "/nonexistent")
    line = f"if [ -f {env} ]; then . {env}; fi; python3 - {shlex.quote(json.dumps(args))}"
    return launch.ssh_command(node, line)


def probe_node(cluster: launch.Cluster, node: launch.Node, timeout: float = 60) -> dict[str, Any]:
    cmd = probe_command(cluster, node)
    if cmd[0] == "ssh":
        cmd[1:1] = ["-o", "ConnectTimeout=5"]
    try:
        proc = subprocess.run(cmd, input=PROBE.read_text(), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"unreachable": f"no answer within {timeout:.0f} s"}
    if proc.returncode == 255 and cmd[0] == "ssh":
        return {"unreachable": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "ssh failed"}
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"unreachable": f"the probe failed ({proc.returncode}): {proc.stderr.strip()[-300:]}"}


def mpi_job(cluster: launch.Cluster, program: Sequence[str], *, root: bool,
            timeout: float = 60) -> tuple[int, str]:
    """Run `program` on every slot with mpirun from the launcher, as invoke run does."""
    head = cluster.head
    mpirun = launch.mpirun_command(cluster, program, launch.MpiOptions(allow_run_as_root=root))
    cmd = launch.ssh_command(head, launch.on_launcher(cluster, mpirun, workdir=head.cluster_root))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return 124, f"no answer within {timeout:.0f} s"
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def gather(cluster: launch.Cluster) -> dict[str, Any]:
    """Every node's probe, all at once."""
    with ThreadPoolExecutor(max_workers=len(cluster.nodes)) as pool:
        facts = dict(zip((n.name for n in cluster.nodes),
                         pool.map(lambda n: probe_node(cluster, n), cluster.nodes), strict=True))
    return {"nodes": facts, "jobs": {}}


def run_jobs(cluster: launch.Cluster, *, root: bool) -> dict[str, tuple[int, str]]:
    """The cluster-wide MPI jobs: hostname on every slot, and an MLX all_sum over every rank."""
    jobs = {"hostname": mpi_job(cluster, ["hostname"], root=root)}
    if cluster.world_size > 1:
        jobs["all_sum"] = mpi_job(cluster, ["python", "-c", ALL_SUM], root=root)
    return jobs


def diagnose(cluster: launch.Cluster, rendered_hostfile: str, model_bytes: int | None, *,
             root: bool, mpi_jobs: bool = True) -> list[Check]:
    """Probe, judge, and only on a cluster that is green so far, launch the MPI jobs: on a red
    one they could only fail, slowly (a down link makes mpirun wait for its timeouts)."""
    gathered = gather(cluster)
    checks = evaluate(cluster, rendered_hostfile, gathered, model_bytes)
    if not mpi_jobs or cluster.world_size == 0:
        return checks
    red = sum(not c.ok for c in checks)
    if red:
        return [*checks, Check("cluster", "MPI jobs (mpirun hostname, MLX all_sum)", False,
                               f"not run: {red} check(s) above failed", "fix those first")]
    gathered["jobs"] = run_jobs(cluster, root=root)
    return evaluate(cluster, rendered_hostfile, gathered, model_bytes)


# --- judging ---------------------------------------------------------------------------------------


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _agreement(name: str, values: Mapping[str, str | None], fix: str) -> list[Check]:
    """One check per node: its value, red when it is missing or differs from the majority's."""
    present = Counter(v for v in values.values() if v)
    majority = present.most_common(1)[0][0] if present else None
    checks = []
    for node, value in values.items():
        if not value:
            checks.append(Check(node, name, False, "missing", fix))
        elif value != majority:
            others = ", ".join(f"{n} {v}" for n, v in values.items() if v and v != value)
            checks.append(Check(node, name, False, f"{value}, but {others}",
                                f"nodes must agree: {fix}"))
        else:
            checks.append(Check(node, name, True, value))
    return checks


def evaluate(cluster: launch.Cluster, rendered_hostfile: str, gathered: Mapping[str, Any],
             model_bytes: int | None = None) -> list[Check]:
    facts: Mapping[str, Mapping[str, Any]] = gathered["nodes"]
    checks: list[Check] = []
    reachable = {}
    for node in cluster.nodes:
        f = facts.get(node.name, {"unreachable": "not probed"})
        conn = node.connection or {}
        how = "local" if conn.get("type") == "local" else f"ssh {conn.get('user') or ''}@{conn.get('host')}"
        if "unreachable" in f:
            checks.append(Check(node.name, "management ssh", False, f"{how}: {f['unreachable']}",
                                "power the node on, check ansible_host/ansible_user in the inventory "
                                "and that `ssh` to it works without a prompt"))
        else:
            checks.append(Check(node.name, "management ssh", True, how))
            reachable[node.name] = f
    nodes = [n for n in cluster.nodes if n.name in reachable]

    for node in nodes:
        for peer in cluster.nodes:
            if peer.name == node.name:
                continue
            result = reachable[node.name]["ssh"].get(peer.thunderbolt_ip,
                                                     {"ok": False, "error": ["not tried"]})
            error = " ".join(result["error"] or [])
            if result["ok"]:
                fix = ""
            elif any(s in error for s in ("Permission denied", "Host key", "HOST IDENTIFICATION")):
                fix = f"{REPROVISION} (the ssh_mesh role installs every node's key and pins host keys)"
            else:
                fix = "check the cable and both nodes' interface checks, and that sshd runs on the peer"
            checks.append(Check(
                f"{node.name} -> {peer.name}", "ssh over the cluster link", result["ok"],
                peer.thunderbolt_ip if result["ok"] else f"{peer.thunderbolt_ip}: {error}", fix))

    venvs = {n.name: reachable[n.name]["venv"] for n in nodes}
    checks += _agreement("Open MPI", {n.name: reachable[n.name]["openmpi"] for n in nodes},
                         f"{REPROVISION} (the openmpi role installs it)")
    for key, label in (("python", "Python"), ("mlx", "mlx"), ("mlx_lm", "mlx-lm")):
        checks += _agreement(label, {n: v.get(key) for n, v in venvs.items()},
                             f"{REPROVISION} (the python_env role pins it)")
    head_venv = cluster.head.venv
    for node in nodes:
        error = venvs[node.name].get("error")
        if error or node.venv != head_venv:
            detail = error or f"{node.venv}, but the launcher's is {head_venv}"
            checks.append(Check(node.name, "venv", False, detail,
                                f"{REPROVISION}; every node needs the venv at the same path"))
        elif not venvs[node.name].get("distributed"):
            checks.append(Check(node.name, "venv", False, "mlx cannot load MPI",
                                f"{REPROVISION} (libmpi missing from the node)"))
        else:
            checks.append(Check(node.name, "venv", True, str(node.venv)))

    expected = launch.hostfile_entries(rendered_hostfile)
    for node in nodes:
        text = reachable[node.name]["hostfile"]
        ok = text is not None and launch.hostfile_entries(text) == expected
        detail = "as rendered" if ok else ("missing" if text is None else
                                           "differs from build/<inventory>/hostfile")
        checks.append(Check(node.name, "hostfile", ok, detail,
                            "" if ok else f"{REPROVISION} (it renders and copies the hostfile)"))

    for node in nodes:
        iface = reachable[node.name]["interface"]
        want = f"{node.thunderbolt_ip}/{node.thunderbolt_prefix}"
        name = node.thunderbolt_interface
        if "error" in iface:
            checks.append(Check(node.name, f"interface {name}", False, iface["error"],
                                "connect the cable, or fix thunderbolt_interface in the inventory"))
            continue
        problems = []
        if not iface["up"]:
            problems.append("down")
        if want not in iface["addresses"]:
            problems.append(f"has {', '.join(iface['addresses']) or 'no address'}, not {want}")
        # Loopback (the single-machine inventory) is left as it is by the thunderbolt role.
        if node.thunderbolt_mtu and not iface.get("loopback") and iface["mtu"] != node.thunderbolt_mtu:
            problems.append(f"MTU {iface['mtu']}, not {node.thunderbolt_mtu}")
        checks.append(Check(node.name, f"interface {name}", not problems,
                            "; ".join(problems) or f"up, {want}, MTU {iface['mtu']}",
                            f"{REPROVISION} (the thunderbolt role sets address and MTU)" if problems else ""))

    if model_bytes:
        for node in nodes:
            memory, disk = reachable[node.name]["memory"], reachable[node.name]["disk_free"]
            need_mem, need_disk = model_bytes * MEMORY_FACTOR, model_bytes * DISK_FACTOR
            if memory.get("available") is not None:
                ok = memory["available"] >= need_mem
                checks.append(Check(
                    node.name, "free memory", ok,
                    f"{_gib(memory['available'])} free, the model needs ~{_gib(need_mem)}",
                    "" if ok else "close other programs, or train a smaller or quantized model"))
            if disk is not None:
                ok = disk >= need_disk
                checks.append(Check(node.name, "free disk", ok,
                                    f"{_gib(disk)} free under cluster_root, need ~{_gib(need_disk)}",
                                    "" if ok else "free disk space under cluster_root (old runs/)"))

    jobs = gathered.get("jobs", {})
    if "hostname" in jobs:
        code, out = jobs["hostname"]
        want_names = Counter({reachable[n.name]["hostname"]: n.slots for n in cluster.training_nodes})
        got = Counter(line.strip() for line in out.splitlines() if line.strip() in want_names)
        ok = code == 0 and got == want_names
        checks.append(Check("cluster", f"mpirun -np {cluster.world_size} hostname", ok,
                            ", ".join(sorted(got.elements())) if ok else f"exit {code}: {out[-300:]}",
                            "" if ok else "fix the red checks above first; then see the output"))
    if "all_sum" in jobs:
        code, out = jobs["all_sum"]
        lines = out.splitlines()
        ok = code == 0 and lines.count(str(cluster.world_size)) == cluster.world_size
        checks.append(Check("cluster", "MLX all_sum over every rank", ok,
                            f"{cluster.world_size} ranks each got {cluster.world_size}" if ok
                            else f"exit {code}: {out[-300:]}",
                            "" if ok else "MLX could not join the ranks: fix the red checks above, "
                            "and check that libmpi loads in the venv"))
    return checks


def render(checks: Sequence[Check], console: Any) -> None:
    """One table per node, one for the node pairs, one for the cluster-wide jobs."""
    from rich.table import Table

    groups: dict[str, list[Check]] = {}
    for check in checks:
        key = "pairs" if "->" in check.scope else check.scope
        groups.setdefault(key, []).append(check)
    for key, items in groups.items():
        table = Table(title=key if key != "pairs" else "node pairs (cluster link)", title_justify="left")
        if key == "pairs":
            table.add_column("from -> to")
        for column in ("check", "", "detail", "fix"):
            table.add_column(column)
        for check in items:
            mark = "[green]ok[/]" if check.ok else "[bold red]FAIL[/]"
            row = [check.name, mark, check.detail, check.fix]
            table.add_row(*([check.scope] if key == "pairs" else []), *row)
        console.print(table)
