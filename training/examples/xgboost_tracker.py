"""Distributed XGBoost over its own collective (Rabit), started by invoke run on every rank.

    # once: python_env_extra_packages: [xgboost-cpu==3.2.0] in the inventory's cluster vars, then
    invoke provision --tags python
    invoke run -- python -m training.examples.xgboost_tracker

XGBoost brings its own rendezvous: one tracker that every worker connects to. invoke run gives each
rank where to meet (DMLC_TRACKER_URI and DMLC_TRACKER_PORT: the launcher's address on the cluster
link and a port free there), its task id (DMLC_TASK_ID: its rank) and the number of workers
(DMLC_NUM_WORKER). Rank 0 runs on the launcher, so it starts the tracker there; every rank then
joins the collective and trains on its own shard of the rows (every world-size-th one), and
XGBoost's histogram method sums the ranks' gradient statistics at each split, so every rank ends
with the same model.

Rank 0 prints a JSON summary: the accuracy on held-out rows beside that of one process trained on
all the training rows, and whether every rank's model is the same (a digest of each, compared over
the collective). The exit status is non-zero when the models differ or the accuracy falls short of
one process's by more than --tolerance.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import warnings
from collections.abc import Sequence

import numpy as np
import xgboost as xgb
from xgboost import collective
from xgboost.tracker import RabitTracker

SEED = 7
FEATURES = 8
PARAMS = {"objective": "binary:logistic", "tree_method": "hist", "max_depth": 4, "eta": 0.3,
          "eval_metric": "error", "nthread": 1, "seed": SEED}


def dataset(rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The same rows on every rank, from a fixed seed: a label that no single feature separates."""
    rng = np.random.default_rng(SEED)
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
    noise = 0.3 * rng.normal(size=rows)
    score = x[:, 0] * x[:, 1] + np.sin(2 * x[:, 2]) + 0.5 * x[:, 3] ** 2 - x[:, 4] + noise
    return x, (score > np.median(score)).astype(np.float32)


def accuracy(booster: xgb.Booster, x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean((booster.predict(xgb.DMatrix(x)) > 0.5) == (y > 0.5)))


def digest(booster: xgb.Booster) -> str:
    return hashlib.sha256(bytes(booster.save_raw("ubj"))).hexdigest()


# A rank that starts before rank 0's tracker listens retries, and XGBoost warns at each try: expected
# here (a rank that never gets through still fails, with XGBoost's error).
warnings.filterwarnings("ignore", message=r".*(Failed to connect to|Retrying connection)",
                        category=UserWarning)


def collective_args(rank: int) -> dict[str, str | int]:
    """Where to meet, from invoke run's environment (docs/any-job.md)."""
    try:
        return {"dmlc_communicator": "rabit", "dmlc_tracker_uri": os.environ["DMLC_TRACKER_URI"],
                "dmlc_tracker_port": int(os.environ["DMLC_TRACKER_PORT"]), "dmlc_task_id": str(rank),
                # Ranks may start before rank 0's tracker listens: keep trying for a while.
                "dmlc_retry": 30, "dmlc_timeout": 300}
    except KeyError as missing:
        raise SystemExit(f"error: {missing} is not set: start this with invoke run, which sets "
                         "the tracker's address and port on every rank") from None


def train_together(rank: int, size: int, rounds: int, x: np.ndarray, y: np.ndarray,
                   ) -> tuple[xgb.Booster, bool]:
    """Train on this rank's shard inside the collective; the model, and whether every rank's is
    this one (rank 0's digest broadcast, each rank's verdict summed)."""
    with collective.CommunicatorContext(**collective_args(rank)):
        if collective.get_world_size() != size:
            raise SystemExit(f"error: the collective has {collective.get_world_size()} workers, "
                             f"not the {size} ranks launched")
        booster = xgb.train(PARAMS, xgb.DMatrix(x[rank::size], y[rank::size]), rounds)
        mine = digest(booster)
        same = collective.broadcast(mine, 0) == mine
        differing = collective.allreduce(np.array([0 if same else 1], dtype=np.int32), collective.Op.SUM)
    return booster, int(differing[0]) == 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.examples.xgboost_tracker",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=6000, help="rows in all (6000; a quarter held out)")
    parser.add_argument("--rounds", type=int, default=40, help="boosting rounds (40)")
    parser.add_argument("--tolerance", type=float, default=0.02,
                        help="how far the accuracy may fall below one process's (0.02)")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    size = int(os.environ.get("DMLC_NUM_WORKER") or os.environ.get("WORLD_SIZE") or "1")
    x, y = dataset(args.rows)
    held_out = args.rows // 4
    x_train, y_train, x_test, y_test = x[held_out:], y[held_out:], x[:held_out], y[:held_out]

    tracker = None
    if rank == 0:
        tracker = RabitTracker(n_workers=size, host_ip=os.environ.get("DMLC_TRACKER_URI"),
                               port=int(os.environ.get("DMLC_TRACKER_PORT", "0")), sortby="task")
        tracker.start()
    booster, same = train_together(rank, size, args.rounds, x_train, y_train)
    if tracker is not None:
        tracker.wait_for()
    if rank != 0:
        return 0 if same else 1

    alone = xgb.train(PARAMS, xgb.DMatrix(x_train, y_train), args.rounds)
    result = {"world_size": size, "rows_per_rank": len(x_train[rank::size]), "rounds": args.rounds,
              "accuracy": round(accuracy(booster, x_test, y_test), 4),
              "accuracy_one_process": round(accuracy(alone, x_test, y_test), 4),
              "same_model_on_every_rank": same, "xgboost": xgb.__version__}
    print(json.dumps(result), flush=True)
    close_enough = result["accuracy"] >= result["accuracy_one_process"] - args.tolerance
    return 0 if same and close_enough else 1


if __name__ == "__main__":
    sys.exit(main())
