"""The link benchmark every rank runs: node-pair latency and bandwidth, and all-reduce bandwidth.

    invoke bench.links     (launches it on one rank per node, with mpirun and with mlx-cluster-launch ring)

Everything goes through MLX (`mx.distributed.send` / `recv` / `all_sum` on the CPU stream), so
the figures are what training sees, on the backend it was launched with:
- for every ordered pair of ranks i -> j: latency (half the median round trip of a tiny message
  bounced between them) and bandwidth (a large message i -> j, timed until j's tiny acknowledgement
  is back; the median of a few). MLX's ring backend only sends to a rank's two ring neighbours, so
  under ring only those pairs are measured (with 2 or 3 ranks that is every pair);
- `all_sum` over every rank for each size from --min-size to --max-size (x4 each step): the
  median time of a call, the algorithm bandwidth (bytes / time) and the bus bandwidth
  (2 (n - 1) / n * bytes / time, what each link carries; comparable across world sizes).

Rank 0 prints one JSON document on stdout, on a line that starts with MARKER; progress and errors
go to stderr. Only two ranks are busy during a pair's measurement; the others wait at a barrier.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import mlx.core as mx

MARKER = "LINK_BENCH_JSON "
MIB = 1 << 20
HOSTNAME_BYTES = 64
# A float32 pair: the tiny message of latency ping-pongs and of acknowledgements.
TINY_ELEMENTS = 2


class BenchError(RuntimeError):
    """The ranks cannot be benchmarked as launched; the message says why."""


def message_sizes(min_bytes: int, max_bytes: int, factor: int = 4) -> list[int]:
    """Message sizes from min_bytes, times factor each step, up to max_bytes (included)."""
    if min_bytes < 4 or max_bytes < min_bytes:
        raise BenchError(f"sizes must satisfy 4 <= min ({min_bytes}) <= max ({max_bytes}) bytes")
    sizes = []
    size = min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def all_reduce_iterations(nbytes: int) -> int:
    """Timed calls per size: many for small messages (noise), a few for large ones (time, memory)."""
    return max(3, min(30, (64 * MIB) // nbytes))


def bus_bandwidth(nbytes: int, seconds: float, world_size: int) -> float:
    """Bytes per second each rank's link carries in an all-reduce (the nccl-tests convention)."""
    return 2 * (world_size - 1) / world_size * nbytes / seconds


def pairs_to_measure(world_size: int, backend: str) -> list[tuple[int, int]]:
    """Ordered (src, dst) rank pairs: all of them, or under ring only ring neighbours."""
    pairs = [(i, j) for i in range(world_size) for j in range(world_size) if i != j]
    if backend in ("ring", "jaccl-ring"):
        # MLX 0.32's ring backends refuse send/recv to a rank that is not a direct neighbour.
        pairs = [(i, j) for i, j in pairs if (j - i) % world_size in (1, world_size - 1)]
    return pairs


def detect_backend(environ: Mapping[str, str]) -> str:
    """The backend of the launcher that started this process (mpirun, or mlx-cluster-launch (or
    mlx.launch) with ring or JACCL, whose ranks get a coordinator and, in a ring, MLX_JACCL_RING)."""
    if "OMPI_COMM_WORLD_SIZE" in environ:
        return "mpi"
    if "MLX_JACCL_COORDINATOR" in environ:
        return "jaccl-ring" if "MLX_JACCL_RING" in environ else "jaccl"
    if "MLX_RANK" in environ:
        return "ring"
    raise BenchError("not started by mpirun or mlx-cluster-launch (or mlx.launch): run it through "
                     "invoke bench.links")


def init_group(backend: str, expected: int | None) -> mx.distributed.Group:
    # strict: a node whose MLX cannot load MPI must fail, not benchmark alone as a group of one.
    # jaccl-ring is MLX's jaccl backend told to prefer a ring (MLX_JACCL_RING).
    group = mx.distributed.init(strict=True, backend="jaccl" if backend == "jaccl-ring" else backend)
    if expected is not None and group.size() != expected:
        raise BenchError(f"MLX joined {group.size()} ranks but {expected} were launched (one per "
                         "node): is libmpi loadable on every node? (invoke doctor checks it)")
    if group.size() < 2:
        raise BenchError("a link benchmark needs at least 2 ranks (nodes)")
    return group


def barrier(group: mx.distributed.Group) -> None:
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))


def hostnames(group: mx.distributed.Group) -> list[str]:
    """Every rank's host name, in rank order (to prove there is one rank per node)."""
    raw = socket.gethostname().encode()[:HOSTNAME_BYTES].ljust(HOSTNAME_BYTES, b"\0")
    mine = mx.array(list(raw), dtype=mx.int32)[None]
    gathered = mx.distributed.all_gather(mine, group=group, stream=mx.cpu)
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in gathered.tolist()]


def check_one_rank_per_node(names: Sequence[str]) -> None:
    seen: dict[str, int] = {}
    for rank, name in enumerate(names):
        if name in seen:
            raise BenchError(f"ranks {seen[name]} and {rank} both run on {name}: the benchmark "
                             "needs one rank per node (mpirun --map-by node, one hosts.json entry "
                             "per node)")
        seen[name] = rank


def round_trips(group: mx.distributed.Group, src: int, dst: int, elements: int, repeats: int,
                clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """src sends `elements` float32 to dst and waits for a tiny reply, `repeats` times: the
    seconds of each round trip as src measured them ([] on every other rank)."""
    rank = group.rank()
    seconds: list[float] = []
    if rank not in (src, dst):
        return seconds
    shape = (elements,)
    reply = mx.zeros((TINY_ELEMENTS,), dtype=mx.float32)
    # Only src holds the message; dst receives into a fresh buffer each time, freed at once.
    payload = mx.ones(shape, dtype=mx.float32) if rank == src else None
    mx.eval(reply, *([payload] if payload is not None else []))
    for _ in range(repeats):
        if payload is not None:
            start = clock()
            mx.eval(mx.distributed.send(payload, dst, group=group, stream=mx.cpu))
            mx.eval(mx.distributed.recv(reply.shape, reply.dtype, dst, group=group, stream=mx.cpu))
            seconds.append(clock() - start)
        else:
            mx.eval(mx.distributed.recv(shape, mx.float32, src, group=group, stream=mx.cpu))
            mx.eval(mx.distributed.send(reply, src, group=group, stream=mx.cpu))
    return seconds


def measure_pair(group: mx.distributed.Group, src: int, dst: int, *, pair_bytes: int,
                 latency_iters: int, bandwidth_repeats: int, warmup: int = 3) -> dict[str, Any] | None:
    """Latency and bandwidth src -> dst; the figures on src, None elsewhere."""
    round_trips(group, src, dst, TINY_ELEMENTS, warmup)  # connections set up, code paths warm
    latency = round_trips(group, src, dst, TINY_ELEMENTS, latency_iters)
    round_trips(group, src, dst, pair_bytes // 4, 1)
    transfer = round_trips(group, src, dst, pair_bytes // 4, bandwidth_repeats)
    if group.rank() != src:
        return None
    return {"latency_us": statistics.median(latency) / 2 * 1e6,
            "bandwidth_gb_per_s": pair_bytes / statistics.median(transfer) / 1e9}


def measure_all_reduce(group: mx.distributed.Group, nbytes: int,
                       clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """all_sum of nbytes of float32 over every rank: median seconds of a call, and bandwidths."""
    x = mx.ones((nbytes // 4,), dtype=mx.float32)
    mx.eval(x)
    iterations = all_reduce_iterations(nbytes)
    barrier(group)
    mx.eval(mx.distributed.all_sum(x, group=group, stream=mx.cpu))  # warm up
    seconds = []
    for _ in range(iterations):
        start = clock()
        mx.eval(mx.distributed.all_sum(x, group=group, stream=mx.cpu))
        seconds.append(clock() - start)
    del x
    mx.clear_cache()  # give the large buffers back before the next size
    median = statistics.median(seconds)
    return {"bytes": nbytes, "iterations": iterations, "time_us": round(median * 1e6, 2),
            "algbw_gb_per_s": round(nbytes / median / 1e9, 4),
            "busbw_gb_per_s": round(bus_bandwidth(nbytes, median, group.size()) / 1e9, 4)}


def run(group: mx.distributed.Group, backend: str, args: argparse.Namespace) -> dict[str, Any]:
    names = hostnames(group)
    if not args.allow_shared_hosts:
        check_one_rank_per_node(names)
    rank, size = group.rank(), group.size()
    result: dict[str, Any] = {
        "backend": backend, "world_size": size, "hostnames": names, "mlx": mx.__version__,
        "settings": {"pair_bytes": args.pair_bytes, "latency_iters": args.latency_iters,
                     "bandwidth_repeats": args.bandwidth_repeats, "min_bytes": args.min_size,
                     "max_bytes": args.max_size},
        "pairs": [], "all_reduce": []}
    if args.pairs:
        pairs = pairs_to_measure(size, backend)
        if skipped := size * (size - 1) - len(pairs):
            result["pairs_note"] = (f"{skipped} pairs not measured: the {backend} backend only "
                                    "sends between ring neighbours")
        # [src, dst] -> (latency us, GB/s), filled on src: one sum at the end brings all to rank 0.
        figures = [[[0.0, 0.0] for _ in range(size)] for _ in range(size)]
        for src, dst in pairs:
            barrier(group)
            pair = measure_pair(group, src, dst, pair_bytes=args.pair_bytes,
                                latency_iters=args.latency_iters,
                                bandwidth_repeats=args.bandwidth_repeats)
            if pair is not None:
                figures[src][dst] = [pair["latency_us"], pair["bandwidth_gb_per_s"]]
                print(f"[{backend}] {names[src]} -> {names[dst]}: {pair['latency_us']:.1f} us, "
                      f"{pair['bandwidth_gb_per_s']:.3f} GB/s", file=sys.stderr, flush=True)
        table = mx.distributed.all_sum(mx.array(figures, dtype=mx.float32), group=group,
                                       stream=mx.cpu).tolist()
        result["pairs"] = [{"src": src, "dst": dst, "latency_us": round(table[src][dst][0], 2),
                            "bandwidth_gb_per_s": round(table[src][dst][1], 4)}
                           for src, dst in pairs]
    for nbytes in message_sizes(args.min_size, args.max_size):
        reduce = measure_all_reduce(group, nbytes)
        result["all_reduce"].append(reduce)
        if rank == 0:
            print(f"[{backend}] all_sum of {nbytes} bytes: {reduce['time_us']:.1f} us, "
                  f"bus {reduce['busbw_gb_per_s']:.3f} GB/s", file=sys.stderr, flush=True)
    return result


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m training.tools.link_bench",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--min-size", type=int, default=4096, help="smallest all-reduce, bytes")
    parser.add_argument("--max-size", type=int, default=256 * MIB, help="largest all-reduce, bytes")
    parser.add_argument("--pair-bytes", type=int, default=64 * MIB,
                        help="message of the pair bandwidth test, bytes (64 MiB)")
    parser.add_argument("--latency-iters", type=int, default=50, help="ping-pongs per pair (50)")
    parser.add_argument("--bandwidth-repeats", type=int, default=5,
                        help="large messages per pair (5)")
    parser.add_argument("--pairs", action=argparse.BooleanOptionalAction, default=True,
                        help="measure the node pairs (default) or only the all-reduce")
    parser.add_argument("--expected-world-size", type=int, default=None,
                        help="fail unless MLX joins exactly this many ranks")
    parser.add_argument("--allow-shared-hosts", action="store_true",
                        help="allow several ranks on one host (trying it out on one machine)")
    parser.add_argument("--tag", default="", help="ignored: lets the launcher find its processes")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    group = None
    try:
        backend = detect_backend(os.environ)
        group = init_group(backend, args.expected_world_size)
        result = run(group, backend, args)
    except (BenchError, RuntimeError) as error:
        rank = group.rank() if group is not None else os.environ.get(
            "OMPI_COMM_WORLD_RANK", os.environ.get("MLX_RANK", "?"))
        print(f"rank {rank}: error: {error}", file=sys.stderr, flush=True)
        return 1
    if group.rank() == 0:
        print(MARKER + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
