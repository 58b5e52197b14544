"""`invoke bench.provision`: how long provisioning takes on fresh nodes, that a second run changes
nothing, and how both grow with the number of nodes.

Each node count gets a fresh lab (cabled through one bridge, or point to point like Macs with
`cables`), a first and an idempotent second site.yml run, each profiled: the times, the slowest
tasks and the time each role took. Several node counts make a curve; its growth is each step's
time ratio over its node ratio (1 grows as the nodes do, below 1 slower than them).
"""

from __future__ import annotations

import itertools
import tempfile
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mlxcluster.bench import results
from mlxcluster.errors import UserError
from mlxcluster.lab import hosts
from mlxcluster.provision import ansible

# The aims for an idempotent re-run: 20 s on 3 nodes, 30 s on 8.
SECOND_RUN_TARGET_S = {3: 20, 8: 30}
TOP = 5


def by_role(profile: Sequence[tuple[str, float]]) -> dict[str, float]:
    """Where a run's time went: the seconds of its tasks summed by role ("thunderbolt : Set
    ..." is the thunderbolt role's; a play's own tasks, fact gathering say, are "play"), most first."""
    spent: dict[str, float] = defaultdict(float)
    for task, seconds in profile:
        role, sep, _ = task.partition(" : ")
        spent[role if sep else "play"] += seconds
    return {role: round(seconds, 2) for role, seconds in sorted(spent.items(), key=lambda kv: -kv[1])}


def _summary(run: ansible.TimedRun) -> dict[str, Any]:
    profile = run.recap.profile
    return {"seconds": round(run.seconds, 1), "changed": run.recap.changed(),
            "tasks_per_host": run.recap.tasks_per_host(),
            "seconds_by_role": by_role(profile),
            "slowest_tasks": [{"task": task, "seconds": seconds} for task, seconds in profile[:TOP]],
            "tasks": dict(profile),
            "recap": run.recap.stats}


def twice(inventory: Path, nodes: int) -> dict[str, Any]:
    """A first and a second site.yml run on the fresh lab of `inventory`, each profiled."""
    with tempfile.TemporaryDirectory(prefix="mlx-bench-facts-") as facts:
        cmd = ansible.provision(inventory)
        env = hosts.ansible_env(Path(facts))
        print(f"==> provision: {nodes} nodes, first run", flush=True)
        first = ansible.timed_run(cmd, env)
        print(f"==> provision: {nodes} nodes, second run", flush=True)
        second = ansible.timed_run(cmd, env)
    return {"nodes": nodes, "first_run_s": round(first.seconds, 1), "second_run_s": round(second.seconds, 1),
            "second_over_first": round(second.seconds / first.seconds, 3),
            "changed_first_run": first.recap.changed(), "changed_second_run": second.recap.changed(),
            "first_run": _summary(first), "second_run": _summary(second)}


def point(nodes: int, lab_id: int, cables: str | None) -> dict[str, Any]:
    """A first and a second site.yml run on a fresh lab of `nodes` hosts."""
    with hosts.fresh(nodes, lab_id, cables=cables) as inventory:
        return twice(inventory, nodes)


def growth(points: Sequence[Mapping[str, Any]], key: str) -> list[dict[str, Any]]:
    """From each node count to the next: the time ratio, the node ratio, and their quotient
    (1: the time grows as the nodes do; below 1: slower than them)."""
    steps = []
    for a, b in itertools.pairwise(points):
        time_ratio, node_ratio = b[key] / a[key], b["nodes"] / a["nodes"]
        steps.append({"from_nodes": a["nodes"], "to_nodes": b["nodes"], "time_ratio": round(time_ratio, 3),
                      "node_ratio": round(node_ratio, 3), "growth": round(time_ratio / node_ratio, 3)})
    return steps


def targets_missed(points: Sequence[Mapping[str, Any]]) -> list[str]:
    return [f"{p['nodes']} nodes: a second run took {p['second_run_s']} s, the aim is "
            f"{SECOND_RUN_TARGET_S[p['nodes']]} s"
            for p in points if p["second_run_s"] > SECOND_RUN_TARGET_S.get(p["nodes"], float("inf"))]


def plot(points: Sequence[Mapping[str, Any]], output: Path, cabling: str) -> Path:
    """First and second run times against the node count."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.5, 4), layout="constrained")
    axes = figure.add_subplot()
    nodes = [p["nodes"] for p in points]
    for key, label in (("first_run_s", "first run"), ("second_run_s", "second run (changed 0)")):
        axes.plot(nodes, [p[key] for p in points], "o-", label=label)
    axes.set_xlabel("nodes")
    axes.set_ylabel("seconds")
    axes.set_xticks(nodes)
    axes.set_title(f"site.yml on fresh lab nodes ({cabling})")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.savefig(output, dpi=120, format="png")
    return output


def run(nodes: Sequence[int] = (3,), lab_id: int = 8, output: str | None = None,
        cables: str | None = None) -> Path:
    """A first and a second site.yml run on a fresh lab of each node count in `nodes`."""
    points = [point(n, lab_id, cables) for n in sorted(set(nodes))]
    cabling = f"cabled as a {cables}" if cables else "one bridge"
    result: dict[str, Any] = {
        "benchmark": "provision", "date": results.date(), "cabling": cabling,
        "nodes": [p["nodes"] for p in points],
        "second_run_target_s": SECOND_RUN_TARGET_S,
        "growth_first_run": growth(points, "first_run_s"),
        "growth_second_run": growth(points, "second_run_s"),
        "targets_missed": targets_missed(points),
        "points": points,
    }
    out = results.write("provision", result, output)
    plot(points, out.with_suffix(".png"), cabling)
    for p in points:
        print(f"{p['nodes']} nodes: first run {p['first_run_s']} s (changed {p['changed_first_run']}), "
              f"second run {p['second_run_s']} s (changed {p['changed_second_run']})")
        for label in ("first", "second"):
            timed = p[f"{label}_run"]
            roles = ", ".join(f"{role} {s:.1f} s" for role, s in list(timed["seconds_by_role"].items())[:4])
            print(f"  {label} run, by role: {roles}; slowest task: "
                  f"{timed['slowest_tasks'][0]['task']} {timed['slowest_tasks'][0]['seconds']} s"
                  if timed["slowest_tasks"] else f"  {label} run: no profile")
    for step in result["growth_second_run"]:
        print(f"second run, {step['from_nodes']} -> {step['to_nodes']} nodes: x{step['time_ratio']} for "
              f"x{step['node_ratio']} the nodes (growth {step['growth']})")
    for missed in result["targets_missed"]:
        print(f"aim missed: {missed}")
    print(f"wrote {out} and {out.with_suffix('.png')}")
    changed = [p["nodes"] for p in points if p["changed_second_run"]]
    if changed:
        raise UserError(f"the second run changed something on {changed} nodes: "
                        "provisioning is not idempotent")
    return out
