"""`invoke bench.rehearsal`: a cluster of N lab nodes cabled like Macs, taken from nothing to
training the way a new user takes it, each step timed and its outcome recorded.

A fresh lab of N hosts cabled as a ring (or a full mesh) is provisioned twice (the second run must
change nothing), `invoke doctor` must be green, `invoke train` runs a few steps with the backend
auto picks, `--backend mpi` either trains (a full mesh) or is refused with its reason (a ring),
and `invoke bench.tensor` shards a stand-in model across every node against one process, whose
losses it must give. Large shapes (8 nodes) live here, not in CI.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from mlxcluster.bench import provision, results
from mlxcluster.lab import hosts
from mlxcluster.launch import runs
from mlxcluster.paths import REPO

INVOKE = str(Path(sys.executable).parent / "invoke")
# A stand-in's losses on N ranks against one process's: float sums in another order only.
LOSS_TOLERANCE = 1e-3


def invoke(*args: str, timeout: float = 3600) -> tuple[subprocess.CompletedProcess[str], float]:
    """An `invoke` command as a user types it, and how long it took."""
    print(f"==> invoke {' '.join(args)}", flush=True)
    start = time.perf_counter()
    proc = subprocess.run([INVOKE, *args], cwd=REPO, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout, check=False)
    return proc, round(time.perf_counter() - start, 1)


def doctor(inventory: Path) -> dict[str, Any]:
    proc, seconds = invoke("doctor", "-i", str(inventory), "--json", timeout=600)
    try:
        checks = json.loads(proc.stdout)
    except ValueError:
        return {"seconds": seconds, "green": False, "error": (proc.stdout + proc.stderr)[-2000:]}
    red = [f"{c['scope']}: {c['name']}: {c['detail']}" for c in checks if not c["ok"]]
    routes = Counter(c["name"] for c in checks if c["name"].startswith("ssh over"))
    return {"seconds": seconds, "green": proc.returncode == 0 and not red, "checks": len(checks),
            "passed": len(checks) - len(red), "red": red, "pairs_by_route": dict(routes)}


def training(inventory: Path, steps: int, ranks: int, *flags: str) -> dict[str, Any]:
    """`invoke train` for `steps` steps of a global batch of one example per rank."""
    proc, seconds = invoke("train", "-i", str(inventory), "--iters", str(steps), "--batch-size", str(ranks),
                           "--extra", f"--steps-per-report 1 --steps-per-eval {steps} --val-batches 1",
                           *flags)
    found: dict[str, Any] = {"seconds": seconds, "flags": list(flags), "ok": proc.returncode == 0}
    run_dir = runs.named_in(proc.stdout)
    if proc.returncode != 0:
        # The last line a refusal or failure says, which is its reason.
        found["said"] = (proc.stderr.strip().splitlines() or proc.stdout.strip().splitlines() or [""])[-1]
        return found
    if run_dir is not None:
        summary = json.loads((run_dir / "summary.json").read_text())
        info = json.loads((run_dir / "run.json").read_text())
        found |= {"run": str(run_dir), "backend": info["backend"], "backend_why": info.get("backend_why"),
                  "world_size": summary["world_size"], "final_train_loss": summary.get("final_train_loss"),
                  "max_weight_difference_across_ranks": summary.get("max_weight_difference_across_ranks")}
    return found


def stand_in_model(folder: Path, ranks: int) -> Path:
    """A stand-in model that shards across `ranks`, with its manifest, as `invoke train --model`
    takes a folder."""
    from training.model import folder as model_folder
    from training.model import stand_in

    stand_in.make(folder / "source", **stand_in.shape_for(ranks))
    return model_folder.fetch(str(folder / "source"), folder / f"stand-in-{ranks}-ranks", "float32")


def tensor(inventory: Path, model: Path, steps: int, out: Path) -> dict[str, Any]:
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    proc, seconds = invoke("bench.tensor", "-i", str(inventory), "--model", str(model), "--iters", str(steps),
                           "--extra", f"--num-layers {layers}", "--output", str(out))
    if proc.returncode != 0:
        return {"seconds": seconds, "ok": False, "said": (proc.stdout + proc.stderr)[-2000:]}
    found = json.loads(out.read_text())
    return {"seconds": seconds, "ok": True, "ranks": found["tensor"]["ranks"], **found["figures"]}


def verdict(result: dict[str, Any]) -> list[str]:
    """What went wrong, each a line (none: the rehearsal passed)."""
    wrong = []
    first = result["provision"]
    if first["changed_second_run"]:
        wrong.append(f"a second provision changed {first['changed_second_run']} tasks")
    if not result["doctor"]["green"]:
        wrong.append(f"doctor is red: {result['doctor'].get('red') or result['doctor'].get('error')}")
    trained = result["train"]
    if not trained["ok"] or trained.get("world_size") != result["nodes"]:
        wrong.append(f"invoke train did not train on {result['nodes']} ranks: {trained.get('said')}")
    mpi = result["train_mpi"]
    if not mpi["ok"] and "--backend ring" not in mpi.get("said", ""):
        wrong.append(f"--backend mpi failed without its reason: {mpi.get('said')}")
    shards = result["tensor"]
    differences = [shards.get("max_train_loss_difference"), shards.get("max_val_loss_difference")]
    if not shards["ok"] or None in differences or max(differences) > LOSS_TOLERANCE:
        wrong.append(f"tensor parallelism did not give one process's losses: {shards}")
    return wrong


def run(nodes: int = 8, cables: str = "ring", lab_id: int = 8, steps: int = 3,
        output: str | None = None) -> Path:
    """The whole rehearsal on a fresh lab of `nodes` hosts; the JSON written."""
    with tempfile.TemporaryDirectory(prefix="mlx-rehearsal-") as tmp, \
            hosts.fresh(nodes, lab_id, cables=cables) as inventory:
        result: dict[str, Any] = {"benchmark": "rehearsal", "date": results.date(), "nodes": nodes,
                                  "cables": cables, "steps": steps,
                                  "provision": provision.twice(inventory, nodes)}
        result["doctor"] = doctor(inventory)
        result["train"] = training(inventory, steps, nodes)
        result["train_mpi"] = training(inventory, steps, nodes, "--backend", "mpi")
        model = stand_in_model(Path(tmp), nodes)
        result["tensor"] = tensor(inventory, model, steps, Path(tmp) / "tensor.json")
    result["wrong"] = verdict(result)
    p, d, t, m, s = (result[k] for k in ("provision", "doctor", "train", "train_mpi", "tensor"))
    summary = (f"{nodes} nodes cabled as a {cables}:\n"
               f"  provision: first {p['first_run_s']} s, second {p['second_run_s']} s "
               f"(changed {p['changed_second_run']})\n"
               f"  doctor: {d.get('passed')} of {d.get('checks')} green in {d['seconds']} s; "
               f"pairs {d.get('pairs_by_route')}\n"
               f"  train: {t.get('world_size')} ranks with {t.get('backend')} in {t['seconds']} s\n"
               f"  --backend mpi: {'trained' if m['ok'] else 'refused: ' + m.get('said', '')}\n"
               f"  tensor on {s.get('ranks')} ranks: largest loss difference to one process "
               f"{s.get('max_train_loss_difference')} (train), {s.get('max_val_loss_difference')} (val)")
    return results.held("rehearsal", result, output, summary, f"the rehearsal on {nodes} nodes failed")
