"""invoke bench.links: launch lines, flags, rows, table and PNG (mlxcluster/bench/links.py), and
the benchmark program itself (training/tools/link_bench.py) on two local ranks."""

from __future__ import annotations

import io
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from mlxcluster.bench import links
from mlxcluster.describe.cluster import Cluster
from mlxcluster.launch import builder, sync
from tests.unit import rings
from training.tools import link_bench

REPO = Path(__file__).resolve().parents[4]


def cluster(slots: tuple[int, ...] = (2, 1, 0)) -> Cluster:
    def node(i: int, n: int) -> dict:
        return {"name": f"node{i}", "thunderbolt_ip": f"10.0.0.{i}", "slots": n,
                "thunderbolt_interface": "bridge0", "cluster_root": "/opt/mlx-cluster",
                "venv": "/opt/mlx-cluster/venv", "env_file": "/opt/mlx-cluster/env.sh",
                "openmpi_prefix": "/usr",
                "connection": {"type": "ssh", "host": f"node{i}.mgmt", "user": "root"}}
    return Cluster.from_json({"launcher": "node1",
                              "nodes": [node(i, n) for i, n in enumerate(slots, 1)]})


def pair(src: int, dst: int, bandwidth: float, latency: float = 20.0) -> dict:
    return {"src": src, "dst": dst, "latency_us": latency, "bandwidth_gb_per_s": bandwidth}


def doc(backend: str, pairs: list[dict], n: int = 3) -> dict:
    """What link_bench prints for one backend (sizes 4 KB .. 1 MB)."""
    sizes = link_bench.message_sizes(4096, 1 << 20)
    return {"backend": backend, "world_size": n, "hostnames": [f"node{i}" for i in range(1, n + 1)],
            "mlx": "0.32.4", "settings": {"pair_bytes": 1 << 20},
            "pairs": pairs,
            "all_reduce": [{"bytes": b, "iterations": 3, "time_us": 50 + b / 1000,
                            "algbw_gb_per_s": b / (50 + b / 1000) / 1000,
                            "busbw_gb_per_s": 4 / 3 * b / (50 + b / 1000) / 1000} for b in sizes]}


HEALTHY = [pair(s, d, 3.0 + 0.1 * s) for s in range(3) for d in range(3) if s != d]


def sample(pairs: list[dict] = HEALTHY) -> dict:
    layout = links.one_rank_per_node(cluster((1, 1, 1)))
    return links.assemble(layout, {"mpi": doc("mpi", pairs), "ring": doc("ring", HEALTHY)},
                          inventory="inv.yml", date="2026-01-01T00:00:00+00:00", max_bytes=1 << 20)


# --- options and launch lines ----------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("4096", 4096), ("4K", 4096), ("4KB", 4096), ("4 KiB", 4096), ("256MB", 256 << 20),
    ("1g", 1 << 30), (4194304, 4 << 20)])
def test_sizes_are_bytes_or_binary_units(text, expected):
    assert links.parse_size(text) == expected


@pytest.mark.parametrize("text", ["4TB", "lots", "1KB"])
def test_a_bad_size_says_what_to_give(text):
    with pytest.raises(links.LinkBenchError, match="--max-size"):
        links.parse_size(text)


def test_backends_are_checked_and_deduplicated():
    assert links.parse_backends("mpi, ring,mpi", cluster()) == ["mpi", "ring"]
    assert links.parse_backends(None, cluster()) == ["mpi", "ring"]
    with pytest.raises(links.LinkBenchError, match="choose from mpi, ring, jaccl, jaccl-ring"):
        links.parse_backends("mpi,nccl", cluster())


def test_over_per_cable_networks_the_training_backend_is_measured_and_mpi_only_on_a_mesh():
    from mlxcluster.errors import UserError
    from tests.unit.mlxcluster.describe.test_backends import MESH3, RING4, cabled

    mesh = cabled(MESH3, {})
    assert links.parse_backends(None, mesh) == ["ring"]
    assert links.parse_backends("mpi,ring", mesh) == ["mpi", "ring"]  # a full mesh carries MPI
    with pytest.raises(UserError, match="the mpi backend cannot run on this cabling"):
        links.parse_backends("mpi", cabled(RING4, {}))


def test_each_node_gets_one_rank_whatever_its_slots():
    layout = links.one_rank_per_node(cluster((2, 3, 0)))
    assert [n.slots for n in layout.nodes] == [1, 1, 0]
    assert layout.world_size == 2
    with pytest.raises(links.LinkBenchError, match="at least 2 nodes"):
        links.one_rank_per_node(cluster((2, 0, 0)))


def test_mpi_launch_puts_one_rank_on_each_node_over_the_cluster_link():
    layout = links.one_rank_per_node(cluster())
    cmd = builder.command(layout, links.job(layout, "mpi", max_bytes=4 << 20, tag="links-1"))
    assert cmd[:3] == ["ssh", "-o", "BatchMode=yes"] and cmd[-2] == "root@node1.mgmt"
    line = cmd[-1]
    assert line.startswith(". /opt/mlx-cluster/env.sh && cd /opt/mlx-cluster/work && ")
    assert ("/usr/bin/mpirun --allow-run-as-root --hostfile /opt/mlx-cluster/hostfile -np 2 "
            "--bind-to none --mca btl_tcp_if_include bridge0") in line
    assert line.endswith("--map-by node --wdir /opt/mlx-cluster/work /opt/mlx-cluster/venv/bin/python "
                         "-m training.tools.link_bench --max-size 4194304 --pair-bytes 4194304 "
                         "--expected-world-size 2 --tag links-1")


def test_ring_launch_writes_a_hosts_file_with_one_entry_per_node():
    layout = links.one_rank_per_node(cluster())
    line = builder.command(layout, links.job(layout, "ring", max_bytes=256 << 20, tag="t",
                                            envs=["A=1"]))[-1]
    words = shlex.split(line)
    hosts = json.loads(words[words.index("printf") + 2])
    assert hosts == {"backend": "ring", "envs": ["A=1"],
                     "hosts": [{"ssh": "10.0.0.1", "ips": ["10.0.0.1"]},
                               {"ssh": "10.0.0.2", "ips": ["10.0.0.2"]}]}
    assert words[words.index(">") + 1] == "/opt/mlx-cluster/work/link-bench-hosts.json"
    launcher = words[words.index("/opt/mlx-cluster/venv/bin/mlx-cluster-launch") - 1:]
    assert launcher[:8] == ["/opt/mlx-cluster/venv/bin/python",
                            "/opt/mlx-cluster/venv/bin/mlx-cluster-launch", "--backend", "ring",
                            "--hostfile", "/opt/mlx-cluster/work/link-bench-hosts.json",
                            "--cwd", "/opt/mlx-cluster/work"]
    rest = launcher[launcher.index("--"):]  # after the ranks' --env settings
    assert rest[:4] == ["--", "bash", "-c", builder.rank_script("/opt/mlx-cluster/env.sh")]
    # The pair message is capped at 64 MB even when the all-reduce goes further.
    assert rest[4:11] == ["python", "-m", "training.tools.link_bench", "--max-size", str(256 << 20),
                          "--pair-bytes", str(64 << 20)]


def test_the_result_is_found_among_other_output():
    out = f"[WARN] something\n{links.MARKER}{json.dumps({'backend': 'mpi'})}\nbye\n"
    assert links.extract(out) == {"backend": "mpi"}
    assert links.extract("rank 1: error: no\n") is None


def test_the_program_and_the_controller_agree_on_the_marker():
    assert links.MARKER == link_bench.MARKER


# --- judging ---------------------------------------------------------------------------------------


def test_healthy_pairs_are_not_flagged():
    assert sample()["flags"] == []


def test_a_slow_link_is_flagged_in_both_directions_it_is_slow():
    pairs = [pair(s, d, 0.5 if {s, d} == {0, 2} else 3.0) for s in range(3) for d in range(3)
             if s != d]
    flags = sample(pairs)["flags"]
    assert {(f["from"], f["to"], f["kind"], f["backend"]) for f in flags} == {
        ("node1", "node3", "slow", "mpi"), ("node3", "node1", "slow", "mpi")}
    assert "0.17x the median pair's 3 GB/s" in flags[0]["detail"]


def test_an_asymmetric_link_is_flagged_both_ways():
    pairs = [pair(s, d, 2.0 if (s, d) == (1, 2) else 3.0) for s in range(3) for d in range(3)
             if s != d]
    flags = links.flag_pairs(pairs, ["a", "b", "c"])
    assert [(f["from"], f["to"], f["kind"]) for f in flags] == [("b", "c", "asymmetric"),
                                                                 ("c", "b", "asymmetric")]
    assert flags[0]["detail"] == "2 GB/s, but 3 GB/s back"
    # 20 % apart is within tolerance.
    assert links.flag_pairs([pair(0, 1, 2.4), pair(1, 0, 3.0)], ["a", "b"]) == []


def test_a_run_that_joined_other_ranks_than_the_nodes_is_refused():
    layout = links.one_rank_per_node(cluster((1, 1, 1)))
    with pytest.raises(links.LinkBenchError, match="joined 2 ranks, not one per node"):
        links.assemble(layout, {"mpi": doc("mpi", [], n=2)}, inventory="i", date="d", max_bytes=1)


def test_rows_merge_the_backends_per_pair_and_per_size():
    result = sample([pair(0, 1, 0.5), pair(1, 0, 3.0), pair(0, 2, 3.0), pair(2, 0, 3.0)])
    rows = links.pair_rows(result)
    assert [(r.src, r.dst) for r in rows] == [("node1", "node2"), ("node1", "node3"),
                                              ("node2", "node1"), ("node2", "node3"),
                                              ("node3", "node1"), ("node3", "node2")]
    assert rows[0].figures == {"mpi": (20.0, 0.5), "ring": (20.0, 3.0)}
    assert rows[0].flags == ("slow (mpi)", "asymmetric (mpi)")
    assert rows[3].figures == {"ring": (20.0, 3.1)}  # not measured on mpi
    sizes = links.all_reduce_rows(result)
    assert [s for s, _ in sizes] == [4096, 16384, 65536, 262144, 1 << 20]
    assert set(sizes[0][1]) == {"mpi", "ring"}


def test_the_table_shows_every_pair_every_size_and_the_flags():
    out = io.StringIO()
    links.render(sample([pair(0, 1, 0.5), pair(1, 0, 3.0), pair(0, 2, 3.0), pair(2, 0, 3.0)]),
                 Console(file=out, width=120))
    text = out.getvalue()
    assert "node1 -> node2" in text and "node3 -> node2" in text
    assert "256 KB" in text and "1 MB" in text
    assert "node1 -> node2 slow on mpi: 0.5 GB/s" in text
    out = io.StringIO()
    links.render(sample(), Console(file=out, width=120))
    assert "no slow or asymmetric link" in out.getvalue()


def test_the_png_is_drawn(tmp_path):
    result = sample([pair(0, 1, 0.5), pair(1, 0, 3.0), pair(0, 2, 3.0), pair(2, 0, 3.0)])
    path = links.plot(result, tmp_path / "bench" / "links.png")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 20_000


# --- the program -----------------------------------------------------------------------------------


def test_sizes_grow_by_four_and_ring_pairs_are_ring_neighbours():
    assert link_bench.message_sizes(4096, 256 << 20)[-1] == 256 << 20
    assert len(link_bench.message_sizes(4096, 256 << 20)) == 9
    assert link_bench.message_sizes(4096, 5000) == [4096]
    assert len(link_bench.pairs_to_measure(3, "ring")) == 6  # every pair is a neighbour
    assert link_bench.pairs_to_measure(4, "ring") == [(0, 1), (0, 3), (1, 0), (1, 2), (2, 1),
                                                      (2, 3), (3, 0), (3, 2)]
    assert len(link_bench.pairs_to_measure(4, "mpi")) == 12
    assert link_bench.pairs_to_measure(4, "jaccl-ring") == link_bench.pairs_to_measure(4, "ring")
    assert len(link_bench.pairs_to_measure(4, "jaccl")) == 12  # a mesh: every pair has a cable
    assert link_bench.bus_bandwidth(3000, 1.0, 3) == 4000


def test_the_backend_is_told_by_what_the_launcher_set():
    assert link_bench.detect_backend({"OMPI_COMM_WORLD_SIZE": "2"}) == "mpi"
    assert link_bench.detect_backend({"MLX_RANK": "0"}) == "ring"
    jaccl = {"MLX_RANK": "0", "MLX_JACCL_COORDINATOR": "10.0.0.1:5000"}
    assert link_bench.detect_backend(jaccl) == "jaccl"
    assert link_bench.detect_backend({**jaccl, "MLX_JACCL_RING": "1"}) == "jaccl-ring"


def test_over_per_cable_networks_each_pair_is_shown_with_its_cable():
    from tests.unit.mlxcluster.describe.test_backends import RING4, cabled

    layout = cabled(RING4, {})
    names = [n.name for n in layout.training_nodes]
    pairs = [pair(i, j, 1.0) for i in range(4) for j in range(4) if (j - i) % 4 in (1, 3)]
    result = links.assemble(layout, {"ring": doc("ring", pairs, n=4)}, inventory="x", date="d",
                            max_bytes=4096)
    rows = {(r.src, r.dst): r.cable for r in links.pair_rows(result)}
    assert rows[names[0], names[1]] == rows[names[1], names[0]] == "mac1:en2 <-> mac2:en2"
    assert len(set(rows.values())) == 4 and None not in rows.values()
    out = io.StringIO()
    links.render(result, Console(file=out, width=200))
    assert "mac4:en3 <-> mac1:en3" in out.getvalue()


def test_two_ranks_on_one_host_are_refused():
    with pytest.raises(link_bench.BenchError, match="ranks 0 and 2 both run on a"):
        link_bench.check_one_rank_per_node(["a", "b", "a"])


def launch_two_ranks(*args: str) -> subprocess.CompletedProcess:
    launch = rings.launch(2)
    return subprocess.run([*launch, sys.executable, "-m", "training.tools.link_bench", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=180,
                          stdin=subprocess.DEVNULL)  # none of pytest's for the ranks


def test_two_local_ranks_measure_their_pairs_and_all_reduce(tmp_path):
    proc = launch_two_ranks("--max-size", "65536", "--pair-bytes", "1048576", "--latency-iters",
                            "5", "--bandwidth-repeats", "2", "--allow-shared-hosts",
                            "--expected-world-size", "2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count(link_bench.MARKER) == 1  # rank 0 only; progress is on stderr
    result = links.extract(proc.stdout)
    assert result is not None
    assert result["backend"] == "ring" and result["world_size"] == 2
    assert [(p["src"], p["dst"]) for p in result["pairs"]] == [(0, 1), (1, 0)]
    assert all(p["latency_us"] > 0 and p["bandwidth_gb_per_s"] > 0 for p in result["pairs"])
    assert [e["bytes"] for e in result["all_reduce"]] == [4096, 16384, 65536]
    assert all(e["time_us"] > 0 and e["busbw_gb_per_s"] > 0 for e in result["all_reduce"])
    # And the controller side takes it from there.
    layout = links.one_rank_per_node(cluster((1, 1)))
    assembled = links.assemble(layout, {"ring": result}, inventory="i", date="d", max_bytes=65536)
    assert links.plot(assembled, tmp_path / "links.png").exists()


def test_two_ranks_on_one_host_fail_loudly():
    proc = launch_two_ranks("--max-size", "4096", "--no-pairs")
    assert link_bench.MARKER not in proc.stdout
    assert "the benchmark needs one rank per node" in proc.stderr


def test_the_code_goes_to_every_node_that_runs_a_rank():
    steps = sync.push_code(links.one_rank_per_node(cluster()), REPO / "training")
    assert [label for label, _ in steps] == ["sync code to node1", "sync code to node2"]
    assert steps[1][1][-2:] == [f"{REPO / 'training'}/", "root@node2.mgmt:/opt/mlx-cluster/work/training/"]
