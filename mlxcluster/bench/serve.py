"""`invoke bench.serve`: our server against stock `mlx_lm.server`, on one process and sharded.

Each configuration is a server started as `invoke serve` starts it (ours: the base with two LoRA
adapters; every request asks for the first, but those of one figure), or stock `mlx_lm.server`
launched on the same ranks by the same launcher (distributed, it shards the base itself and takes
no adapter), on the same model: one process on the launcher, then tensor-parallel across the first
2, 3 ... nodes. Against each, the same chat requests from this machine, with distinct prompts: time
to first token (the median of one-token requests, one at a time), output tokens per second of
streamed requests, 1 and 4 at once (all tokens over the wall time, prompts included), and each
rank's peak resident memory (its high-water mark on Linux, its resident size at the end on macOS),
read on its node before the server stops. Ours also answers 4 at once that alternate between its
two adapters (one batch mixing them: training/serve/mixed.py), beside 4 at once for one adapter.
In one process stock can take an adapter (`--adapter-path`; distributed it refuses one), so there
stock runs twice: without an adapter, as on the sharded layouts, and with ours's first adapter
("stock+adapter"), which does the same work per token as ours. The JSON holds every figure and ours
over stock's per layout (and over stock+adapter's in one process).
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import shlex
import statistics
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mlxcluster.bench import results
from mlxcluster.check import doctor, room
from mlxcluster.describe.cluster import Cluster, Recorded
from mlxcluster.errors import UserError
from mlxcluster.jobs import serve as serving
from mlxcluster.launch import builder, parallel, remote, runs, shipment, sync
from mlxcluster.paths import REPO
from mlxcluster.provision import inputs

CONCURRENCY = (1, 4)
STOCK_ADAPTER = "stock+adapter"  # stock in one process with ours's adapter
PROMPTS = (
    "Tell me a long story about a ship.", "Describe the sea at night in detail.",
    "Explain how sails catch the wind.", "Write a letter to a faraway friend.",
    "List the things a sailor packs for a voyage.", "Why is the sky blue? Explain at length.",
    "Describe a busy harbour in the morning.", "Tell me about the history of maps.",
)
READY_TIMEOUT = 300
# What each rank's peak memory is, read on its node: the python processes whose command line holds
# the server's marker (not the launcher's or the shells around them), in this node's network
# namespace (the lab's nodes share one process table), their high-water mark where /proc has it.
# Our server's front (training/serve/front.py, about 20 MB) is not a rank: left out.
PEAK_SCRIPT = """me=$(readlink /proc/$$/ns/net 2>/dev/null)
for p in $(pgrep -f {pattern}); do
  case $(ps -o comm= -p $p) in *python*) ;; *) continue;; esac
  case $(ps -o args= -p $p) in *training.serve.front*) continue;; esac
  if [ -r /proc/$p/status ]; then
    [ "$(readlink /proc/$p/ns/net)" = "$me" ] || continue
    awk '/VmHWM/{{print $2}}' /proc/$p/status
  else ps -o rss= -p $p; fi
done"""


class ServeBenchError(UserError):
    """A benchmark that cannot run or whose server failed; the message says why."""


@dataclasses.dataclass(frozen=True)
class Server:
    """One configuration: who, on which ranks, launched how, reached where."""

    program: str  # ours or stock
    layout: Cluster
    steps: list[sync.Step]
    launch: list[str]
    tunnel: list[str] | None
    port: int
    marker: str
    model: str  # what requests ask for
    others: tuple[str, ...] = ()  # other adapters it serves, for the requests that alternate


def stock_program(placed_model: str, port: int, marker: str, adapter: str | None = None) -> list[str]:
    """Stock `mlx_lm.server`'s own main(), its command line as given; the marker (in a comment of
    the code) names its processes for the stop and the memory reading."""
    return ["python", "-c", f"from mlx_lm.server import main; main()  # {marker}",
            "--model", placed_model, "--host", "127.0.0.1", "--port", str(port),
            *(["--adapter-path", adapter] if adapter else [])]


def ours(rec: Recorded, layout: Cluster, adapters: Sequence[Path], model: Path, port: int, tag: str,
         threads: int | None) -> Server:
    mode = "tensor" if layout.world_size > 1 else "single"
    sub = dataclasses.replace(rec, cluster=layout)
    plan = serving.plan(sub, serving.Options(runs=tuple(map(str, adapters)), model=str(model), parallel=mode,
                                            port=port, threads=threads), tag)
    return Server("ours", plan.cluster, plan.steps, plan.launch, plan.tunnel, port, plan.marker,
                  adapters[0].name, tuple(a.name for a in adapters[1:]))


def stock(rec: Recorded, layout: Cluster, model: Path, port: int, tag: str, threads: int | None,
          adapter: Path | None = None) -> Server:
    """Stock mlx_lm.server on `layout`'s ranks, launched as ours is (the same backend and ranks'
    environment), with the model sent as ours sends it; with `adapter` (one process only), that
    adapter's files sent where ours's go and loaded with --adapter-path."""
    placed, steps = serving.code_and_model(rec, layout, model)
    marker = f"stock-serve-{tag}"
    placed_adapter = None
    if adapter is not None:
        head = layout.head
        placed_adapter = f"{head.work_dir}/adapters/{adapter.name}"
        files = shipment.select(adapter, runs.ADAPTER_FILES, f"adapter {adapter.name}")
        steps = [*steps, (f"send adapter {adapter.name} to {head.name}",
                          sync.send(files, head, placed_adapter))]
    job = builder.Job(stock_program(placed, port, marker, placed_adapter),
                      backend=builder.choice_for(layout, None).backend,
                      threads=threads, interactive=False, mlx_envs=rec.mlx_envs)
    tunnel = serving.tunnel_command(layout.head, "127.0.0.1", port)
    return Server(STOCK_ADAPTER if adapter else "stock", layout, steps, builder.command(layout, job), tunnel,
                  port, marker, "default_model")


@dataclasses.dataclass(frozen=True)
class Answer:
    started: float
    ended: float
    tokens: int  # completion tokens, as the server's usage says


def _post(port: int, body: dict[str, Any]) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise ServeBenchError(f"the server answered {response.status}: {response.read()[:300]!r}")
    return response


def ask(port: int, model: str, prompt: str, max_tokens: int) -> Answer:
    """One streamed chat request, as clients send them, timed on this machine."""
    started = time.perf_counter()
    response = _post(port, {"model": model, "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": max_tokens, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}})
    tokens = 0
    with response:
        for raw in response:
            line = raw.decode(errors="replace").strip()
            if line.startswith("data: {"):
                usage = json.loads(line.removeprefix("data: ")).get("usage")
                tokens = int(usage.get("completion_tokens") or 0) if usage else tokens
    return Answer(started, time.perf_counter(), tokens)


def first_token_seconds(port: int, model: str, prompt: str) -> float:
    """The time to the first token: a request for one token, answered whole. (A stream's first
    text is no measure: the server sends text only once it makes whole characters, which depends
    on what the model says.)"""
    started = time.perf_counter()
    with _post(port, {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1,
                      "temperature": 0}) as response:
        response.read()
    return time.perf_counter() - started


def load(port: int, models: str | Sequence[str], concurrency: int, requests: int,
         max_tokens: int) -> dict[str, Any]:
    """`requests` streamed requests, `concurrency` at a time, asking for `models` in turn: the
    output tokens per second."""
    models = [models] if isinstance(models, str) else list(models)
    asked = [(models[i % len(models)], PROMPTS[i % len(PROMPTS)] + f" ({i})") for i in range(requests)]
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(lambda a: ask(port, a[0], a[1], max_tokens), asked))
    wall = max(a.ended for a in answers) - min(a.started for a in answers)
    tokens = sum(a.tokens for a in answers)
    return {"concurrency": concurrency, "requests": requests, "completion_tokens": tokens,
            "wall_s": round(wall, 3), "tokens_per_second": round(tokens / wall, 2) if wall else None}


def ttft(port: int, model: str, requests: int) -> float:
    """The median time to the first token of `requests` requests, one at a time, each a prompt of
    its own (the prompt cache of neither server answers for it)."""
    return round(statistics.median(first_token_seconds(port, model, f"{PROMPTS[i % len(PROMPTS)]} [{i}]")
                                   for i in range(requests)), 4)


def wait_ready(port: int, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServeBenchError(f"the server exited ({process.returncode}) before it answered:\n"
                                  + "\n".join(log.read_text(errors="replace").splitlines()[-15:]))
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/v1/models")
            if connection.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    raise ServeBenchError(f"the server did not answer on port {port} within {READY_TIMEOUT} s; see {log}")


def peaks(server: Server) -> list[float]:
    """Each rank's peak resident memory in GB, node by node in rank order."""
    pattern = shlex.quote(f"python.*{server.marker}")
    found = []
    for node in server.layout.training_nodes:
        said = remote.output(node, remote.ssh_command(node, PEAK_SCRIPT.format(pattern=pattern)))
        found += [int(kib) * 1024 / 1e9 for kib in said.split() if kib.isdigit()]
    return [round(p, 4) for p in found]


@contextmanager
def running(server: Server, log: Path) -> Iterator[None]:
    """The server started, answering on this machine's loopback; stopped on every rank after."""
    sync.run_steps(server.steps)
    with log.open("w") as out:
        process = subprocess.Popen(server.launch, stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with serving.tunnel(server.tunnel, server.port):
            wait_ready(server.port, process, log)
            yield
    finally:
        builder.stop(server.layout, server.marker)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def measure(server: Server, log: Path, requests: int, max_tokens: int) -> dict[str, Any]:
    with running(server, log):
        load(server.port, server.model, 1, 1, 8)  # warm-up: the first request's compile and caches
        first = ttft(server.port, server.model, requests)
        figures = {f"c{c}": load(server.port, server.model, c, max(requests, c), max_tokens)
                   for c in CONCURRENCY}
        if server.others:  # the same 4 at once, alternating adapters: one batch that mixes them
            both = (server.model, *server.others)
            figures[MIXED] = load(server.port, both, 4, max(requests, 4), max_tokens)
        memory = peaks(server)
    mixed = {f"tokens_per_second_{MIXED}": figures[MIXED]["tokens_per_second"]} if MIXED in figures else {}
    return {"program": server.program, "nodes": len(server.layout.training_nodes),
            "ranks": server.layout.world_size, "ttft_s": first,
            **{f"tokens_per_second_c{c}": figures[f"c{c}"]["tokens_per_second"] for c in CONCURRENCY},
            **mixed, "peak_memory_gb_per_rank": memory, "loads": figures}


MIXED = "c4_two_adapters"
FIGURES = ("ttft_s", *(f"tokens_per_second_c{c}" for c in CONCURRENCY))


def medians(measured: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per program and layout: the median of each figure over its rounds, each rank's
    largest peak; a layout that failed in every round keeps its error."""
    rows = []
    for key in dict.fromkeys((m["program"], m["nodes"]) for m in measured):
        runs = [m for m in measured if (m["program"], m["nodes"]) == key]
        good = [m for m in runs if "error" not in m]
        if not good:
            rows.append({k: v for k, v in runs[-1].items() if k != "round"})
            continue
        row = {"program": key[0], "nodes": key[1], "ranks": good[0]["ranks"], "rounds": len(good)}
        row |= {f: round(statistics.median(m[f] for m in good), 4) for f in FIGURES}
        if all(f"tokens_per_second_{MIXED}" in m for m in good):
            mixed = statistics.median(m[f"tokens_per_second_{MIXED}"] for m in good)
            row[f"tokens_per_second_{MIXED}"] = round(mixed, 4)
            row[f"{MIXED}_over_one_adapter"] = _over(mixed, row["tokens_per_second_c4"])
        peaks_each = [m["peak_memory_gb_per_rank"] for m in good]
        row["peak_memory_gb_per_rank"] = [max(ranks) for ranks in zip(*peaks_each, strict=False)]
        rows.append(row)
    return rows


def ratios(rows: Sequence[Mapping[str, Any]], against: str = "stock") -> list[dict[str, Any]]:
    """Ours over `against`'s on each layout that has both: time to first token (target at most 1.1)
    and tokens/s (target at least 0.9)."""
    out = []
    for nodes in sorted({r["nodes"] for r in rows}):
        pair = {r["program"]: r for r in rows if r["nodes"] == nodes and "error" not in r}
        if not {"ours", against} <= pair.keys():
            continue
        o, s = pair["ours"], pair[against]
        entry: dict[str, Any] = {"nodes": nodes, "ttft_ratio": _over(o["ttft_s"], s["ttft_s"])}
        for c in CONCURRENCY:
            entry[f"tokens_per_second_ratio_c{c}"] = _over(o[f"tokens_per_second_c{c}"],
                                                           s[f"tokens_per_second_c{c}"])
        entry["meets_targets"] = (entry["ttft_ratio"] is not None and entry["ttft_ratio"] <= 1.1
                                  and all((entry[f"tokens_per_second_ratio_c{c}"] or 0) >= 0.9
                                          for c in CONCURRENCY))
        out.append(entry)
    return out


def _over(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def with_memory_ratio(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Rows with each one's largest rank over its program's one-process peak."""
    alone = {r["program"]: max(r["peak_memory_gb_per_rank"], default=0) for r in rows
             if r["ranks"] == 1 and "error" not in r}
    def ratio(r: Mapping[str, Any]) -> float | None:
        return _over(max(r["peak_memory_gb_per_rank"], default=0), alone.get(r["program"]))

    return [r if "error" in r else {**r, "peak_memory_ratio": ratio(r)} for r in rows]


def table(result: Mapping[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title=f"bench.serve: {Path(result['model']).name}, {result['max_tokens']} tokens per answer",
              caption="ttft: median time to first token (a one-token request), one at a time; tokens/s: "
                      "output tokens over the wall time, 1 and 4 requests at once; peak: each rank's, and "
                      "the largest over its program's one process")
    for name in ("program", "nodes", "ranks", "ttft s", "tokens/s (1)", "tokens/s (4)", "peak GB per rank",
                 "peak ratio"):
        t.add_column(name, justify="left" if name == "program" else "right")
    for r in result["rows"]:
        if "error" in r:
            failed = f"failed: {r['error'].splitlines()[-1][:60]}"
            t.add_row(r["program"], str(r["nodes"]), str(r["ranks"]), failed, *["-"] * 4)
            continue
        t.add_row(r["program"], str(r["nodes"]), str(r["ranks"]), f"{r['ttft_s']:.3f}",
                  f"{r['tokens_per_second_c1']:.1f}", f"{r['tokens_per_second_c4']:.1f}",
                  " / ".join(f"{p:.2f}" for p in r["peak_memory_gb_per_rank"]),
                  "-" if r["peak_memory_ratio"] is None else f"{r['peak_memory_ratio']:.2f}x")
    return t


def tag_of(when: str, program: str, nodes: int, round_: int) -> str:
    """What names one server's processes (and its log): a marker builder.stop takes (no `+`)."""
    return f"{when}-{program.replace('+', '-')}-{nodes}-{round_}"


def node_counts(text: str | None, available: int) -> list[int]:
    """--nodes: the layouts, one process (1) and tensor-parallel across that many nodes."""
    if not text:
        return list(range(1, available + 1))
    try:
        counts = sorted({int(part) for part in str(text).split(",")})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1 or counts[-1] > available:
        raise ServeBenchError(f"--nodes {text}: node counts from 1 to the {available} training nodes, "
                              "separated by commas (1 is one process)")
    return counts


def run(rec: Recorded, *, nodes: str | None = None, model: str | None = None, requests: int = 8,
        max_tokens: int = 64, port: int = 18080, threads: int | None = None, stock_too: bool = True,
        rounds: int = 1, output: str | None = None) -> Path:
    """Every layout, ours then stock's; the JSON written."""
    from training.model import stand_in

    counts = node_counts(nodes, len(rec.cluster.training_nodes))
    _, model_dir = inputs.resolve(rec.cluster, None, model)
    layouts = {n: rec.cluster.first_nodes(n) if n > 1 else rec.cluster.only(rec.cluster.head) for n in counts}
    for n, layout in layouts.items():
        if n > 1:
            parallel.check(layout, model_dir, "tensor")
    doctor.preflight(rec.cluster, room.largest([
        room.for_server(layout, model_dir, "tensor" if n > 1 else "single", context=None)
        for n, layout in layouts.items()]))
    when = results.stamp()
    work = REPO / "build" / "bench-serve" / when
    adapters = [work / "lora", work / "lora-b"]
    # LoRAs as `mlx_lm lora` writes them for this model (random, far from zero: they change the answers).
    for seed, adapter in enumerate(adapters):
        stand_in.adapter(model_dir, adapter, "lora", rank=8, layers=16, seed=seed)
    measured: list[dict[str, Any]] = []
    # Rounds alternate the programs, each server started afresh: on a busy or shared machine a
    # server's speed varies from one start to the next, more than between the programs.
    programs = ("ours", "stock") if stock_too else ("ours",)

    def server_of(name: str, layout: Cluster, tag: str) -> Server:
        if name == "ours":
            return ours(rec, layout, adapters, model_dir, port, tag, threads)
        with_adapter = adapters[0] if name == STOCK_ADAPTER else None
        return stock(rec, layout, model_dir, port, tag, threads, with_adapter)

    for round_ in range(1, rounds + 1):
        for n, layout in layouts.items():
            for name in (*programs, STOCK_ADAPTER) if stock_too and n == 1 else programs:
                tag = tag_of(when, name, n, round_)
                print(f"==> bench.serve: {name} on {n} node{'s' if n > 1 else ''} ({layout.world_size} "
                      f"rank{'s' if layout.world_size > 1 else ''}), round {round_} of {rounds}", flush=True)
                try:
                    figures = measure(server_of(name, layout, tag), work / f"{tag}.log", requests, max_tokens)
                    measured.append(figures | {"round": round_})
                except ServeBenchError as error:  # e.g. stock cannot shard heads N does not divide
                    print(f"==> {name} on {n} node(s) failed: {error}", flush=True)
                    measured.append({"program": name, "nodes": n, "ranks": layout.world_size, "round": round_,
                                     "error": str(error)})
    rows = medians(measured)
    rows = with_memory_ratio(rows)
    result = {"benchmark": "serve", "date": results.date(), "inventory": rec.inventory,
              "model": str(model_dir), "adapter": "LoRA rank 8 on 16 layers (two)", "requests": requests,
              "max_tokens": max_tokens, "rounds": rounds, "rows": rows, "ours_over_stock": ratios(rows),
              "ours_over_stock_with_adapter": ratios(rows, STOCK_ADAPTER), "each_round": measured}
    out = results.write("serve", result, output, when)
    report(result)
    print(f"wrote {out}")
    return out


def report(result: Mapping[str, Any]) -> None:
    """The table, ours over stock's per layout against the targets, and the cost of mixing adapters."""
    from rich.console import Console

    Console(width=max(Console().width, 110)).print(table(result))
    for against, key in (("stock", "ours_over_stock"), (STOCK_ADAPTER, "ours_over_stock_with_adapter")):
        for entry in result[key]:
            print(f"{entry['nodes']} node(s): ours/{against} ttft {entry['ttft_ratio']}x, tokens/s "
                  + ", ".join(f"{entry[f'tokens_per_second_ratio_c{c}']}x at {c}" for c in CONCURRENCY)
                  + ("" if entry["meets_targets"] else
                     "  (misses the targets: ttft <= 1.1x, tokens/s >= 0.9x)"))
    for row in result["rows"]:
        if row.get(f"{MIXED}_over_one_adapter") is not None:
            print(f"ours on {row['nodes']} node(s), 4 at once alternating two adapters: "
                  f"{row[f'tokens_per_second_{MIXED}']} tokens/s, {row[f'{MIXED}_over_one_adapter']}x "
                  "4 at once for one adapter")
