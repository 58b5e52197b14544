"""`invoke bench.provision`: how long provisioning takes on fresh nodes, and that a second run
changes nothing."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from mlxcluster import ansible, lab
from mlxcluster.bench import results
from mlxcluster.errors import UserError


def run(nodes: int = 3, lab_id: int = 8, output: str | None = None) -> Path:
    """A first and an idempotent second site.yml run on a fresh lab of `nodes` hosts."""
    with tempfile.TemporaryDirectory(prefix="mlx-bench-facts-") as facts, \
            lab.fresh(nodes, lab_id) as inventory:
        cmd, env = ansible.provision(inventory), lab.ansible_env(Path(facts))
        first, recap1 = ansible.timed_run(cmd, env)
        second, recap2 = ansible.timed_run(cmd, env)
    result: dict[str, Any] = {
        "benchmark": "provision",
        "date": results.date(),
        "nodes": nodes,
        "first_run_s": round(first, 1),
        "second_run_s": round(second, 1),
        "second_over_first": round(second / first, 3),
        "changed_first_run": sum(h["changed"] for h in recap1.values()),
        "changed_second_run": sum(h["changed"] for h in recap2.values()),
        "recap_second_run": recap2,
    }
    out = results.write("provision", result, output)
    print(json.dumps(result, indent=2))
    print(f"wrote {out}")
    if result["changed_second_run"]:
        raise UserError("the second run changed something: provisioning is not idempotent")
    return out
