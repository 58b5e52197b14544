"""The smallest data-parallel MLX program: logistic regression learning OR, from scratch.

    invoke run -- python -m training.examples.logistic_regression                  # mpirun, MPI
    invoke run --backend ring -- python -m training.examples.logistic_regression   # MLX's ring

Every rank builds the same data set, keeps its own shard (every world-size-th example), computes
the gradient of its shard's loss, and the ranks average their gradients with an all-reduce: each
step is then exactly a full-batch gradient step, whatever the number of ranks. Every rank must end
with identical weights and 100 % accuracy; rank 0 prints a JSON summary, and the exit status is
non-zero when either fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import mlx.core as mx

# Logical OR: the original tutorial's first model.
INPUTS = ((0.0, 0.0), (0.0, 1.0), (1.0, 0.0), (1.0, 1.0))
TARGETS = (0.0, 1.0, 1.0, 1.0)


def dataset(copies: int) -> tuple[mx.array, mx.array]:
    """OR's truth table repeated `copies` times: (examples x 2 inputs, examples targets)."""
    return mx.array(INPUTS * copies), mx.array(TARGETS * copies)


def shard(x: mx.array, y: mx.array, rank: int, size: int) -> tuple[mx.array, mx.array]:
    return x[rank::size], y[rank::size]


def loss_fn(params: dict[str, mx.array], x: mx.array, y: mx.array) -> mx.array:
    logits = x @ params["w"] + params["b"]
    # Summed, not averaged: dividing the all-reduced sum by the global count gives the exact
    # full-batch gradient even when the shards differ in size.
    return mx.sum(mx.logaddexp(0.0, logits) - y * logits)


def init_group() -> mx.distributed.Group:
    """The ranks mpirun (or mlx-cluster-launch, or mlx.launch) started; strict, so a missing MPI
    library is an error."""
    size = int(os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("MLX_WORLD_SIZE") or 1)
    if size > 1 or "MLX_RANK" in os.environ:
        return mx.distributed.init(strict=True)
    # One process talks to nobody: a group of one without MPI (MLX never finalizes MPI for a
    # group of one, and mpirun -np 1 would then report the run as failed).
    return mx.distributed.init(backend="ring")


def launcher() -> str:
    """What started this rank: a launcher of MLX's ring or JACCL (the cluster's mlx-cluster-launch,
    or mlx.launch) sets MLX_RANK, mpirun its own."""
    if "MLX_RANK" in os.environ:
        return "mlx"
    return "mpirun" if "OMPI_COMM_WORLD_SIZE" in os.environ else "none"


def train(group: mx.distributed.Group, steps: int, learning_rate: float,
          copies: int) -> dict[str, object]:
    x_all, y_all = dataset(copies)
    x, y = shard(x_all, y_all, group.rank(), group.size())
    params = {"w": mx.zeros((2,)), "b": mx.array(0.0)}
    grad_fn = mx.value_and_grad(loss_fn)
    total = x_all.shape[0]
    for _ in range(steps):
        loss, grads = grad_fn(params, x, y)
        # The one collective: sum every rank's gradient (and loss), then divide by the global count.
        grads = {k: mx.distributed.all_sum(g, group=group) / total for k, g in grads.items()}
        loss = mx.distributed.all_sum(loss, group=group) / total
        params = {k: params[k] - learning_rate * grads[k] for k in params}
        mx.eval(params, loss)
    predictions = (x_all @ params["w"] + params["b"]) > 0
    accuracy = mx.mean(predictions == (y_all > 0.5)).item()
    flat = mx.concatenate([params["w"], params["b"][None]])
    gathered = mx.distributed.all_gather(flat[None], group=group)
    return {
        "world_size": group.size(),
        "launcher": launcher(),
        "examples": total,
        "examples_on_rank_0": int(x.shape[0]) if group.rank() == 0 else None,
        "steps": steps,
        "final_loss": round(loss.item(), 6),
        "accuracy": accuracy,
        "weights": [round(v, 6) for v in flat.tolist()],
        "max_weight_difference_across_ranks": mx.max(mx.abs(gathered - gathered[:1])).item(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.examples.logistic_regression",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=500, help="gradient steps (500)")
    parser.add_argument("--learning-rate", type=float, default=1.0, help="step size (1.0)")
    parser.add_argument("--copies", type=int, default=8,
                        help="copies of the truth table in the data set (8: 32 examples)")
    args = parser.parse_args(argv)
    group = init_group()
    result = train(group, args.steps, args.learning_rate, args.copies)
    ok = result["accuracy"] == 1.0 and result["max_weight_difference_across_ranks"] == 0.0
    if group.rank() == 0:
        print(json.dumps(result), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
