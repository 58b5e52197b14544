"""Point-to-point between pipeline neighbours, checked value by value (`invoke doctor` runs it).

    python -m training.tools.send_recv [--micro-batch 2 --seq 16 --hidden 64]

MLX's send and recv have known faults that an all_sum does not show: back-to-back sends of
different shapes on a JACCL mesh deliver wrong data (mlx #3149), and a ring recv can fail in
multi-node pipelines (mlx #4276). A pipeline run (training/sharding/pipeline.py) sends exactly
that: a shape header, then each micro-batch's activations to the next stage, then their
gradients back. So every rank here does what a stage does, in the same order, one send or recv
evaluated at a time on the CPU stream: rank r receives from r - 1 and sends to r + 1 (forward),
then receives from r + 1 and sends to r - 1 (backward). Traffic goes one way at a time, as in
the pipeline, so no two neighbours send to each other at once.

Each tensor's values follow from its sender, direction and index (whole numbers below 126, exact
in every wire dtype), so the receiver checks every element. Every rank prints one JSON line
starting with MARKER: the pairs it received from and any mismatch. Node side: stdlib and mlx
only (the doctor sends this file's text with `python -c`, before any code is synced), so the
wire dtypes are written out here; a unit test keeps them equal to the pipeline's.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

MARKER = "SEND_RECV_JSON "
# training/sharding/pipeline.py's WIRE_DTYPES, in its order (the header's dtype index).
WIRE_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
DIRECTIONS = ("forward", "backward")
PERIOD = 251  # values run over -125..125: exact in float16 and bfloat16 too
Shapes = Sequence[tuple[tuple[int, ...], Any]]  # (shape, dtype) of each tensor, in the order sent


def tensors(micro: int, seq: int, hidden: int) -> list[tuple[tuple[int, ...], Any]]:
    """What one neighbour sends the other, in order, as a pipeline step does: the header
    (width, dtype index) as agree_on_wires sends it, a micro-batch's activations in each wire
    dtype, a last, shorter micro-batch, and a one-element tensor."""
    if min(micro, seq, hidden) < 1 or seq < 2:
        raise ValueError(f"--micro-batch, --seq and --hidden must be at least 1 (seq 2): "
                         f"got {micro}, {seq}, {hidden}")
    full = (micro, seq, hidden)
    return [((2,), mx.int32), *((full, dtype) for dtype in WIRE_DTYPES),
            ((1, seq - 1, hidden), mx.bfloat16), ((1,), mx.float32)]


def expected(sender: int, direction: int, index: int, shape: tuple[int, ...], dtype: Any) -> mx.array:
    """The values `sender` sends as tensor `index` going `direction`: known to both ends."""
    count = 1
    for size in shape:
        count *= size
    offset = sender * 31 + index * 13 + direction * 101
    values = (mx.arange(count, dtype=mx.int32) * 7 + offset) % PERIOD - PERIOD // 2
    return values.reshape(shape).astype(dtype)


def label(shape: tuple[int, ...], dtype: Any) -> str:
    return f"{str(dtype).removeprefix('mlx.core.')} {tuple(shape)}"


def compare(got: mx.array, want: mx.array) -> dict[str, Any] | None:
    """None when equal element for element; else how many differ and the first that does."""
    wrong = mx.not_equal(got.astype(mx.float32), want.astype(mx.float32)).reshape(-1)
    count = int(wrong.sum().item())
    if count == 0:
        return None
    at = int(mx.argmax(wrong).item())
    return {"wrong": count, "of": want.size, "first_at": at,
            "expected": float(want.reshape(-1)[at].item()), "got": float(got.reshape(-1)[at].item())}


def send_all(group: Any, to: int, direction: int, shapes: Shapes, corrupt: bool) -> None:
    """Every tensor to `to`, one evaluated send each, as the pipeline's _send. `corrupt` (tests
    only) changes one element of the second tensor, to show that a mismatch is named."""
    for index, (shape, dtype) in enumerate(shapes):
        value = expected(group.rank(), direction, index, shape, dtype)
        if corrupt and index == 1:
            value = value.reshape(-1).at[0].add(1).reshape(shape)
        mx.eval(mx.distributed.send(value, to, group=group, stream=mx.cpu))


def receive_all(group: Any, source: int, direction: int,
                shapes: Shapes) -> list[dict[str, Any]]:
    """Every tensor from `source`, one evaluated recv each, each checked; the mismatches."""
    found = []
    for index, (shape, dtype) in enumerate(shapes):
        got = mx.distributed.recv(shape, dtype, source, group=group, stream=mx.cpu)
        mx.eval(got)
        where = {"from": source, "to": group.rank(), "direction": DIRECTIONS[direction],
                 "tensor": index, "what": label(shape, dtype)}
        if got.shape != tuple(shape) or got.dtype != dtype:
            found.append({**where, "got_shape": label(got.shape, got.dtype)})
        elif difference := compare(got, expected(source, direction, index, shape, dtype)):
            found.append({**where, **difference})
    return found


def check(group: Any, shapes: Shapes, corrupt_rank: int | None) -> dict[str, Any]:
    """Forward then backward along the stages; what this rank received and found wrong."""
    rank, size = group.rank(), group.size()
    corrupt = corrupt_rank == rank
    checked: list[dict[str, Any]] = []
    mismatches: list[dict[str, Any]] = []
    # Forward: from the previous stage, then on to the next; backward: the mirror image.
    for direction, (source, to) in enumerate(((rank - 1, rank + 1), (rank + 1, rank - 1))):
        if 0 <= source < size:
            mismatches += receive_all(group, source, direction, shapes)
            checked.append({"from": source, "to": rank, "direction": DIRECTIONS[direction],
                            "tensors": len(shapes)})
        if 0 <= to < size:
            send_all(group, to, direction, shapes, corrupt)
    return {"rank": rank, "size": size, "host": socket.gethostname(), "checked": checked,
            "mismatches": mismatches}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--corrupt-rank", type=int, default=None,
                        help="tests only: this rank sends one wrong element")
    args = parser.parse_args(argv)
    try:
        shapes = tensors(args.micro_batch, args.seq, args.hidden)
    except ValueError as error:
        parser.error(str(error))
    group = mx.distributed.init(strict=True)
    try:
        result = check(group, shapes, args.corrupt_rank)
    except RuntimeError as error:  # MLX's own failure of a send or recv
        result = {"rank": group.rank(), "size": group.size(), "host": socket.gethostname(),
                  "checked": [], "mismatches": [], "error": str(error)[-300:]}
    print(MARKER + json.dumps(result), flush=True)
    # Every rank's line out before any exits: a launcher stops the others when one exits non-zero.
    if "error" not in result:
        mx.eval(mx.distributed.all_sum(mx.array(0), group=group, stream=mx.cpu))
    return 1 if result["mismatches"] or result.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
