"""`invoke doctor`'s point-to-point check: MLX send/recv between the ranks a pipeline run pairs.

An all_sum over every rank can pass while send/recv between two of them fails (mlx #3149: back-to-
back sends of different shapes on a JACCL mesh deliver wrong data; mlx #4276: a ring recv fails in
multi-node pipelines), and a pipeline run (--parallel pipeline) talks only send/recv, rank r with
r - 1 and r + 1. training/tools/send_recv.py does on every rank what a stage does, with the shapes
and dtypes a stage sends, and prints what it received; here that output becomes one check per
neighbouring pair of ranks, red naming the pair's nodes, ranks and the tensor that came wrong.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from mlxcluster.check.checks import Check
from mlxcluster.describe.cluster import Cluster
from mlxcluster.paths import REPO

# The node-side check, sent as its text with `python -c` (the doctor runs before any code is synced).
NODE_SIDE = REPO / "training" / "tools" / "send_recv.py"
MARKER = "SEND_RECV_JSON "  # training/tools/send_recv.py's (a unit test keeps the two equal)
NAME = "MLX send/recv, pipeline shapes"
FIX = ("MLX's point-to-point between these ranks fails (known faults: mlx #3149 on JACCL, #4276 on "
       "ring): check the cable between them, and try another backend (invoke doctor/train "
       "--backend ring, jaccl or mpi); data-parallel runs do not use it, --parallel pipeline does")


def program(micro: int = 2, seq: int = 16, hidden: int = 64) -> list[str]:
    """Every rank's argv: the node-side check's text run by the venv's python."""
    return ["python", "-c", NODE_SIDE.read_text(), "--micro-batch", str(micro), "--seq", str(seq),
            "--hidden", str(hidden)]


def reports(out: str) -> dict[int, dict[str, Any]]:
    """Each rank's JSON line from the job's output, by rank (lines that are not one are skipped:
    the launcher's and MPI's own)."""
    found: dict[int, dict[str, Any]] = {}
    for line in out.splitlines():
        if MARKER not in line:
            continue
        try:
            report = json.loads(line.split(MARKER, 1)[1])
        except ValueError:
            continue
        if isinstance(report, dict) and isinstance(report.get("rank"), int):
            found[report["rank"]] = report
    return found


def _mismatch(item: Mapping[str, Any]) -> str:
    """One wrong tensor in a few words: which way, which tensor, expected against what came."""
    where = (f"rank {item['from']} -> {item['to']} ({item['direction']}), "
             f"tensor {item['tensor']} {item['what']}")
    if "got_shape" in item:
        return f"{where}: came as {item['got_shape']}"
    return (f"{where}: {item['wrong']} of {item['of']} values wrong, the first at {item['first_at']}: "
            f"expected {item['expected']:g}, got {item['got']:g}")


def _heard(report: Mapping[str, Any] | None, source: int) -> bool:
    return bool(report) and any(c["from"] == source for c in report.get("checked", []))


def pair_check(cluster: Cluster, low: int, found: Mapping[int, Mapping[str, Any]],
               backend: str, code: int, out: str) -> Check:
    """Ranks `low` and `low + 1`: green when each received every tensor of the other, exactly."""
    high = low + 1
    scope = f"{cluster.node_of_rank(low)} -> {cluster.node_of_rank(high)}"
    name = f"{NAME}, ranks {low} <-> {high} ({backend})"
    wrong = [_mismatch(m) for rank in (low, high) for m in (found.get(rank) or {}).get("mismatches", [])
             if {m["from"], m["to"]} == {low, high}]
    silent = [f"rank {receiver} ({cluster.node_of_rank(receiver)}) "
              + (f"failed: {found[receiver]['error']}" if (found.get(receiver) or {}).get("error")
                 else "received nothing from rank " + str(sender))
              for receiver, sender in ((high, low), (low, high)) if not _heard(found.get(receiver), sender)]
    if not wrong and not silent:
        return Check(scope, name, True, "every tensor both ways arrived as sent")
    detail = "; ".join(wrong + silent)
    if silent and code != 0:
        detail += f" (exit {code}: {out.strip()[-200:]})"
    return Check(scope, name, False, detail, FIX)


def judge(cluster: Cluster, job: tuple[int, str, str]) -> list[Check]:
    """One check per neighbouring pair of ranks, from the job's exit code, output and backend."""
    code, out, backend = job
    found = reports(out)
    return [pair_check(cluster, low, found, backend, code, out) for low in range(cluster.world_size - 1)]

