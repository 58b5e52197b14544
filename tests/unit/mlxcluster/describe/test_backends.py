"""`--backend auto` (mlxcluster/describe/backends.py) and what a launch does with the choice
(mlxcluster/launch/builder.py): JACCL on a full mesh where every cabled port has RDMA, then jaccl-ring,
then ring, MPI on a bridge; the record keeps the choice and why; a JACCL launch writes MLX's
own hosts file for it."""

from __future__ import annotations

import json
import shlex

import pytest

from mlxcluster.describe import addresses, record
from mlxcluster.describe.backends import choose
from mlxcluster.describe.cluster import Cluster
from mlxcluster.errors import UserError
from mlxcluster.launch import builder

RING4 = [["mac1:en2", "mac2:en2"], ["mac2:en3", "mac3:en2"], ["mac3:en3", "mac4:en2"],
         ["mac4:en3", "mac1:en3"]]
MESH3 = [["mac1:en2", "mac2:en2"], ["mac2:en3", "mac3:en2"], ["mac3:en3", "mac1:en3"]]
ALL_PORTS = ["rdma_en2", "rdma_en3", "rdma_en4"]


def cabled(links: list[list[str]], rdma: dict[str, list[str] | None], backend: dict | None = None) -> Cluster:
    """A recorded cluster of Macs cabled as `links`, with each one's RDMA devices."""
    hosts = sorted({end.split(":")[0] for cable in links for end in cable})
    view = {h: {"thunderbolt_links": links, "thunderbolt_link_pool": "192.168.200.0/24",
                "ansible_host": f"mac{i}.local", "mpi_slots": 1} for i, h in enumerate(hosts, 1)}
    order = addresses.rank_order(hosts, "mac1", view)
    nodes = [{"name": h, "thunderbolt_ip": addresses.contact_address(h, hosts, "mac1", view), "slots": 1,
              "os_family": "Darwin", "cluster_root": "/opt/mlx", "venv": "/opt/mlx/venv",
              "env_file": "/opt/mlx/env.sh", "rdma_devices": rdma.get(h), "management_ip": f"10.0.0.{i}",
              "connection": {"host": f"{h}.local"}} for i, h in enumerate(order, 1)]
    data = {"launcher": "mac1", "nodes": nodes,
            "cables": record.cables_of({"cluster": hosts, "launcher": ["mac1"]}, view)}
    return Cluster.from_json(data | ({"backend": backend} if backend else {}))


def test_auto_prefers_jaccl_on_a_full_mesh_with_rdma_then_jaccl_ring_then_ring():
    mesh = cabled(MESH3, dict.fromkeys(["mac1", "mac2", "mac3"], ALL_PORTS))
    assert mesh.backend_choice().backend == "jaccl"
    ring = cabled(RING4, dict.fromkeys(["mac1", "mac2", "mac3", "mac4"], ALL_PORTS))
    assert ring.backend_choice() == choose("links", ["mac1", "mac2", "mac3", "mac4"], ring.links(),
                                           {n.name: n.rdma_devices for n in ring.nodes})
    assert ring.backend_choice().backend == "jaccl-ring"
    # One port without its device (en3 of mac4) is enough to fall back to TCP, and is named.
    partial = cabled(RING4, {**dict.fromkeys(["mac1", "mac2", "mac3"], ALL_PORTS), "mac4": ["rdma_en2"]})
    choice = partial.backend_choice()
    assert choice.backend == "ring"
    assert choice.why.startswith("the cables make a ring; no RDMA on mac4:en3 for JACCL (enable RDMA")


def test_auto_names_at_most_four_ports_without_rdma_and_on_a_bridge_is_mpi():
    none = cabled(RING4, {mac: [] for mac in ["mac1", "mac2", "mac3", "mac4"]})
    assert "no RDMA on mac1:en2, mac2:en2, mac2:en3, mac3:en2 and 4 more" in none.backend_choice().why
    unread = cabled(RING4, {"mac1": ALL_PORTS, "mac2": ALL_PORTS})
    assert unread.backend_choice().why.startswith("the cables make a ring; RDMA is not known on mac3, "
                                                  "mac4 (JACCL needs Macs")
    bridge = Cluster.from_json({"launcher": "a", "nodes": [{"name": "a", "thunderbolt_ip": "10.0.0.1",
                                                            "slots": 1}]})
    assert bridge.backend_choice().backend == "mpi"
    assert bridge.backend_choice().why.startswith("one network joins every node")
    assert bridge.backend_choice("ring").why == "asked for (--backend)"


def test_the_recorded_choice_is_what_auto_means_and_a_named_backend_wins():
    recorded = cabled(MESH3, {}, backend={"name": "ring", "why": "cluster_backend in the inventory"})
    assert builder.choice_for(recorded, None).why == "cluster_backend in the inventory"
    assert builder.choice_for(recorded, "auto").backend == "ring"
    # MPI runs over a full mesh of cables (every node reaches every other across its own cable),
    # not over a ring of four, where two pairs share no cable.
    assert builder.choice_for(recorded, "mpi").backend == "mpi"
    with pytest.raises(UserError, match="no cable joins mac1 <-> mac3, mac2 <-> mac4"):
        builder.choice_for(cabled(RING4, {}), "mpi")


def test_a_jaccl_launch_writes_mlxs_hosts_file_and_starts_the_venv_s_launcher_with_it():
    ring = cabled(RING4, dict.fromkeys(["mac1", "mac2", "mac3", "mac4"], ALL_PORTS))
    job = builder.Job(["python", "-m", "training.finetune"], backend=builder.backend_for(ring, None))
    line = builder.command(ring, job)[-1]
    written = json.loads(shlex.split(line.split(" > ")[0])[-1])
    # MLX's format: each rank's RDMA device towards its ring neighbours (None elsewhere), and
    # rank 0's management address, where the ranks meet.
    assert written["backend"] == "jaccl-ring"
    assert [h["rdma"] for h in written["hosts"]] == [
        [None, "rdma_en2", None, "rdma_en3"], ["rdma_en2", None, "rdma_en3", None],
        [None, "rdma_en2", None, "rdma_en3"], ["rdma_en3", None, "rdma_en2", None]]
    assert written["hosts"][0]["ips"] == ["10.0.0.1"]
    # The launcher reaches its neighbours over their cables, mac3 (no cable to it) by name.
    assert [h["ssh"] for h in written["hosts"]] == [
        ring.head.thunderbolt_ip, "192.168.200.2", "mac3.local", "192.168.200.13"]
    hosts_file = "/opt/mlx/work/jaccl-hosts.json"
    assert f"/opt/mlx/venv/bin/mlx-cluster-launch --backend jaccl-ring --hostfile {hosts_file}" in line


def test_a_jaccl_hosts_file_carries_the_envs_provisioning_rendered(tmp_path):
    from mlxcluster.describe.cluster import Recorded

    mesh = cabled(MESH3, dict.fromkeys(["mac1", "mac2", "mac3"], ALL_PORTS))
    rec = Recorded("inventory/macs.yml", mesh, tmp_path)
    assert rec.mlx_envs == []  # not provisioned yet: nothing rendered
    (tmp_path / "hosts.json").write_text(json.dumps({"backend": "ring", "envs": ["MLX_X=1"], "hosts": []}))
    job = builder.Job(["python", "-m", "training.finetune"], backend="jaccl", mlx_envs=rec.mlx_envs)
    line = builder.command(mesh, job)[-1]
    written = json.loads(shlex.split(line.split(" > ")[0])[-1])
    assert written["backend"] == "jaccl" and written["envs"] == ["MLX_X=1"]


def test_jaccl_asked_for_without_rdma_or_off_a_full_mesh_is_refused_with_the_fix():
    no_rdma = cabled(MESH3, {"mac1": ALL_PORTS, "mac2": ALL_PORTS, "mac3": None})
    with pytest.raises(UserError, match=r"no RDMA device on mac3:en2, mac3:en3 .*rdma_ctl enable"):
        builder.choice_for(no_rdma, "jaccl")
    ring = cabled(RING4, dict.fromkeys(["mac1", "mac2", "mac3", "mac4"], ALL_PORTS))
    with pytest.raises(UserError, match="JACCL's mesh needs a cable between every two nodes"):
        builder.choice_for(ring, "jaccl")
    bridge = Cluster.from_json({"launcher": "a", "nodes": [{"name": "a", "thunderbolt_ip": "10.0.0.1",
                                                            "slots": 1}, {"name": "b", "thunderbolt_ip":
                                                                          "10.0.0.2", "slots": 1}]})
    with pytest.raises(UserError, match="needs per-cable networks"):
        builder.choice_for(bridge, "jaccl-ring")


def test_the_record_says_which_backend_auto_means_and_why():
    seen = [record.Seen(settings={"name": "a", "thunderbolt_ip": "10.0.0.1", "slots": 1})]
    assert record.record("a", seen, None)["backend"]["name"] == "mpi"
    assert record.record("a", seen, None, asked="ring")["backend"] == {
        "name": "ring", "why": "cluster_backend in the inventory"}
