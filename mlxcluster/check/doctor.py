"""`invoke doctor`: is the cluster fit to train, and if not, what to do about it.

Gathering is separate from judging: `gather` runs mlxcluster/check/probe.py on every node at once (one
ssh round trip each) and tiny MPI jobs on the launcher (hostname, an all_sum, then send/recv
between neighbouring ranks: pairs.py); `evaluate` turns what came back into
checks, each green or red with the fix for red, and is a plain function the unit tests drive.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mlxcluster.check import pairs, room
from mlxcluster.check.checks import Check
from mlxcluster.describe import drained
from mlxcluster.describe.backends import RDMA_HOWTO
from mlxcluster.describe.cluster import Cluster, Node, Recorded, hostfile_entries
from mlxcluster.errors import UserError
from mlxcluster.launch import builder, remote, stages
from mlxcluster.launch import parallel as parallel_modes
from mlxcluster.plan import model as model_files
from mlxcluster.plan import of_run
from mlxcluster.provision import inputs

PROBE = Path(__file__).with_name("probe.py")
REPROVISION = "run invoke provision -i <inventory>"
ALL_SUM = ("import mlx.core as mx; g = mx.distributed.init(strict=True); "
           "print(int(mx.distributed.all_sum(mx.array(1), group=g).item()))")


# --- gathering -------------------------------------------------------------------------------------


def probe_command(cluster: Cluster, node: Node) -> list[str]:
    """ssh (or local bash) that runs probe.py on `node`, fed on stdin, with the node's env.sh."""
    args = {"cluster_root": node.cluster_root or "", "venv": node.venv or "",
            "interfaces": [p.interface or "" for p in cluster.ports_of(node)],
            "peers": [cluster.address_towards(node, n) for n in cluster.nodes if n.name != node.name],
            # A Mac in links mode: its bridge's service name, to check that it is off.
            "macos_links": (node.bridge_service or "Thunderbolt Bridge")
            if node.os_family == "Darwin" and cluster.cables else None}
    env = shlex.quote(node.env_file or "/nonexistent")
    line = f"if [ -f {env} ]; then . {env}; fi; python3 - {shlex.quote(json.dumps(args))}"
    return remote.ssh_command(node, line, connect_timeout=5)


def probe_node(cluster: Cluster, node: Node, timeout: float = 60) -> dict[str, Any]:
    cmd = probe_command(cluster, node)
    try:
        proc = subprocess.run(cmd, input=PROBE.read_text(), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"unreachable": f"no answer within {timeout:.0f} s"}
    if proc.returncode == 255 and not remote.is_local(node):
        return {"unreachable": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "ssh failed"}
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"unreachable": f"the probe failed ({proc.returncode}): {proc.stderr.strip()[-300:]}"}


def mpi_job(cluster: Cluster, program: Sequence[str], timeout: float = 60,
            backend: str = "mpi") -> tuple[int, str]:
    """Run `program` on every slot from the launcher (mpirun, or mlx-cluster-launch with ring), as every
    launch does. In the cluster root: the work directory appears only with the first run."""
    job = builder.Job(program, backend=backend, workdir=cluster.head.cluster_root)
    try:
        proc = subprocess.run(builder.command(cluster, job), capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return 124, f"no answer within {timeout:.0f} s"
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def gather(cluster: Cluster) -> dict[str, Any]:
    """Every node's probe, all at once."""
    with ThreadPoolExecutor(max_workers=len(cluster.nodes)) as pool:
        facts = dict(zip((n.name for n in cluster.nodes),
                         pool.map(lambda n: probe_node(cluster, n), cluster.nodes), strict=True))
    return {"nodes": facts, "jobs": {}}


def memory_of(gathered: Mapping[str, Any]) -> dict[str, int | None]:
    """Each probed node's free memory as the memory check counts it (None: not known, e.g. the
    node did not answer)."""
    return {name: room.free_memory(facts.get("memory") or {}) for name, facts in gathered["nodes"].items()}


def run_jobs(cluster: Cluster) -> dict[str, tuple[Any, ...]]:
    """The cluster-wide jobs: hostname on every slot and an MLX all_sum over every rank, with
    mpirun; in links mode the all_sum alone, with the backend training uses there (ring or JACCL).
    Then, when they passed, MLX send/recv between neighbouring ranks, as a pipeline sends."""
    backend = builder.backend_for(cluster, None)  # the one a run would take
    if cluster.cables:
        jobs: dict[str, tuple[Any, ...]] = {
            "all_sum": mpi_job(cluster, ["python", "-c", ALL_SUM], backend=backend)}
    else:
        jobs = {"hostname": mpi_job(cluster, ["hostname"])}
        if cluster.world_size > 1:
            jobs["all_sum"] = mpi_job(cluster, ["python", "-c", ALL_SUM])
    if cluster.world_size > 1 and all(job[0] == 0 for job in jobs.values()):
        # Send/recv between neighbouring ranks, over that backend (pairs.py).
        jobs["send_recv"] = (*mpi_job(cluster, pairs.program(), backend=backend), backend)
    return jobs


def diagnose(cluster: Cluster, rendered_hostfile: str, need: room.Need | None, *,
             mpi_jobs: bool = True, gathered: Mapping[str, Any] | None = None) -> list[Check]:
    """Probe (unless `gathered` holds the probes already), judge, and only on a cluster that is
    green so far, launch the MPI jobs: on a red one they could only fail, slowly (a down link
    makes mpirun wait for its timeouts)."""
    gathered = dict(gathered) if gathered is not None else gather(cluster)
    checks = evaluate(cluster, rendered_hostfile, gathered, need)
    if not mpi_jobs or cluster.world_size == 0:
        return checks
    red = sum(not c.ok for c in checks)
    if red:
        jobs = ("MLX all_sum, send/recv" if cluster.cables
                else "MPI jobs (mpirun hostname, MLX all_sum, send/recv)")
        return [*checks, Check("cluster", jobs, False,
                               f"not run: {red} check(s) above failed", "fix those first")]
    gathered["jobs"] = run_jobs(cluster)
    return evaluate(cluster, rendered_hostfile, gathered, need)


# --- judging ---------------------------------------------------------------------------------------


def _size(n: float) -> str:
    """Bytes as people read them: `22.4 GiB`, or `160 MiB` below a GiB (a small model's need)."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


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


def _packages(found: Mapping[str, Mapping[str, str] | None]) -> list[Check]:
    """Every package of the venv (python_env_extra_packages too) at one version on every node: per
    node, what differs from the version most nodes have (an older probe's nodes: not judged)."""
    seen = {node: packages for node, packages in found.items() if packages}
    if len(seen) < 2:
        return []
    named = {"mlx", "mlx-lm"}  # checked on their own
    names = sorted({name for packages in seen.values() for name in packages} - named)
    majority = {name: Counter(p.get(name) for p in seen.values()).most_common(1)[0][0] for name in names}
    checks = []
    for node, packages in seen.items():
        odd = [f"{name} {packages.get(name) or 'missing'} (others: {majority[name] or 'none'})"
               for name in names if packages.get(name) != majority[name]]
        if odd:
            detail = "; ".join(odd[:6]) + (" ..." if len(odd) > 6 else "")
            checks.append(Check(node, "packages", False, detail,
                                f"nodes must agree: {REPROVISION} (the python_env role installs mlx, mlx-lm "
                                "and python_env_extra_packages, pinned, on every node)"))
        else:
            checks.append(Check(node, "packages", True, f"{len(names)} more in the venv, as on every node"))
    return checks


Facts = Mapping[str, Mapping[str, Any]]  # node name -> what its probe found


def _management(cluster: Cluster, facts: Facts) -> list[Check]:
    checks = []
    for node in cluster.nodes:
        f = facts.get(node.name, {"unreachable": "not probed"})
        conn = node.connection or {}
        how = "local" if remote.is_local(node) else f"ssh {conn.get('user') or ''}@{conn.get('host')}"
        if "unreachable" in f:
            checks.append(Check(node.name, "management ssh", False, f"{how}: {f['unreachable']}",
                                "power the node on, check ansible_host/ansible_user in the inventory "
                                "and that `ssh` to it works without a prompt"))
        else:
            checks.append(Check(node.name, "management ssh", True, how))
    return checks


def _pairs(cluster: Cluster, nodes: Sequence[Node], facts: Facts) -> list[Check]:
    checks = []
    for node in nodes:
        for peer in cluster.nodes:
            if peer.name == node.name:
                continue
            route = cluster.path_towards(node, peer)
            address = route.address
            result = facts[node.name]["ssh"].get(address, {"ok": False, "error": ["not tried"]})
            error = " ".join(result["error"] or [])
            if result["ok"]:
                fix = ""
            elif any(s in error for s in ("Permission denied", "Host key", "HOST IDENTIFICATION")):
                fix = f"{REPROVISION} (the ssh_mesh role installs every node's key and pins host keys)"
            elif not route.cabled:
                fix = "check that the nodes reach each other on the network Ansible uses, and that sshd runs"
            else:
                fix = "check the cable and both nodes' interface checks, and that sshd runs on the peer"
            # Which way each pair goes is part of the answer: a cable, the bridge, or (no cable
            # between them in links mode) the management network.
            name = "ssh over the cluster link" if route.cabled else "ssh over the management network"
            checks.append(Check(
                f"{node.name} -> {peer.name}", name, result["ok"],
                f"{address} ({route.over})" if result["ok"] else f"{address} ({route.over}): {error}", fix))
            if result["ok"]:
                checks += _python_reach(node, peer, address, facts[node.name].get("python_reach", {}))
    return checks


# macOS's EHOSTUNREACH: what Local Network Privacy answers a process it refuses the local network.
MACOS_EHOSTUNREACH = 65
LOCAL_NETWORK_FIX = (
    "macOS Local Network Privacy refuses the venv's Python the local network although ssh and ping "
    "reach the peer (Apple TN3179; mlx #3755): on {node}, System Settings > Privacy & Security > "
    "Local Network, allow the Python (or the app that starts it); a Python started from launchd, "
    "tmux or a uv-managed interpreter is refused until then. Run invoke doctor again after")


def _python_reach(node: Node, peer: Node, address: str, reached: Mapping[str, Any]) -> list[Check]:
    """The venv's Python connecting to a peer that ssh reaches, as a rank would (probe.python_reach);
    nothing when it was not tried (no venv: the venv check says so)."""
    pair, name = f"{node.name} -> {peer.name}", "the venv's Python reaches it"
    if "error" in reached:
        return [Check(pair, name, False, f"the probe could not run it: {reached['error']}",
                      f"{REPROVISION} (the python_env role builds the venv)")]
    if address not in reached:
        return []
    if (refused := reached[address]) is None:
        return [Check(pair, name, True, f"{address}: a TCP connect from the venv's Python")]
    number, meaning = refused
    mac = node.os_family == "Darwin"
    fix = (LOCAL_NETWORK_FIX.format(node=node.name) if mac and number == MACOS_EHOSTUNREACH
           else "a firewall on either node refuses the venv's Python: allow it, then invoke doctor")
    return [Check(pair, name, False,
                  f"{address}: errno {number} ({meaning}) from the venv's Python, while ssh reaches it", fix)]


def _software(cluster: Cluster, nodes: Sequence[Node], facts: Facts) -> list[Check]:
    venvs = {n.name: facts[n.name]["venv"] for n in nodes}
    checks = _agreement("Open MPI", {n.name: facts[n.name]["openmpi"] for n in nodes},
                        f"{REPROVISION} (the openmpi role installs it)")
    for key, label in (("python", "Python"), ("mlx", "mlx"), ("mlx_lm", "mlx-lm")):
        checks += _agreement(label, {n: v.get(key) for n, v in venvs.items()},
                             f"{REPROVISION} (the python_env role pins it)")
    checks += _packages({n: v.get("packages") for n, v in venvs.items()})
    head_venv = cluster.head.venv
    for node in nodes:
        error = "none recorded: not provisioned yet" if not node.venv else venvs[node.name].get("error")
        if error or node.venv != head_venv:
            detail = error or f"{node.venv}, but the launcher's is {head_venv}"
            checks.append(Check(node.name, "venv", False, detail,
                                f"{REPROVISION}; every node needs the venv at the same path"))
        elif not venvs[node.name].get("distributed"):
            checks.append(Check(node.name, "venv", False, "mlx cannot load MPI",
                                f"{REPROVISION} (libmpi missing from the node)"))
        else:
            checks.append(Check(node.name, "venv", True, str(node.venv)))
    return checks


def _hostfiles(nodes: Sequence[Node], facts: Facts, rendered_hostfile: str) -> list[Check]:
    expected = hostfile_entries(rendered_hostfile)
    checks = []
    for node in nodes:
        text = facts[node.name]["hostfile"]
        ok = text is not None and hostfile_entries(text) == expected
        detail = "as rendered" if ok else ("missing" if text is None else
                                           "differs from build/<inventory>/hostfile")
        checks.append(Check(node.name, "hostfile", ok, detail,
                            "" if ok else f"{REPROVISION} (it renders and copies the hostfile)"))
    return checks


def _interfaces(cluster: Cluster, nodes: Sequence[Node], facts: Facts) -> list[Check]:
    """Each of a node's ports on the cluster link: up, with its address and the MTU. In links
    mode a port that is down names its cable."""
    checks = []
    for node in nodes:
        for port in cluster.ports_of(node):
            iface = facts[node.name]["interfaces"].get(port.interface or "", {"error": "not probed"})
            want = f"{port.address}/{port.prefix}"
            if "error" in iface:
                checks.append(Check(node.name, port.label, False, iface["error"],
                                    "connect the cable, or fix the port in the inventory "
                                    "(thunderbolt_interface or thunderbolt_links)"))
                continue
            problems = []
            if not iface["up"]:
                problems.append("down" + (f": cable {port.cable} unplugged or its far end down"
                                          if port.cable else ""))
            if want not in iface["addresses"]:
                problems.append(f"has {', '.join(iface['addresses']) or 'no address'}, not {want}")
            # Loopback (the single-machine inventory) is left as it is by the thunderbolt role.
            if node.thunderbolt_mtu and not iface.get("loopback") and iface["mtu"] != node.thunderbolt_mtu:
                problems.append(f"MTU {iface['mtu']}, not {node.thunderbolt_mtu}")
            fix = (f"plug cable {port.cable} in firmly (both ends), then {REPROVISION}" if port.cable
                   and not iface["up"] else f"{REPROVISION} (the thunderbolt role sets address and MTU)")
            checks.append(Check(node.name, port.label, not problems,
                                "; ".join(problems) or f"up, {want}, MTU {iface['mtu']}",
                                fix if problems else ""))
    return checks


def _macs(cluster: Cluster, nodes: Sequence[Node], facts: Facts) -> list[Check]:
    """Macs in links mode: one macOS version on all, the Thunderbolt Bridge service off, and
    RDMA on every cabled port when the backend is JACCL."""
    macs = [n for n in nodes if "macos" in facts[n.name]]
    if not macs:
        return []
    checks = _agreement("macOS", {n.name: facts[n.name]["macos"]["version"] for n in macs},
                        "update every Mac to the same macOS (Software Update): MLX's distributed "
                        "backends and RDMA need the same on all")
    try:
        backend = cluster.backend_choice().backend
    except ValueError:
        backend = "ring"
    for node in macs:
        mac = facts[node.name]["macos"]
        off = mac["bridge_service"] == "Disabled"
        checks.append(Check(node.name, "Thunderbolt Bridge service", off,
                            "off" if off else f"{node.bridge_service or 'Thunderbolt Bridge'}: "
                            f"{mac['bridge_service']}: its ports are bridged "
                            "(a loop on a ring)", "" if off else
                            f"{REPROVISION} (the thunderbolt role turns it off in links mode)"))
        missing = [f"rdma_{p.interface}" for p in cluster.ports_of(node)
                   if f"rdma_{p.interface}" not in mac["rdma_devices"]]
        if not backend.startswith("jaccl"):
            checks.append(Check(node.name, "RDMA", True, f"not used by the {backend} backend "
                                f"(rdma_ctl status: {mac['rdma']})"))
            continue
        ok = mac["rdma"] == "enabled" and not missing
        detail = (f"enabled: {', '.join(mac['rdma_devices'])}" if ok else
                  f"rdma_ctl status: {mac['rdma']}" + (f"; no {', '.join(missing)} in ibv_devices"
                                                       if missing else ""))
        checks.append(Check(node.name, "RDMA", ok, detail, "" if ok else
                            f"{RDMA_HOWTO}; or train with --backend ring"))
    return checks


GPU_WIRED_FIX = ("raise the GPU's wired limit (macos_gpu_wired_limit_mb in the inventory, which sets "
                 "iogpu.wired_limit_mb: invoke provision), leaving macOS a few GB; or ")


def _room(nodes: Sequence[Node], facts: Facts, need: room.Need | None) -> list[Check]:
    """Free memory (for what each node's ranks hold) and free disk (for the model folder)."""
    checks: list[Check] = []
    if need is None:
        return checks
    for node in nodes:
        free, disk = room.free_memory(facts[node.name]["memory"]), facts[node.name]["disk_free"]
        if free is not None and node.name in need.memory:
            want = need.memory[node.name]
            ok = free >= want
            memory = facts[node.name]["memory"]
            # On a Mac the GPU may wire less than is free (Metal's recommended working set): then
            # that is the bound, and raising it the first fix.
            wired = memory.get("gpu_limit") == free and (memory.get("available") or 0) > free
            checks.append(Check(node.name, "free memory", ok,
                                (f"{_size(free)} the GPU may wire ({_size(memory['available'])} free)"
                                 if wired else f"{_size(free)} free") + f", need ~{_size(want)} for "
                                f"{need.held[node.name]}",
                                "" if ok else (GPU_WIRED_FIX + need.fix if wired else need.fix)))
        if disk is not None:
            ok = disk >= need.disk
            checks.append(Check(node.name, "free disk", ok,
                                f"{_size(disk)} free under cluster_root, need ~{_size(need.disk)}",
                                "" if ok else "free disk space under cluster_root (old runs/)"))
    return checks


def _jobs(cluster: Cluster, facts: Facts, jobs: Mapping[str, tuple[Any, ...]]) -> list[Check]:
    checks = []
    if "hostname" in jobs:
        code, out = jobs["hostname"]
        want_names = Counter({facts[n.name]["hostname"]: n.slots for n in cluster.training_nodes})
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
    if "send_recv" in jobs:
        checks += pairs.judge(cluster, jobs["send_recv"])
    return checks


def evaluate(cluster: Cluster, rendered_hostfile: str, gathered: Mapping[str, Any],
             need: room.Need | None = None) -> list[Check]:
    """Every check, green or red, from what `gather` (and the MPI jobs) found."""
    checks = _management(cluster, gathered["nodes"])
    reachable = {c.scope for c in checks if c.ok}
    facts = {name: f for name, f in gathered["nodes"].items() if name in reachable}
    nodes = [n for n in cluster.nodes if n.name in reachable]
    return [*checks, *_pairs(cluster, nodes, facts), *_software(cluster, nodes, facts),
            # A layout of fewer nodes (after a node was left out) writes its own at launch.
            *(_hostfiles(nodes, facts, rendered_hostfile) if cluster.provisioned else []),
            *_interfaces(cluster, nodes, facts),
            *_macs(cluster, nodes, facts),
            *_room(nodes, facts, need), *_jobs(cluster, facts, gathered.get("jobs", {}))]


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


# --- before a launch --------------------------------------------------------------------------------


class NotFit(UserError):
    """Red checks: the cluster is not fit to train; they were shown with their fixes."""


def red_node_checks(cluster: Cluster, need: room.Need | None,
                    gathered: Mapping[str, Any] | None = None) -> list[Check]:
    """The per-node checks (not the MPI jobs) that fail (on `gathered`'s probes, when given)."""
    rendered = "\n".join(cluster.hostfile_lines())
    return [c for c in diagnose(cluster, rendered, need, mpi_jobs=False, gathered=gathered) if not c.ok]


def preflight(cluster: Cluster, need: room.Need | None, gathered: Mapping[str, Any] | None = None) -> None:
    """invoke doctor's per-node checks (not its MPI jobs: the launch is one): stop on any red.
    `gathered`: the nodes' probes when the plan asked them already (pipeline stages sized from
    their memory), so that they are asked once."""
    from rich.console import Console

    print("==> checking the nodes (invoke doctor has the full set)", flush=True)
    if failed := red_node_checks(cluster, need, gathered):
        render(failed, Console(stderr=True))
        raise NotFit(f"not launching: {len(failed)} check(s) failed on the nodes (see the fix column)")


def report(checks: Sequence[Check], cluster: Cluster, seconds: float, *, as_json: bool) -> None:
    """invoke doctor's output: the tables (or JSON) and a summary line; NotFit if any is red."""
    from rich.console import Console

    console = Console()
    if as_json:
        print(json.dumps([dataclasses.asdict(c) for c in checks], indent=2))
    else:
        render(checks, console)
    failed = [c for c in checks if not c.ok]
    summary = (f"{len(checks) - len(failed)} of {len(checks)} checks passed on "
               f"{len(cluster.nodes)} nodes in {seconds:.1f} s")
    if failed:
        raise NotFit(f"{summary}: {len(failed)} failed (see the fix column)")
    if as_json:
        print(summary, file=sys.stderr)
    else:
        console.print(f"[green]{summary}[/]")


def run(rec: Recorded, model: str | None, as_json: bool = False, parallel: str = "data") -> None:
    """invoke doctor: every check of the recorded cluster, reported; the memory and disk checks
    against `model` (default: the provisioned or embedded model) as the default settings' run in
    `parallel` mode would peak (mlxcluster/plan/), dequantized on the nodes whose inventory says
    model_dequantize."""
    parallel_modes.flags(parallel)  # refuses another word
    start = time.perf_counter()
    model_dir = Path(model) if model else inputs.checked_model(rec.cluster)
    gathered = gather(rec.cluster)
    found = model_files.weights(model_dir, by_layer=True) if parallel == "pipeline" else None
    sized = stages.for_doctor(rec.cluster, model_dir, parallel, memory_of(gathered), found and found.body)
    peaks = of_run.default_run_peaks(rec.cluster, model_dir, parallel, sized)  # the default run's
    need = room.for_run(rec.cluster, model_dir, parallel=parallel, stages=sized, peaks=peaks)
    checks = diagnose(rec.cluster, rec.rendered_hostfile, need, gathered=gathered)
    checks += left_out(drained.read(rec.build).values(), checks)
    report(checks, rec.cluster, time.perf_counter() - start, as_json=as_json)


def red_for(node: str, checks: Iterable[Check]) -> list[Check]:
    """The red checks that name `node`: its own, and those of the pairs it is an end of."""
    return [c for c in checks if not c.ok and node in c.nodes]


def left_out(entries: Iterable[drained.Drained], checks: Sequence[Check]) -> list[Check]:
    """A row per node left out of training after a fault (mlxcluster/describe/drained.py): red
    while any of its checks is, green once they all pass (the next launch lets it back in)."""
    rows = []
    for entry in entries:
        red = red_for(entry.node, checks)
        rows.append(Check(entry.node, "left out of training", not red,
                          f"since {entry.at.replace('T', ' ')} by run {entry.run} ({entry.cause})"
                          + ("; its checks pass: the next invoke train lets it back in" if not red
                             else f"; {len(red)} of its checks fail"),
                          "" if not red else "fix its red checks above; the next invoke train lets "
                          "it back in once they pass"))
    return rows
