"""invoke doctor's judgement (mlxcluster/check/doctor.py evaluate) and the node probe, on this machine."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import subprocess
import sys

import pytest
from rich.console import Console

from mlxcluster.check import doctor, room
from mlxcluster.check.doctor import Check
from mlxcluster.describe.cluster import Cluster

HOSTFILE = "10.0.0.1 slots=2\n10.0.0.2 slots=1\n"


def cluster() -> Cluster:
    def node(name, ip, slots):
        return {"name": name, "thunderbolt_ip": ip, "slots": slots, "thunderbolt_interface": "bridge0",
                "thunderbolt_prefix": 24, "thunderbolt_mtu": 9000, "cluster_root": "/opt/mlx-cluster",
                "venv": "/opt/mlx-cluster/venv", "env_file": "/opt/mlx-cluster/env.sh",
                "connection": {"type": "ssh", "host": f"{name}.mgmt", "user": "mlx"}}
    return Cluster.from_json({"launcher": "node1", "nodes": [node("node1", "10.0.0.1", 2),
                                                             node("node2", "10.0.0.2", 1)]})


def healthy() -> dict:
    def facts(name, ip, peer):
        return {"hostname": name, "os": "Linux", "openmpi": "4.1.4",
                "venv": {"python": "3.11.2", "mlx": "0.32.4", "mlx_lm": "0.32.2", "distributed": True},
                "hostfile": "# rendered\n" + HOSTFILE,
                "interfaces": {"bridge0": {"up": True, "mtu": 9000, "addresses": [f"{ip}/24"]}},
                "memory": {"total": 16 * 2**30, "available": 8 * 2**30}, "disk_free": 100 * 2**30,
                "ssh": {peer: {"ok": True, "error": None}}}
    return {"nodes": {"node1": facts("node1", "10.0.0.1", "10.0.0.2"),
                      "node2": facts("node2", "10.0.0.2", "10.0.0.1")},
            "jobs": {"hostname": (0, "node1\nnode2\nnode1\n"), "all_sum": (0, "3\n3\n3\n")}}


def failures(gathered: dict, model_bytes: int | None = 2**30) -> list[Check]:
    need = room.Need.whole(cluster(), model_bytes) if model_bytes else None
    return [c for c in doctor.evaluate(cluster(), HOSTFILE, gathered, need) if not c.ok]


def test_a_healthy_cluster_is_all_green():
    checks = doctor.evaluate(cluster(), HOSTFILE, healthy(), room.Need.whole(cluster(), 2**30))
    assert [c for c in checks if not c.ok] == []
    names = {c.name for c in checks}
    assert {"management ssh", "ssh over the cluster link", "Open MPI", "Python", "mlx", "mlx-lm",
            "venv", "hostfile", "interface bridge0", "free memory", "free disk",
            "mpirun -np 3 hostname", "MLX all_sum over every rank"} <= names
    pairs = {c.scope for c in checks if c.name == "ssh over the cluster link"}
    assert pairs == {"node1 -> node2", "node2 -> node1"}


@pytest.mark.parametrize(("os_family", "refused", "fix"), [
    # macOS's EHOSTUNREACH, as Local Network Privacy answers a Python it refuses (mlx #3755: "error: 65
    # (EHOSTUNREACH)" on a ring whose hosts all ping).
    ("Darwin", [65, "No route to host"], "macOS Local Network Privacy refuses the venv's Python"),
    ("Debian", [113, "No route to host"], "a firewall on either node refuses the venv's Python"),
])
def test_a_venv_python_refused_the_peer_that_ssh_reaches_is_named_with_its_fix(os_family, refused, fix):
    layout = cluster()
    gathered = healthy()
    gathered["nodes"]["node1"]["python_reach"] = {"10.0.0.2": refused}
    gathered["nodes"]["node2"]["python_reach"] = {"10.0.0.1": None}
    nodes = [dataclasses.replace(n, os_family=os_family) for n in layout.nodes]
    checks = doctor.evaluate(dataclasses.replace(layout, nodes=nodes), HOSTFILE, gathered, None)
    [bad] = [c for c in checks if not c.ok]
    assert (bad.scope, bad.name) == ("node1 -> node2", "the venv's Python reaches it")
    assert bad.detail == (f"10.0.0.2: errno {refused[0]} (No route to host) from the venv's Python, while "
                          "ssh reaches it")
    assert bad.fix.startswith(fix)
    [good] = [c for c in checks if c.scope == "node2 -> node1" and c.name == "the venv's Python reaches it"]
    assert good.ok


def test_an_unreachable_node_is_named_with_the_fix_and_not_judged_further():
    gathered = healthy()
    gathered["nodes"]["node2"] = {"unreachable": "ssh: connect to host node2.mgmt: No route to host"}
    gathered["jobs"] = {}
    [bad] = failures(gathered)
    assert (bad.scope, bad.name) == ("node2", "management ssh")
    assert "No route to host" in bad.detail and "ansible_host" in bad.fix


def test_a_broken_key_on_the_cluster_link_names_the_pair():
    gathered = healthy()
    gathered["nodes"]["node1"]["ssh"]["10.0.0.2"] = {
        "ok": False, "error": ["root@10.0.0.2: Permission denied (publickey)."]}
    [bad] = failures(gathered)
    assert bad.scope == "node1 -> node2" and "Permission denied" in bad.detail
    assert "invoke provision" in bad.fix and "ssh_mesh" in bad.fix


def test_a_version_mismatch_is_red_on_the_odd_node_and_says_what_the_others_have():
    gathered = healthy()
    gathered["nodes"]["node2"]["venv"]["mlx"] = "0.31.0"
    gathered["nodes"]["node2"]["openmpi"] = None
    bad = {(c.scope, c.name): c for c in failures(gathered)}
    assert set(bad) == {("node2", "mlx"), ("node2", "Open MPI")}
    assert bad["node2", "mlx"].detail == "0.31.0, but node1 0.32.4"
    assert "nodes must agree" in bad["node2", "mlx"].fix
    assert bad["node2", "Open MPI"].detail == "missing"


def test_a_package_of_the_venv_that_differs_or_is_missing_on_a_node_is_named():
    gathered = healthy()
    base = {"mlx": "0.32.4", "mlx-lm": "0.32.2", "numpy": "2.3.1", "xgboost-cpu": "3.1.2"}
    for name in ("node1", "node2"):
        gathered["nodes"][name]["venv"]["packages"] = dict(base)
    odd = gathered["nodes"]["node2"]["venv"]
    odd["mlx"] = odd["packages"]["mlx"] = "0.31.0"
    assert [c.name for c in failures(gathered)] == ["mlx"]  # the mlx check's: not said twice
    odd["mlx"] = odd["packages"]["mlx"] = "0.32.4"
    del gathered["nodes"]["node2"]["venv"]["packages"]["xgboost-cpu"]
    gathered["nodes"]["node2"]["venv"]["packages"]["numpy"] = "2.2.0"
    gathered["nodes"]["node2"]["venv"]["packages"]["stray"] = "1.0"
    [bad] = failures(gathered)
    assert (bad.scope, bad.name) == ("node2", "packages")
    # Two nodes: each is the other's majority; the first node's versions count as most nodes'.
    assert bad.detail == ("numpy 2.2.0 (others: 2.3.1); stray 1.0 (others: none); "
                          "xgboost-cpu missing (others: 3.1.2)")
    assert "python_env_extra_packages" in bad.fix


def test_a_down_interface_with_the_wrong_address_and_mtu():
    gathered = healthy()
    gathered["nodes"]["node2"]["interfaces"]["bridge0"] = {"up": False, "mtu": 1500, "addresses": []}
    [bad] = failures(gathered)
    assert bad.name == "interface bridge0"
    assert bad.detail == "down; has no address, not 10.0.0.2/24; MTU 1500, not 9000"
    assert "thunderbolt role" in bad.fix


def test_hostfile_drift_memory_and_disk():
    gathered = healthy()
    gathered["nodes"]["node1"]["hostfile"] = "10.0.0.1 slots=1\n"
    gathered["nodes"]["node2"]["memory"]["available"] = 2**29
    gathered["nodes"]["node2"]["disk_free"] = 2**30
    bad = {(c.scope, c.name) for c in failures(gathered)}
    assert bad == {("node1", "hostfile"), ("node2", "free memory"), ("node2", "free disk")}
    # Without a model there is nothing to measure memory and disk against.
    assert {(c.scope, c.name) for c in failures(gathered, None)} == {("node1", "hostfile")}


def test_a_mac_whose_gpu_may_wire_less_than_the_run_holds_is_told_to_raise_the_wired_limit():
    gathered = healthy()
    # 8 GiB free, but Metal's recommended working set (what mx.metal.device_info() says) is 1 GiB.
    gathered["nodes"]["node2"]["memory"]["gpu_limit"] = 2**30
    [bad] = failures(gathered, model_bytes=2**30)  # a rank holds more than its 1 GiB of weights
    assert (bad.scope, bad.name) == ("node2", "free memory")
    assert bad.detail.startswith("1.0 GiB the GPU may wire (8.0 GiB free), need ~")
    assert bad.fix.startswith("raise the GPU's wired limit (macos_gpu_wired_limit_mb in the inventory")
    # The same shortfall from free memory alone says nothing of the GPU.
    gathered = healthy()
    gathered["nodes"]["node2"]["memory"]["available"] = 2**30
    [bad] = failures(gathered, model_bytes=2**30)
    assert bad.detail.startswith("1.0 GiB free, need ~") and "wired" not in bad.fix


def test_mpi_jobs_must_see_every_slot():
    gathered = healthy()
    gathered["jobs"]["hostname"] = (0, "node1\nnode1\n")
    gathered["jobs"]["all_sum"] = (1, "MPI_Init failed")
    bad = {c.name: c for c in failures(gathered)}
    assert set(bad) == {"mpirun -np 3 hostname", "MLX all_sum over every rank"}
    assert "MPI_Init failed" in bad["MLX all_sum over every rank"].detail


def test_render_prints_a_table_per_node_and_one_for_the_pairs():
    gathered = copy.deepcopy(healthy())
    gathered["nodes"]["node2"]["venv"]["mlx"] = "0.31.0"
    out = io.StringIO()
    doctor.render(doctor.evaluate(cluster(), HOSTFILE, gathered, None), Console(file=out, width=200))
    text = out.getvalue()
    assert "node1" in text and "node2" in text and "node pairs (cluster link)" in text
    assert "FAIL" in text and "nodes must agree" in text


def test_the_probe_runs_with_the_standard_library_and_reports_what_it_cannot_find(tmp_path):
    args = {"cluster_root": str(tmp_path / "root"), "venv": str(tmp_path / "venv"),
            "interfaces": ["lo"], "peers": []}
    proc = subprocess.run([sys.executable, "-I", "-", json.dumps(args)], input=doctor.PROBE.read_text(),
                          capture_output=True, text=True, check=True)
    facts = json.loads(proc.stdout)
    assert facts["venv"] == {"error": f"{tmp_path / 'venv' / 'bin' / 'python'} does not exist"}
    assert facts["hostfile"] is None
    assert facts["interfaces"]["lo"]["up"] and "127.0.0.1/8" in facts["interfaces"]["lo"]["addresses"]
    assert facts["interfaces"]["lo"]["loopback"] is True
    assert facts["memory"]["available"] > 0 and facts["disk_free"] > 0


def test_loopback_keeps_its_own_mtu():
    """The single-machine inventory runs over lo, which the thunderbolt role leaves alone."""
    gathered = healthy()
    gathered["nodes"]["node1"]["interfaces"]["bridge0"].update(mtu=65536, loopback=True)
    assert failures(gathered) == []


def test_a_node_with_no_venv_recorded_is_told_to_provision():
    bare = Cluster.from_json({"launcher": "node1", "nodes": [
        {**dataclasses.asdict(n), "venv": None} if n.name == "node2" else dataclasses.asdict(n)
        for n in cluster().nodes]})
    gathered = healthy()
    gathered["nodes"]["node2"]["venv"] = {"error": "bin/python does not exist"}
    red = [c for c in doctor.evaluate(bare, HOSTFILE, gathered, room.Need.whole(bare, 2**30)) if not c.ok]
    assert ("node2", "venv", "none recorded: not provisioned yet") in [
        (c.scope, c.name, c.detail) for c in red]
    # Python, mlx and mlx-lm are missing there too: every red check says to provision.
    assert {c.scope for c in red} == {"node2"} and all("invoke provision" in c.fix for c in red)


def test_macs_on_a_ring_without_rdma_show_it_unused_and_the_bridge_service_must_be_off():
    from tests.unit.mlxcluster.describe.test_backends import RING4, cabled

    ring = cabled(RING4, {})
    facts = {n.name: {"macos": {"version": "26.2", "rdma": "disabled", "rdma_devices": [],
                                "bridge_service": "Disabled" if n.name != "mac2" else "Enabled"}}
             for n in ring.nodes}
    checks = {(c.scope, c.name): c for c in doctor._macs(ring, ring.nodes, facts)}
    assert checks["mac1", "RDMA"] == Check("mac1", "RDMA", True,
                                           "not used by the ring backend (rdma_ctl status: disabled)")
    assert [key for key, c in checks.items() if not c.ok] == [("mac2", "Thunderbolt Bridge service")]
    # Linux nodes and Macs on the bridge are not probed for any of it.
    assert doctor._macs(ring, ring.nodes, {n.name: {} for n in ring.nodes}) == []


def test_a_mac_is_asked_about_its_own_bridge_service_by_the_name_the_inventory_gives():
    import dataclasses
    import shlex

    from tests.unit.mlxcluster.describe.test_backends import RING4, cabled

    ring = cabled(RING4, {})
    renamed = dataclasses.replace(ring.nodes[1], bridge_service="TB Bridge (office)")
    for node, service in ((ring.nodes[0], "Thunderbolt Bridge"), (renamed, "TB Bridge (office)")):
        args = json.loads(shlex.split(doctor.probe_command(ring, node)[-1])[-1])
        assert args["macos_links"] == service
    bridge = dataclasses.replace(ring, cables=())
    assert json.loads(shlex.split(doctor.probe_command(bridge, ring.nodes[0])[-1])[-1])["macos_links"] is None
