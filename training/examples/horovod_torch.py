"""Horovod's PyTorch data parallelism over the nodes' Open MPI, started by invoke run.

    # once, on every node: torch and a Horovod built for it (docs/any-job.md#horovod: 0.28.1, the
    # last release, needs one line changed to build against PyTorch 2.1 or later)
    invoke run -- python -m training.examples.horovod_torch

Every rank fits the same line to its own shard of the points; Horovod's DistributedOptimizer
averages the gradients over the ranks at each step (an MPI all-reduce), so every rank ends with
the same weights. Rank 0 prints a JSON summary; the exit status is non-zero when the ranks'
weights differ or the fit misses the line.
"""

from __future__ import annotations

import json
import sys

import horovod
import horovod.torch as hvd
import torch

SLOPE, INTERCEPT = 3.0, -1.0


def main() -> int:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    x_all = torch.linspace(-1, 1, 64).unsqueeze(1)
    y_all = SLOPE * x_all + INTERCEPT
    x, y = x_all[rank::size], y_all[rank::size]
    model = torch.nn.Linear(1, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for _ in range(200):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = hvd.allgather(weights.unsqueeze(0), name="weights")
    difference = (gathered - gathered[:1]).abs().max().item()
    fitted = abs(weights[0].item() - SLOPE) < 1e-3 and abs(weights[1].item() - INTERCEPT) < 1e-3
    if rank == 0:
        print(json.dumps({"world_size": size, "horovod": horovod.__version__, "torch": torch.__version__,
                          "mpi": hvd.mpi_enabled(), "weights": [round(w, 5) for w in weights.tolist()],
                          "max_weight_difference_across_ranks": difference}), flush=True)
    return 0 if difference == 0.0 and fitted else 1


if __name__ == "__main__":
    sys.exit(main())
