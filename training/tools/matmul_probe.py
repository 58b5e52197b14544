"""How fast this process multiplies matrices with MLX, in GFLOP/s: `python -m training.tools.matmul_probe`.

`invoke bench.train` runs it on one node alone and then on two nodes at once. When the two nodes
share a machine (the lab), the second figure shows what that machine's cores give to two
independent workers, which bounds what two ranks can gain over one there.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

import mlx.core as mx

# The shape of a LoRA fine-tune's largest matmuls on SmolLM2-135M: a batch of ~256 tokens
# through a 576 -> 1536 projection.
SHAPE = (256, 576, 1536)


def gflops(seconds: float, shape: tuple[int, int, int] = SHAPE) -> float:
    m, k, n = shape
    a = mx.random.normal((m, k))
    b = mx.random.normal((k, n))
    mx.eval(a @ b)  # warm up: load the BLAS and compile
    done = 0
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        mx.eval(a @ b)
        done += 1
    return 2 * m * k * n * done / elapsed / 1e9


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.tools.matmul_probe",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="how long to multiply (8)")
    args = parser.parse_args(argv)
    print(json.dumps({"gflops": round(gflops(args.seconds), 2)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
