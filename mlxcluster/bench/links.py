"""`invoke bench.links`: how fast the cluster link is, node pair by node pair and for all-reduce.

training/tools/link_bench.py runs on every node (one rank per node) and measures, launched by the one
builder (mlxcluster/launch/builder.py); this module reads what rank 0 printed, flags slow and asymmetric
links, and renders the table and the PNG. All plain functions of their inputs but `run` and
`measure`, so the unit tests drive them directly.

One rank per node, whatever a node's slots: the benchmark measures links, and ranks that share
a node talk through its memory, not over the cable. mpirun gets one rank per node with
`-np <nodes> --map-by node`; mlx-cluster-launch gets a hosts file with one entry per node.
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcluster.bench import results
from mlxcluster.describe.cluster import Cluster, Recorded
from mlxcluster.errors import Interrupted, UserError
from mlxcluster.launch import builder, relay, sync

# What training/tools/link_bench.py prefixes its JSON line with (a unit test keeps the two equal).
MARKER = "LINK_BENCH_JSON "
BACKENDS = ("mpi", "ring", "jaccl", "jaccl-ring")
# A pair is slow when its bandwidth is below this fraction of the median pair's (same backend),
# and asymmetric when one direction is this much slower than the other.
SLOW_FRACTION = 0.5
ASYMMETRY = 0.25
# The pair bandwidth message: large enough that latency does not count, capped by --max-size.
PAIR_BYTES = 64 << 20
HOSTS_FILE = "link-bench-hosts.json"  # the one-rank-per-node hosts.json, in the work directory


class LinkBenchError(UserError):
    """Bad options or a cluster the benchmark cannot run on; the message says what to do."""


# --- options ---------------------------------------------------------------------------------------

_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Bytes from 4096, 4K, 4KB, 4KiB, 256M, 1G (binary units, as message sizes are powers of 2)."""
    match = _SIZE.match(str(text))
    if not match:
        raise LinkBenchError(f"--max-size {text!r}: give bytes or a size like 4MB, 256MB, 1GB")
    value = int(match[1]) << {"": 0, "k": 10, "m": 20, "g": 30}[match[2].lower()]
    if value < 4096:
        raise LinkBenchError(f"--max-size {text!r}: the smallest all-reduce is 4 KB")
    return value


def parse_backends(text: str | None, cluster: Cluster) -> list[str]:
    """The backends to measure: those named, else on a bridge MPI and ring, and over per-cable
    networks the one training uses there (`--backend auto`: ring or JACCL)."""
    if not text:
        return [builder.backend_for(cluster, None)] if cluster.cables else ["mpi", "ring"]
    chosen = [b.strip() for b in text.split(",") if b.strip()]
    unknown = [b for b in chosen if b not in BACKENDS]
    if unknown or not chosen:
        raise LinkBenchError(f"--backends {text!r}: choose from {', '.join(BACKENDS)} "
                             "(comma-separated, e.g. mpi,ring)")
    for backend in chosen:
        builder.choice_for(cluster, backend)  # refused on this cluster: say why before measuring
    return list(dict.fromkeys(chosen))


def format_bytes(n: int) -> str:
    for unit, shift in (("GB", 30), ("MB", 20), ("KB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


# --- launching and measuring ----------------------------------------------------------------------


def one_rank_per_node(cluster: Cluster) -> Cluster:
    """The cluster with one slot on each node that trains (the others stay out)."""
    layout = cluster.one_rank_per_node()
    if len(layout.training_nodes) < 2:
        raise LinkBenchError(f"a link benchmark needs at least 2 nodes with mpi_slots > 0; this "
                             f"inventory has {len(layout.training_nodes)}")
    if cluster.head.slots < 1:
        raise LinkBenchError(f"the launcher {cluster.head.name} has mpi_slots: 0, but rank 0 runs "
                             "there: give it a slot")
    return layout


def program(layout: Cluster, *, max_bytes: int, tag: str) -> list[str]:
    return ["python", "-m", "training.tools.link_bench", "--max-size", str(max_bytes),
            "--pair-bytes", str(min(PAIR_BYTES, max_bytes)),
            "--expected-world-size", str(layout.world_size), "--tag", tag]


def job(layout: Cluster, backend: str, *, max_bytes: int, tag: str,
        envs: Sequence[str] = ()) -> builder.Job:
    """The benchmark launched as invoke train launches (env.sh, the cluster link pinned), with
    one rank per node: mpirun maps by node, mlx-cluster-launch gets a hosts file with one entry each."""
    return builder.Job(program(layout, max_bytes=max_bytes, tag=tag), backend=backend,
                      map_by_node=backend == "mpi",
                      ring_hosts_file=HOSTS_FILE if backend == "ring" else None, mlx_envs=envs)


def extract(stdout: str) -> dict[str, Any] | None:
    """The JSON document rank 0 printed, from among whatever else reached stdout."""
    for line in reversed(stdout.splitlines()):
        if MARKER in line:
            try:
                return json.loads(line.split(MARKER, 1)[1])
            except ValueError:
                return None
    return None


def measure(rec: Recorded, layout: Cluster, backend: str, *, max_bytes: int, tag: str,
            timeout: float) -> dict[str, Any]:
    """One backend's document: the benchmark on every node, its output shown as it comes but
    for rank 0's result line. A failed, interrupted or timed-out run is stopped on every node."""
    print(f"==> {backend}: pairs and all_sum up to {format_bytes(max_bytes)} on "
          f"{layout.world_size} nodes, one rank each", flush=True)
    cmd = builder.command(layout, job(layout, backend, max_bytes=max_bytes, tag=tag,
                                     envs=rec.mlx_envs))
    try:
        relayed = relay.supervise(layout, cmd, f"--tag {tag}", timeout=timeout, hide=MARKER,
                                  stdin=subprocess.DEVNULL)
    except KeyboardInterrupt:
        raise Interrupted("interrupted: the benchmark was stopped on every node") from None
    doc = extract("\n".join(relayed.held_back))
    if relayed.code != 0 or doc is None:  # a rank may fail after rank 0 printed
        raise LinkBenchError(builder.failure_report(layout, backend, relayed.code, relayed.output,
                                                   rec.inventory), code=relayed.code or 1)
    return doc


def run(rec: Recorded, *, backends: str | None = None, max_size: str | int = "256MB",
        output: str | None = None, timeout: float = 900) -> Path:
    """invoke bench.links: measure with each backend, then the tables, the JSON and the PNG."""
    from rich.console import Console

    max_bytes = parse_size(max_size)
    layout = one_rank_per_node(rec.cluster)
    chosen = parse_backends(backends, layout)
    sync.run_steps(sync.push_code(layout))
    when = results.stamp()
    docs = {backend: measure(rec, layout, backend, max_bytes=max_bytes, tag=f"links-{when}",
                             timeout=float(timeout)) for backend in chosen}
    result = assemble(layout, docs, inventory=rec.inventory, max_bytes=max_bytes, date=results.date())
    out = results.write("links", result, output, when)
    png = plot(result, out.with_suffix(".png"))
    render(result, Console())
    print(f"wrote {out} and {png}")
    return out


# --- judging ---------------------------------------------------------------------------------------


def flag_pairs(pairs: Sequence[Mapping[str, Any]], names: Sequence[str]) -> list[dict[str, Any]]:
    """Slow pairs (bandwidth < SLOW_FRACTION x the median pair's) and asymmetric ones (one
    direction more than ASYMMETRY slower than the other), with what to look at."""
    if not pairs:
        return []
    median = statistics.median(p["bandwidth_gb_per_s"] for p in pairs)
    by_pair = {(p["src"], p["dst"]): p for p in pairs}
    flags = []
    for p in pairs:
        src, dst, bw = p["src"], p["dst"], p["bandwidth_gb_per_s"]
        where = {"src": src, "dst": dst, "from": names[src], "to": names[dst]}
        if bw < SLOW_FRACTION * median:
            flags.append({**where, "kind": "slow",
                          "detail": f"{bw:.3g} GB/s, {bw / median:.2f}x the median pair's "
                                    f"{median:.3g} GB/s"})
        back = by_pair.get((dst, src))
        if back and max(bw, back["bandwidth_gb_per_s"]) > 0 and \
                1 - min(bw, back["bandwidth_gb_per_s"]) / max(bw, back["bandwidth_gb_per_s"]) > ASYMMETRY:
            flags.append({**where, "kind": "asymmetric",
                          "detail": f"{bw:.3g} GB/s, but {back['bandwidth_gb_per_s']:.3g} GB/s back"})
    return flags


def assemble(layout: Cluster, docs: Mapping[str, Mapping[str, Any]], *, inventory: str,
             date: str, max_bytes: int) -> dict[str, Any]:
    """One result from each backend's document: node names by rank, flags per backend."""
    names = [n.name for n in layout.training_nodes]
    for backend, doc in docs.items():
        if doc["world_size"] != len(names):
            raise LinkBenchError(f"the {backend} run joined {doc['world_size']} ranks, not one per "
                                 f"node ({len(names)}): run invoke doctor")
    cables = cables_between(layout)
    flags = [{"backend": backend, **flag, **({"cable": cables[flag["src"], flag["dst"]]}
                                             if (flag["src"], flag["dst"]) in cables else {})}
             for backend, doc in docs.items() for flag in flag_pairs(doc["pairs"], names)]
    return {"benchmark": "links", "date": date, "inventory": inventory, "nodes": names,
            "max_bytes": max_bytes, "slow_fraction": SLOW_FRACTION, "asymmetry": ASYMMETRY,
            "backends": dict(docs), "flags": flags,
            "cables": [{"src": src, "dst": dst, "cable": label}
                       for (src, dst), label in sorted(cables.items())]}


def cables_between(layout: Cluster) -> dict[tuple[int, int], str]:
    """Per-cable networks: the cable joining each ordered pair of ranks ("node1:en2 <-> node2:en2";
    with several between two nodes, the first: the one the ring backend uses)."""
    rank = {n.name: i for i, n in enumerate(layout.training_nodes)}
    joined: dict[tuple[int, int], str] = {}
    for cable in layout.links():
        a, b = (end.host for end in cable.ends)
        if a in rank and b in rank:
            joined.setdefault((rank[a], rank[b]), str(cable))
            joined.setdefault((rank[b], rank[a]), str(cable))
    return joined


@dataclass(frozen=True)
class PairRow:
    src: str
    dst: str
    # backend -> (latency in us, bandwidth in GB/s); absent: not measured on that backend
    figures: Mapping[str, tuple[float, float]]
    flags: tuple[str, ...]
    cable: str | None = None  # per-cable networks: the cable between them


def pair_rows(result: Mapping[str, Any]) -> list[PairRow]:
    """One row per ordered node pair measured on any backend, in rank order."""
    names = result["nodes"]
    measured: dict[tuple[int, int], dict[str, tuple[float, float]]] = {}
    for backend, doc in result["backends"].items():
        for p in doc["pairs"]:
            measured.setdefault((p["src"], p["dst"]), {})[backend] = (
                p["latency_us"], p["bandwidth_gb_per_s"])
    cables = {(c["src"], c["dst"]): c["cable"] for c in result.get("cables", [])}
    rows = []
    for (src, dst), figures in sorted(measured.items()):
        flags = tuple(f"{f['kind']} ({f['backend']})" for f in result["flags"]
                      if (f["src"], f["dst"]) == (src, dst))
        rows.append(PairRow(names[src], names[dst], figures, flags, cables.get((src, dst))))
    return rows


def all_reduce_rows(result: Mapping[str, Any]) -> list[tuple[int, dict[str, Mapping[str, Any]]]]:
    """(bytes, backend -> that size's figures), by size."""
    sizes: dict[int, dict[str, Mapping[str, Any]]] = {}
    for backend, doc in result["backends"].items():
        for entry in doc["all_reduce"]:
            sizes.setdefault(entry["bytes"], {})[backend] = entry
    return sorted(sizes.items())


# --- showing ---------------------------------------------------------------------------------------


def render(result: Mapping[str, Any], console: Any) -> None:
    """The node pairs table, the all-reduce table, and the flagged links."""
    from rich.table import Table

    backends = list(result["backends"])
    pairs = Table(title="node pairs over the cluster link: latency in us (half a round trip), "
                        f"bandwidth in GB/s ({format_bytes(_pair_bytes(result))} messages)",
                  title_justify="left")
    pairs.add_column("from -> to", no_wrap=True)
    with_cables = bool(result.get("cables"))
    if with_cables:
        pairs.add_column("cable", no_wrap=True)
    for backend in backends:
        pairs.add_column(f"{backend} us", justify="right")
        pairs.add_column(f"{backend} GB/s", justify="right")
    pairs.add_column("flags")
    for row in pair_rows(result):
        cells = []
        for backend in backends:
            latency, bandwidth = row.figures.get(backend, (None, None))
            cells += ["-" if latency is None else f"{latency:.1f}",
                      "-" if bandwidth is None else f"{bandwidth:.3f}"]
        flag = "[bold red]" + ", ".join(row.flags) + "[/]" if row.flags else "[green]ok[/]"
        pairs.add_row(f"{row.src} -> {row.dst}", *([row.cable or "-"] if with_cables else []), *cells, flag)
    console.print(pairs)
    for backend, doc in result["backends"].items():
        if note := doc.get("pairs_note"):
            console.print(f"{backend}: {note}")

    n = len(result["nodes"])
    reduce = Table(title=f"all_sum over {n} ranks, one per node (bus bandwidth: "
                         f"2({n}-1)/{n} x bytes / time)", title_justify="left")
    reduce.add_column("size", justify="right", no_wrap=True)
    for backend in backends:
        reduce.add_column(f"{backend} us", justify="right")
        reduce.add_column(f"{backend} bus GB/s", justify="right")
    for nbytes, by_backend in all_reduce_rows(result):
        cells = []
        for backend in backends:
            entry = by_backend.get(backend)
            cells += ["-", "-"] if entry is None else [f"{entry['time_us']:.1f}",
                                                       f"{entry['busbw_gb_per_s']:.3f}"]
        reduce.add_row(format_bytes(nbytes), *cells)
    console.print(reduce)
    if result["flags"]:
        console.print(f"[bold red]{len(result['flags'])} flag(s)[/]: slow = below {SLOW_FRACTION}x "
                      f"the median pair's bandwidth, asymmetric = the two directions differ by more "
                      f"than {ASYMMETRY:.0%}. Check the cable, the ports and both ends' interface "
                      "(invoke doctor); a node busy with something else looks slow too: re-run.")
        for f in result["flags"]:
            over = f" (cable {f['cable']})" if f.get("cable") else ""
            console.print(f"  {f['from']} -> {f['to']}{over} {f['kind']} on {f['backend']}: {f['detail']}")
    else:
        console.print("[green]no slow or asymmetric link[/]")


def _pair_bytes(result: Mapping[str, Any]) -> int:
    return next((doc["settings"]["pair_bytes"] for doc in result["backends"].values()), PAIR_BYTES)


def pair_matrix(doc: Mapping[str, Any], key: str, n: int) -> list[list[float]]:
    """n x n values of one pair figure (row: from, column: to); NaN where not measured."""
    matrix = [[float("nan")] * n for _ in range(n)]
    for p in doc["pairs"]:
        matrix[p["src"]][p["dst"]] = p[key]
    return matrix


def plot(result: Mapping[str, Any], path: Path) -> Path:
    """PNG: per backend with pairs, heat maps of pair bandwidth and latency (flagged cells
    outlined in red); beside them all-reduce bus bandwidth against size, one curve per backend."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    names = result["nodes"]
    n = len(names)
    with_pairs = [b for b, doc in result["backends"].items() if doc["pairs"]]
    rows = max(1, len(with_pairs))
    figure = Figure(figsize=(16, 4.8 * rows), layout="constrained")
    grid = figure.add_gridspec(rows, 3)
    for row, backend in enumerate(with_pairs):
        doc = result["backends"][backend]
        flagged = {(f["src"], f["dst"]) for f in result["flags"] if f["backend"] == backend}
        for col, (key, label, cmap, fmt) in enumerate((
                ("bandwidth_gb_per_s", "bandwidth (GB/s)", "viridis", "{:.2f}"),
                ("latency_us", "latency (us)", "viridis_r", "{:.0f}"))):
            ax = figure.add_subplot(grid[row, col])
            matrix = pair_matrix(doc, key, n)
            image = ax.imshow(matrix, cmap=cmap)
            figure.colorbar(image, ax=ax, shrink=0.8)
            ax.set_xticks(range(n), names, rotation=45, ha="right")
            ax.set_yticks(range(n), names)
            ax.set_xlabel("to")
            ax.set_ylabel("from")
            ax.set_title(f"{backend}: pair {label}" + (", red: flagged" if col == 0 else ""))
            for i in range(n):
                for j in range(n):
                    if matrix[i][j] == matrix[i][j]:  # not NaN
                        ax.text(j, i, fmt.format(matrix[i][j]), ha="center", va="center",
                                color="white", fontsize=9,
                                bbox={"facecolor": "black", "alpha": 0.35, "linewidth": 0})
                    if col == 0 and (i, j) in flagged:
                        ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False,
                                               edgecolor="red", linewidth=3))
    curve = figure.add_subplot(grid[:, 2] if with_pairs else grid[0, :])
    for backend, doc in result["backends"].items():
        entries = doc["all_reduce"]
        curve.plot([e["bytes"] for e in entries], [e["busbw_gb_per_s"] for e in entries],
                   marker="o", label=backend)
    sizes = sorted({e["bytes"] for doc in result["backends"].values() for e in doc["all_reduce"]})
    curve.set_xscale("log", base=2)
    curve.set_yscale("log")  # small messages are latency-bound: orders of magnitude below
    if sizes:
        curve.set_xticks(sizes, [format_bytes(s) for s in sizes], rotation=45, ha="right")
    curve.set_xlabel("all_sum size")
    curve.set_ylabel("bus bandwidth (GB/s)")
    curve.set_title(f"all_sum over {n} ranks (one per node)")
    curve.minorticks_off()
    curve.grid(True, alpha=0.3)
    curve.legend()
    figure.suptitle(f"cluster links: {', '.join(names)} ({result['date']})")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path
