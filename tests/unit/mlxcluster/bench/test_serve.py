"""bench.serve's measures against a real server (streamed requests, one and several at once), its
reading of each rank's peak memory on a node, and its ratios against stock's targets."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time

import pytest

from mlxcluster.bench import serve
from mlxcluster.describe.cluster import Cluster, Node
from training.model import stand_in
from training.serve import READY


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("bench-serve")
    stand_in.make(root / "model", seed=4, max_position_embeddings=512)
    stand_in.adapter(root / "model", root / "lora", "lora", 4, seed=4)
    stand_in.adapter(root / "model", root / "lora-b", "lora", 4, seed=5)
    port = free_port()
    log = root / "server.log"
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "training.serve", "--model", str(root / "model"),
                                    "--adapter", f"lora={root / 'lora'}", "--adapter",
                                    f"lora-b={root / 'lora-b'}", "--port", str(port),
                                    "--tag", "bench-serve-unit-test"],
                                   stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    deadline = time.monotonic() + 120
    while READY not in log.read_text():
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    yield port, process
    os.killpg(process.pid, signal.SIGTERM)
    process.wait(timeout=20)


def test_a_load_times_the_first_token_and_counts_the_served_tokens(server):
    port, _ = server
    alone = serve.ask(port, "lora", "Ahoy", max_tokens=6)
    assert alone.started < alone.ended and 1 <= alone.tokens <= 6
    at_once = serve.load(port, "lora", concurrency=4, requests=4, max_tokens=6)
    assert at_once["requests"] == 4 and 4 <= at_once["completion_tokens"] <= 24
    per_second = at_once["completion_tokens"] / at_once["wall_s"]
    assert at_once["tokens_per_second"] == pytest.approx(per_second, rel=0.02)  # wall_s is rounded
    assert 0 < serve.ttft(port, "lora", 3) < 30
    both = serve.load(port, ("lora", "lora-b"), concurrency=4, requests=4, max_tokens=6)
    assert 4 <= both["completion_tokens"] <= 24
    with pytest.raises(serve.ServeBenchError, match="answered 400"):
        serve.ask(port, "nobody", "Ahoy", max_tokens=2)


def test_peak_memory_is_read_from_the_marked_python_processes_of_the_node(server):
    _, process = server
    here = Node(name="here", thunderbolt_ip="127.0.0.1", slots=1, connection={"type": "local"})
    found = serve.peaks(serve.Server("ours", Cluster("here", (here,), ()), [], [], None, 0,
                                     "bench-serve-unit-test", "lora"))
    with open(f"/proc/{process.pid}/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    assert found == [round(kib * 1024 / 1e9, 4)]  # the server alone: not this shell, not pytest


def row(program: str, nodes: int, ttft: float, c1: float, c4: float, peaks: list[float]) -> dict:
    return {"program": program, "nodes": nodes, "ranks": nodes, "ttft_s": ttft, "tokens_per_second_c1": c1,
            "tokens_per_second_c4": c4, "peak_memory_gb_per_rank": peaks}


def test_ours_over_stock_per_layout_against_the_targets():
    rows = serve.with_memory_ratio([row("ours", 1, 0.10, 50, 150, [1.0]),
                                    row("stock", 1, 0.10, 52, 160, [0.9]),
                                    row("ours", 2, 0.12, 40, 120, [0.55, 0.5]),
                                    row("stock", 2, 0.10, 40, 120, [0.5, 0.5])])
    assert [r["peak_memory_ratio"] for r in rows] == [1.0, 1.0, 0.55, 0.556]
    one, two = serve.ratios(rows)
    assert one == {"nodes": 1, "ttft_ratio": 1.0, "tokens_per_second_ratio_c1": 0.962,
                   "tokens_per_second_ratio_c4": 0.938, "meets_targets": True}
    assert two["ttft_ratio"] == 1.2 and not two["meets_targets"]
    # In one process stock takes the adapter too: ours beside it, doing the same work per token.
    rows.append(row(serve.STOCK_ADAPTER, 1, 0.10, 48, 160, [1.0]))
    assert serve.ratios(rows, serve.STOCK_ADAPTER) == [
        {"nodes": 1, "ttft_ratio": 1.0, "tokens_per_second_ratio_c1": 1.042,
         "tokens_per_second_ratio_c4": 0.938, "meets_targets": True}]
    assert serve.stock_program("m", 80, "x", "/w/lora")[-2:] == ["--adapter-path", "/w/lora"]


def test_every_program_s_tag_is_a_marker_the_stop_takes():
    from mlxcluster.launch import builder

    cluster = Cluster("here", (Node(name="here", thunderbolt_ip="127.0.0.1", slots=1),), ())
    for program in ("ours", "stock", serve.STOCK_ADAPTER):
        marker = f"stock-serve-{serve.tag_of('20261126-072438', program, 1, 1)}"
        # The stop's pkill pattern finds the stock server's own command line, and only that run's.
        pattern = builder.stop_pattern(marker)
        assert f"pkill -TERM -f {shlex.quote(pattern)}" in builder.stop_command(cluster, marker)[-1]
        launched = shlex.join(serve.stock_program("/w/model", 8080, marker))
        assert re.search(pattern, launched), (pattern, launched)
        assert not re.search(pattern, launched.replace("072438", "072439"))
    with pytest.raises(ValueError, match="marker"):
        builder.stop_command(cluster, "stock-serve-a+b")


def test_node_counts_are_checked_against_the_cluster():
    assert serve.node_counts(None, 3) == [1, 2, 3]
    assert serve.node_counts("3,1", 3) == [1, 3]
    for wrong in ("0,2", "4", "two"):
        with pytest.raises(serve.ServeBenchError, match="node counts from 1 to the 3 training nodes"):
            serve.node_counts(wrong, 3)


def test_rounds_are_reduced_to_medians_and_each_rank_s_largest_peak():
    measured = [row("ours", 2, 0.3, 10, 30, [0.6, 0.5]) | {"round": 1},
                row("ours", 2, 0.1, 30, 10, [0.5, 0.7]) | {"round": 2},
                row("ours", 2, 0.2, 20, 20, [0.5, 0.5]) | {"round": 3},
                {"program": "stock", "nodes": 2, "ranks": 2, "round": 1, "error": "cannot shard"}]
    for mixed, m in zip((16, 22, 18), measured, strict=False):
        m["tokens_per_second_c4_two_adapters"] = mixed
    ours, stock = serve.medians(measured)
    assert ours == {"program": "ours", "nodes": 2, "ranks": 2, "rounds": 3, "ttft_s": 0.2,
                    "tokens_per_second_c1": 20, "tokens_per_second_c4": 20,
                    "tokens_per_second_c4_two_adapters": 18, "c4_two_adapters_over_one_adapter": 0.9,
                    "peak_memory_gb_per_rank": [0.6, 0.7]}
    assert stock == {"program": "stock", "nodes": 2, "ranks": 2, "error": "cannot shard"}
