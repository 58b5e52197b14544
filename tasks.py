"""Entry point: `invoke --list` shows what you can do.

Each task is a thin wrapper: the command lines are built in mlxcluster/ (tested there).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from invoke.collection import Collection
from invoke.context import Context
from invoke.exceptions import Exit
from invoke.tasks import task

from mlxcluster import commands, lab

REPO = Path(__file__).resolve().parent
VENV_BIN = Path(sys.executable).parent
INVENTORY_HELP = "Inventory file (default: cluster.inventory in invoke.yaml, the local machine)"


def _inventory(c: Context, inventory: str | None) -> str:
    path = Path(inventory or c.config.cluster.inventory)
    if not path.is_absolute():
        path = REPO / path
    if not path.exists():
        raise Exit(f"inventory {path} does not exist: pass -i/--inventory PATH "
                   "(see inventory/hosts.yml for an example)")
    return str(path)


def _run(c: Context, cmd: list[str], **kwargs: object) -> object:
    """Run with the venv's tools first on PATH, from the repo root (ansible.cfg applies)."""
    env = {"PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    with c.cd(str(REPO)):
        return c.run(commands.join(cmd), env=env, pty=sys.stdout.isatty(), **kwargs)


@task(help={"inventory": INVENTORY_HELP,
            "check": "Dry run: report what would change, change nothing",
            "diff": "Show file differences",
            "tags": "Only these plays, e.g. ssh,hostfile (see site.yml)",
            "limit": "Only these hosts"})
def provision(c, inventory=None, check=False, diff=False, tags=None, limit=None):
    """Provision every node of the inventory (ansible-playbook site.yml)."""
    inv = _inventory(c, inventory)
    _run(c, commands.provision(inv, check=check, diff=diff, tags=tags, limit=limit))


@task(help={"inventory": INVENTORY_HELP, "output": "Directory to write hostfile and hosts.json"})
def hostfile(c, inventory=None, output=None):
    """Render the Open MPI hostfile and MLX hosts.json from inventory, touching no host."""
    inv = _inventory(c, inventory)
    out = Path(output) if output else commands.build_dir_for(inv)
    _run(c, commands.render_hostfiles(inv, out))
    print(f"wrote {out / 'hostfile'} and {out / 'hosts.json'}")


def _ruff_targets() -> list[str]:
    return ["tasks.py", "mlxcluster", "training", "tests", "filter_plugins"]


@task
def lint(c):
    """Lint everything: ruff, yamllint, ansible-lint (production profile)."""
    _run(c, ["ruff", "check", *_ruff_targets()])
    _run(c, ["yamllint", "--strict", "."])
    _run(c, ["ansible-lint", "--profile", "production", "--offline"])


@task(help={"unit": "Only the fast unit tests (no root, no hosts)",
            "k": "Only tests matching this pytest -k expression",
            "lint_first": "Lint before testing (default yes)"})
def test(c, unit=False, k=None, lint_first=True):
    """Run the linters, the unit tests and the lab-cluster tests."""
    if lint_first:
        lint(c)
    cmd = ["pytest", "tests/unit"] if unit else ["pytest"]
    if k:
        cmd += ["-k", k]
    if not unit and os.geteuid() == 0:
        lab.prepare_offline_cache()
    _run(c, cmd)


# ---------------------------------------------------------------------------- lab

def _lab_call(fn, *args):
    try:
        return fn(*args)
    except lab.LabError as exc:
        raise Exit(f"lab: {exc}") from exc


@task(name="up", help={"nodes": "Number of hosts (1-9; existing ones are kept)",
                       "id": "Lab number 0-9 (default: lab.id in invoke.yaml)"})
def lab_up(c, nodes=None, id=None):
    """Bring up a lab cluster of real Debian hosts in network namespaces (root)."""
    lab_id = int(id if id is not None else c.config.lab.id)
    n = int(nodes or c.config.lab.nodes)
    _lab_call(lab.prepare_offline_cache)
    inventory = _lab_call(lab.up, n, lab_id)
    print(f"lab {lab_id}: {n} hosts up; inventory: {inventory}")
    print(f"provision it with: invoke provision -i {inventory}")


@task(name="down", help={"id": "Lab number 0-9"})
def lab_down(c, id=None):
    """Tear the lab cluster down, leaving nothing behind."""
    _lab_call(lab.down, int(id if id is not None else c.config.lab.id))


@task(name="status", help={"id": "Lab number 0-9"})
def lab_status(c, id=None):
    """Show the lab's hosts and inventory."""
    print(json.dumps(lab.status(int(id if id is not None else c.config.lab.id)), indent=2))


# -------------------------------------------------------------------------- bench

def _timed_playbook(cmd: list[str], env: dict[str, str]) -> tuple[float, dict, str]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise Exit(f"{commands.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}")
    return elapsed, commands.parse_recap(proc.stdout), proc.stdout


@task(name="provision", help={"nodes": "Lab hosts (default 3)", "id": "Lab number (default 8)",
                              "output": "JSON file to write (default runs/bench/...)"})
def bench_provision(c, nodes=3, id=8, output=None):
    """Time a first and an idempotent second site.yml run on a fresh lab cluster."""
    lab_id = int(id)
    _lab_call(lab.prepare_offline_cache)
    _lab_call(lab.down, lab_id)
    inventory = str(_lab_call(lab.up, int(nodes), lab_id))
    facts = Path(f"/tmp/mlx-bench-facts-{lab_id}")
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
           "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(facts)}
    try:
        cmd = commands.provision(inventory)
        first, recap1, _ = _timed_playbook(cmd, env)
        second, recap2, _ = _timed_playbook(cmd, env)
    finally:
        _lab_call(lab.down, lab_id)
    result = {
        "benchmark": "provision",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "nodes": int(nodes),
        "first_run_s": round(first, 1),
        "second_run_s": round(second, 1),
        "second_over_first": round(second / first, 3),
        "changed_first_run": sum(h["changed"] for h in recap1.values()),
        "changed_second_run": sum(h["changed"] for h in recap2.values()),
        "recap_second_run": recap2,
    }
    out = Path(output) if output else (
        REPO / "runs" / "bench" / f"provision-{dt.datetime.now():%Y%m%d-%H%M%S}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"wrote {out}")
    if result["changed_second_run"]:
        raise Exit("the second run changed something: provisioning is not idempotent")


lab_ns = Collection("lab", lab_up, lab_down, lab_status)
bench_ns = Collection("bench", bench_provision)
ns = Collection(provision, hostfile, lint, test, lab_ns, bench_ns)
ns.configure({"cluster": {"inventory": "inventory/local/hosts.yml"},
              "lab": {"id": 0, "nodes": 3}})
