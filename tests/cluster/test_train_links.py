"""links mode on real point-to-point cables: three lab hosts cabled in a ring, a /30 per cable,
then a fourth joining the ring.

The cluster lab's hosts (test_site.py and test_restarts.py ran on their bridge before: this module
comes after them) get veth cables straight between their namespaces, named like a Mac's
Thunderbolt ports (mlxcluster/lab/veth.py), and the inventory lab.up writes for them. Then
site.yml configures every cable, training runs over them with the ring backend, and a pulled
cable is named by doctor and by the run it stops. `invoke bench.links` measures across every cable.
Last, a fourth node is cabled into the ring, as a user adds a Mac: the pairs without a cable between
them are reached over the management network, MPI is refused with the reason, and ring trains, on
the four and, one killed, on the line of three left, closed over the management network.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from mlxcluster import paths
from mlxcluster.lab import hosts
from tests.cluster.conftest import (
    LINKS_VERIFIED,
    TEST_LAB_ID,
    LabCluster,
    assert_equal_across_ranks,
    assert_tensor_qlora_is_one_process,
    assert_trains_as_one_process,
    one_process_run,
    rank_weights,
)
from tests.cluster.test_train import (
    INVOKE,
    REPO,
    finetune_pids,
    finished_run,
    invoke_train,
    killed_at_checkpoint,
    run_dir_of,
    serve_pids,
    serve_port,
    serving,
    tiny_eos,
    wait_until_gone,
)

pytestmark = pytest.mark.cluster

RING = [["node1:en2", "node2:en2"], ["node2:en3", "node3:en2"], ["node3:en3", "node1:en3"]]
POOL = f"10.78.{TEST_LAB_ID}"  # the lab's link pool (lab.up writes 10.78.<lab>.0/24)
TINY_RUN = "--steps-per-report 1 --val-batches 1 --num-layers 1 --max-seq-length 256"


@pytest.fixture(scope="module")
def cabled(lab_cluster: LabCluster):
    """The cluster lab as three nodes (test_site.py adds a fourth), cabled in a ring and provisioned
    in links mode from the inventory lab.up writes.

    The nodes come from a bridge, as in a full run (and as a user moving to links would): a
    module run alone provisions the bridge first, so the bridge's live addresses are there."""
    # Alone, the nodes are fresh (a record in build/ may be an earlier lab's): ask the nodes.
    if any(lab_cluster.ssh(n, "test -e /opt/mlx-cluster/hostfile").returncode for n in (1, 2, 3)):
        bridge = lab_cluster.playbook()
        assert bridge.returncode == 0, json.dumps(bridge.failures, indent=1)
    for extra in (n for n in lab_cluster.lab.nodes() if n > 3):
        hosts.stop_node(lab_cluster.lab, extra)
    inventory = hosts.up(3, TEST_LAB_ID, cables="ring")
    cluster = LabCluster(lab_cluster.lab, inventory, lab_cluster.facts_dir, lab_cluster.model)
    try:
        yield cluster
    finally:
        shutil.rmtree(paths.build_dir_for(inventory), ignore_errors=True)


def cable_bytes(cluster: LabCluster) -> dict[str, int]:
    """Bytes sent from each cable end, by port."""
    counts = {}
    for link in RING:
        for port in link:
            host, interface = port.split(":")
            counts[port] = int(subprocess.run(
                ["ip", "netns", "exec", cluster.lab.netns(int(host[4:])), "cat",
                 f"/sys/class/net/{interface}/statistics/tx_bytes"],
                capture_output=True, text=True, check=True).stdout)
    return counts


def test_links_mode_converges_cable_by_cable_and_a_second_run_changes_nothing(cabled):
    first = cabled.playbook()
    assert first.returncode == 0, json.dumps(first.failures, indent=1)
    # node1 held its bridge address, in the pool, from the bridge run before (the fixture's).
    task = "thunderbolt : Bring the ports up and set their MTU, addresses and routes"
    ran = [item["item"]["argv"] for host, name, result in first.recap.results()
           if host == "node1" and name == task for item in result.get("results", []) if item.get("changed")]
    assert any(argv[:3] == ["ip", "addr", "del"] and argv[3].startswith(f"{POOL}.")
               and argv[-1] not in ("en2", "en3") for argv in ran), ran
    second = cabled.playbook()
    assert second.returncode == 0 and all(s["changed"] == 0 for s in second.stats.values()), second.changed
    record = json.loads((paths.build_dir_for(cabled.inventory) / "cluster.json").read_text())
    assert [[f"{e['host']}:{e['interface']}" for e in c["ends"]] for c in record["cables"]] == RING
    assert [c["network"] for c in record["cables"]] == [f"{POOL}.0/30", f"{POOL}.4/30", f"{POOL}.8/30"]
    # Each end has its /30 and a networkd file that restores it at boot; the bridge's is gone.
    out = cabled.ssh(2, "ip -br -4 addr show en2; ip -br -4 addr show en3; "
                        "ls /etc/systemd/network/").stdout
    assert f"{POOL}.2/30" in out and f"{POOL}.5/30" in out
    assert "50-mlx-thunderbolt-en2.network" in out and "50-mlx-thunderbolt.network" not in out
    # Only the cables hold the pool's addresses: the bridge's (in the pool here) is gone.
    for node in (1, 2, 3):
        held = [line.split()[0].split("@")[0]  # en2@if2: a veth names its peer's index
                for line in cabled.ssh(node, "ip -br -4 addr").stdout.splitlines() if f" {POOL}." in line]
        assert held == ["en2", "en3"], (node, held)
    # Across each cable, its far end answers (node3 to node1 over their own cable).
    assert cabled.ssh(3, f"ping -c 1 -W 2 {POOL}.10").returncode == 0
    # node1 reaches node2 at its address on the node2-node3 cable across their own cable (the
    # host routes MPI needs), and the networkd file keeps the route.
    assert f"via {POOL}.2 dev en2" in cabled.ssh(1, f"ip route get {POOL}.5").stdout
    kept = cabled.ssh(1, "cat /etc/systemd/network/50-mlx-thunderbolt-en2.network").stdout
    assert f"Destination={POOL}.5/32\nGateway={POOL}.2" in kept
    hosts = json.loads((paths.build_dir_for(cabled.inventory) / "hosts.json").read_text())
    assert [h["ips"] for h in hosts["hosts"]] == [[f"{POOL}.10"], [f"{POOL}.2"], [f"{POOL}.6"]]


@pytest.mark.parametrize(("role", "scenario"), LINKS_VERIFIED)
def test_the_links_scenario_s_molecule_checks_hold_on_the_cabled_nodes(cabled, role, scenario):
    # As molecule's shared inventory names it: the lab's bridge port, which links mode leaves bare.
    run = cabled.verify((role, scenario), thunderbolt_interface=hosts.THUNDERBOLT_IFACE)
    assert run.returncode == 0, json.dumps(run.failures, indent=1) + run.stderr[-2000:]
    assert run.changed == {}
    assert {host for host in run.stats if host != "localhost"} == {"node1", "node2", "node3"}, run.stats


def test_ring_training_runs_over_every_cable(cabled, tiny_inputs, tmp_path):
    model_dir, data_dir = tiny_inputs
    before = cable_bytes(cabled)
    # --backend auto (the default): a ring of cables, no RDMA on Linux: ring, and it says why.
    proc = invoke_train(cabled, "--model", str(model_dir), "--data", str(data_dir), "--iters", "6",
                        "--batch-size", "3", "--extra",
                        TINY_RUN + " --steps-per-eval 6 --learning-rate 1e-3 --save-rank-weights",
                        timeout=600)
    run_dir = finished_run(proc)
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["world_size"] == 3 and summary["max_weight_difference_across_ranks"] == 0.0
        # Each node's file of its rank's weights: the same on all three, and one process's.
        assert_equal_across_ranks(rank_weights(cabled, run_dir, [1, 2, 3]))
        reference = one_process_run(run_dir, model_dir, data_dir, tmp_path / "one")
        print(f"3 ring ranks against 1 process: {assert_trains_as_one_process(run_dir, reference):.3g}")
        why = "the cables make a ring; RDMA is not known on node1, node2, node3"
        assert f"==> backend ring: {why}" in proc.stdout
        info = json.loads((run_dir / "run.json").read_text())
        assert info["backend"] == "ring" and info["backend_why"].startswith(why)
        after = cable_bytes(cabled)
        # Per cable, both directions: the ring may send a small gradient one way round only.
        moved = {" <-> ".join(link): sum(after[p] - before[p] for p in link) for link in RING}
        print(f"bytes over each cable while training: {moved}")
        quiet = [cable for cable, count in moved.items() if count < 20_000]
        assert not quiet, f"cables that carried no training traffic: {quiet} ({moved})"
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def test_three_nodes_each_holding_packed_shards_of_a_4_bit_model_train_one_process_s_qlora_and_serve_it(
        cabled, tiny_quantized_model, tiny_inputs, tmp_path):
    import openai

    from tests.unit.training.serve.test_server import stock_answer

    def served_as_mlx_lm_generate(run_dir: Path) -> None:
        """`invoke serve` shards the run's base and adapter across the three nodes as it trained, and
        answers as stock `mlx_lm generate --adapter-path` does, token for token; Ctrl-C stops every
        rank on every node."""
        expected = stock_answer(tiny_quantized_model, run_dir, "Ahoy?", 12)
        with serving(cabled, "--run", str(run_dir)) as server:
            assert all(serve_pids(cabled, node) for node in (1, 2, 3))
            api = openai.OpenAI(base_url=f"http://127.0.0.1:{serve_port(cabled)}/v1", api_key="unused",
                                max_retries=0, timeout=120)
            question = [{"role": "user", "content": "Ahoy?"}]
            asked = api.chat.completions.create(model=run_dir.name, max_tokens=12, temperature=0,
                                                logprobs=True, messages=question)
            eos = {tiny_eos(tiny_quantized_model)}
            assert [t.id for t in asked.choices[0].logprobs.content if t.id not in eos] == expected.tokens
            server.send_signal(signal.SIGINT)
            _, stderr = server.communicate(timeout=90)
        assert server.returncode == 130, stderr[-3000:]
        wait_until_gone(serve_pids, cabled, (1, 2, 3))

    assert_tensor_qlora_is_one_process(cabled, tiny_quantized_model, tiny_inputs[1], tmp_path / "one", 3,
                                       then=served_as_mlx_lm_generate)


def test_mpi_trains_over_a_full_mesh_of_cables(cabled, tiny_inputs):
    # A ring of three is a full mesh: Open MPI may try any of a peer's addresses, and each is
    # routed across the cable to that peer.
    model_dir, data_dir = tiny_inputs
    proc = invoke_train(cabled, "--backend", "mpi", "--model", str(model_dir), "--data", str(data_dir),
                        "--iters", "4", "--batch-size", "3", "--extra", TINY_RUN + " --steps-per-eval 4",
                        timeout=600)
    run_dir = finished_run(proc)
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["world_size"] == 3 and summary["max_weight_difference_across_ranks"] == 0.0
        assert json.loads((run_dir / "run.json").read_text())["backend"] == "mpi"
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.mark.bench  # a measurement: invoke test --benches runs it, CI does not
def test_bench_links_measures_across_every_cable_and_names_it(cabled, tmp_path):
    out = tmp_path / "links.json"
    proc = subprocess.run([INVOKE, "bench.links", "-i", str(cabled.inventory), "--max-size", "1MB",
                           "--output", str(out)],
                          cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    # The backend training uses over per-cable networks; MPI is not tried there.
    assert list(result["backends"]) == ["ring"]
    labels = {" <-> ".join(link) for link in RING}
    assert {c["cable"] for c in result["cables"]} == labels
    pairs = result["backends"]["ring"]["pairs"]
    assert len(pairs) == 6 and all(p["bandwidth_gb_per_s"] > 0 and p["latency_us"] > 0 for p in pairs)
    for label in labels:
        assert label in proc.stdout, proc.stdout[-3000:]
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_a_pulled_cable_is_named_by_doctor_and_by_the_run_it_stops(cabled, tiny_inputs):
    hosts.set_cable(cabled.lab, "node2:en3", up=False)
    try:
        doctor = subprocess.run([INVOKE, "doctor", "-i", str(cabled.inventory), "--json"], cwd=REPO,
                                capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
        assert doctor.returncode != 0
        red = {(c["scope"], c["name"]): c for c in json.loads(doctor.stdout) if not c["ok"]}
        # Both ends: the pulled one, and the far one that lost its carrier.
        for scope, port in (("node2", "en3"), ("node3", "en2")):
            check = red[scope, f"interface {port} (cable node2:en3 <-> node3:en2)"]
            assert check["detail"].startswith("down: cable node2:en3 <-> node3:en2 unplugged")
            assert check["fix"].startswith("plug cable node2:en3 <-> node3:en2 in firmly")
        assert ("node1", "interface en2 (cable node1:en2 <-> node2:en2)") not in red
    finally:
        hosts.set_cable(cabled.lab, "node2:en3", up=True)

    model_dir, data_dir = tiny_inputs
    train = subprocess.Popen(
        [INVOKE, "train", "-i", str(cabled.inventory), "--backend", "ring", "--model", str(model_dir),
         "--data", str(data_dir), "--iters", "5000", "--batch-size", "3", "--extra",
         TINY_RUN + " --steps-per-eval 5000"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    assert train.stdout is not None
    try:
        for line in train.stdout:
            if line.split()[:2] == ["iter", "3/5000"]:
                break
        hosts.set_cable(cabled.lab, "node2:en3", up=False)
        cut = time.perf_counter()
        _, stderr = train.communicate(timeout=240)
        stopped = time.perf_counter() - cut
    finally:
        hosts.set_cable(cabled.lab, "node2:en3", up=True)
        train.kill()
    assert train.returncode != 0
    assert "cable node2:en3 <-> node3:en2" in stderr, stderr[-3000:]
    assert [finetune_pids(cabled, n) for n in (1, 2, 3)] == [[], [], []]
    arrived = re.search(r"what arrived is in (\S+/runs/\d{8}-\d{6}(?:-\d+)?)", stderr)
    shutil.rmtree(arrived[1], ignore_errors=True)
    print(f"node2:en3 pulled -> invoke train returned in {stopped:.1f} s")


RING_OF_FOUR = [["node1:en2", "node2:en2"], ["node2:en3", "node3:en2"], ["node3:en3", "node4:en2"],
                ["node4:en3", "node1:en3"]]


def test_a_fourth_mac_joins_the_ring_and_every_pair_goes_the_way_the_cables_allow(cabled, tiny_inputs):
    # Re-cabled as a user adds a Mac to a ring of three: node3's cable to node1 now goes to node4,
    # and node4's second cable to node1. node1 and node3 (node2 and node4) share no cable.
    assert hosts.up(4, TEST_LAB_ID, cables="ring") == cabled.inventory
    run = cabled.playbook()
    assert run.returncode == 0, json.dumps(run.failures, indent=1)
    record = json.loads((paths.build_dir_for(cabled.inventory) / "cluster.json").read_text())
    assert [[f"{e['host']}:{e['interface']}" for e in c["ends"]] for c in record["cables"]] == RING_OF_FOUR

    doctor = subprocess.run([INVOKE, "doctor", "-i", str(cabled.inventory), "--json"], cwd=REPO,
                            capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    checks = {(c["scope"], c["name"]): c for c in json.loads(doctor.stdout)}
    red = [c for c in checks.values() if not c["ok"]]
    assert doctor.returncode == 0 and red == [], red
    # A pair without a cable is reached over the management network, the others over their cable.
    for a, b in ((1, 3), (3, 1), (2, 4), (4, 2)):
        far = checks[f"node{a} -> node{b}", "ssh over the management network"]
        assert far["detail"].startswith(f"{cabled.lab.mgmt_ip(b)} "), far
    assert ("node1 -> node2", "ssh over the cluster link") in checks
    assert checks["cluster", "MLX all_sum over every rank"]["ok"]

    model_dir, data_dir = tiny_inputs
    inputs = ["--model", str(model_dir), "--data", str(data_dir), "--batch-size", "4"]
    # MPI needs every two nodes to reach each other over the cables: refused, with the reason.
    mpi = invoke_train(cabled, "--backend", "mpi", *inputs, "--iters", "2", timeout=300)
    assert mpi.returncode != 0
    refused = "no cable joins node1 <-> node3, node2 <-> node4 (use --backend ring"
    assert refused in mpi.stderr, mpi.stderr[-2000:]
    assert [finetune_pids(cabled, n) for n in (1, 2, 3, 4)] == [[], [], [], []]

    # Ring trains on the four; node3's rank killed once step 3 is saved leaves node1, node2 and
    # node4, whose cables make a line: the run goes on, MLX's ring closed over the management
    # network between node2 and node4.
    proc, stdout, stderr = killed_at_checkpoint(
        cabled, tiny_inputs, 3, "--batch-size", "4", "--iters", "8", step=3,
        settings=TINY_RUN + " --steps-per-eval 8 --save-every 3")
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    run_dir = run_dir_of(stdout)
    try:
        assert "==> backend ring: the cables make a ring" in stdout
        assert "==> node3 is left out (killed); restarting run " in stdout
        assert "from its checkpoint at step 3 on 3 ranks (node1, node2, node4)" in stdout
        assert ("==> backend ring: the cables of the nodes left make no ring: MLX's ring closes it over "
                "the management network between node2 and node4") in stdout, stdout[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["world_sizes"] == [4, 3] and summary["iterations"] == 8
        assert summary["max_weight_difference_across_ranks"] == 0.0
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
