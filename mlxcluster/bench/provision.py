"""`invoke bench.provision`: how long provisioning takes on fresh nodes, and that a second run
changes nothing."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from mlxcluster.bench import results
from mlxcluster.errors import UserError
from mlxcluster.lab import hosts
from mlxcluster.provision import ansible

# The aim for an idempotent re-run on 3 nodes, and how many slow tasks are reported.
SECOND_RUN_TARGET_S = 20
TOP = 5


def _summary(run: ansible.TimedRun) -> dict[str, Any]:
    return {"seconds": round(run.seconds, 1), "changed": run.changed(),
            "tasks_per_host": run.tasks_per_host(),
            "slowest_tasks": [{"task": task, "seconds": seconds}
                              for task, seconds in run.profile[:TOP]],
            "recap": run.recap}


def run(nodes: int = 3, lab_id: int = 8, output: str | None = None) -> Path:
    """A first and an idempotent second site.yml run on a fresh lab of `nodes` hosts, each
    profiled (ansible.posix.profile_tasks): times, tasks per host, changes, slowest tasks."""
    with tempfile.TemporaryDirectory(prefix="mlx-bench-facts-") as facts, \
            hosts.fresh(nodes, lab_id) as inventory:
        cmd = ansible.provision(inventory)
        env = {**hosts.ansible_env(Path(facts)), **ansible.PROFILE_ENV}
        first = ansible.timed_run(cmd, env)
        second = ansible.timed_run(cmd, env)
    result: dict[str, Any] = {
        "benchmark": "provision",
        "date": results.date(),
        "nodes": nodes,
        "first_run_s": round(first.seconds, 1),
        "second_run_s": round(second.seconds, 1),
        "second_over_first": round(second.seconds / first.seconds, 3),
        "second_run_target_s": SECOND_RUN_TARGET_S,
        "changed_first_run": first.changed(),
        "changed_second_run": second.changed(),
        "first_run": _summary(first),
        "second_run": _summary(second),
    }
    out = results.write("provision", result, output)
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("_run")}, indent=2))
    for label, timed in (("first", first), ("second", second)):
        print(f"{label} run: {timed.seconds:.1f} s, tasks per host "
              f"{sorted(set(timed.tasks_per_host().values()))}, slowest:")
        for task, seconds in timed.profile[:TOP]:
            print(f"  {seconds:6.2f} s  {task}")
    print(f"wrote {out}")
    if result["changed_second_run"]:
        raise UserError("the second run changed something: provisioning is not idempotent")
    return out
