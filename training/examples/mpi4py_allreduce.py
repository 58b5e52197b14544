"""An mpi4py program on every rank: the classic all-reduce, checked, and its time at a few sizes.

    # once: python_env_extra_packages: [mpi4py==4.1.2] in the inventory's cluster vars, then
    invoke provision --tags python
    invoke run -- python -m training.examples.mpi4py_allreduce

mpirun starts the ranks (invoke run's default launcher), and mpi4py talks to them through the
nodes' own Open MPI: its wheel loads the MPI library it finds (libmpi.so.40 on Linux, Homebrew's on
a Mac), so it needs no compiler. Every rank gives a vector filled with its rank + 1 and the
all-reduce sums them: each element must be n (n + 1) / 2. Rank 0 prints a JSON summary: the hosts,
the MPI library, the sum, and the time of an all-reduce at each size; the exit status is non-zero
when a sum is wrong.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

import numpy as np
from mpi4py import MPI


def allreduce_seconds(comm: MPI.Comm, elements: int, repeats: int) -> tuple[float, bool]:
    """The median time of an in-place sum of `elements` float32 over every rank, and whether the
    sum is right."""
    rank, size = comm.Get_rank(), comm.Get_size()
    expected = size * (size + 1) / 2
    times, right = [], True
    comm.Allreduce(MPI.IN_PLACE, np.zeros(elements, dtype=np.float32), op=MPI.SUM)  # connections made
    for _ in range(repeats):
        buffer = np.full(elements, rank + 1, dtype=np.float32)
        comm.Barrier()
        start = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
        times.append(time.perf_counter() - start)
        right = right and bool(np.all(buffer == expected))
    # Every rank must agree the sum is right: a wrong one anywhere fails the run.
    right = comm.allreduce(right, op=MPI.LAND)
    return float(np.median(times)), right


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.examples.mpi4py_allreduce",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1,1024,1048576",
                        help="float32 elements per all-reduce, comma-separated (1,1024,1048576)")
    parser.add_argument("--repeats", type=int, default=5, help="all-reduces per size (5)")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    hosts = comm.gather(MPI.Get_processor_name(), root=0)
    timed = {int(n): allreduce_seconds(comm, int(n), args.repeats) for n in args.sizes.split(",")}
    right = all(ok for _, ok in timed.values())
    if comm.Get_rank() == 0:
        print(json.dumps({
            "world_size": comm.Get_size(), "hosts": hosts,
            "mpi": MPI.Get_library_version().replace("\0", "").splitlines()[0].strip(),
            "sum_right": right,
            "allreduce_ms": {str(n): round(seconds * 1000, 3) for n, (seconds, _) in timed.items()},
        }), flush=True)
    return 0 if right else 1


if __name__ == "__main__":
    sys.exit(main())
