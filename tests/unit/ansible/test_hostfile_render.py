"""`invoke hostfile`: the real render playbook on inventories written by the test."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml

from mlxcluster.provision import ansible

REPO = Path(__file__).resolve().parents[3]


def write_inventory(tmp_path: Path, hosts: dict, launcher: str) -> Path:
    inventory = {
        "cluster": {"children": {"macs": {"hosts": hosts}, "linux": {"hosts": {}}}},
        "launcher": {"hosts": {launcher: None}},
    }
    path = tmp_path / "inventory" / "hosts.yml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(inventory))
    return path


def render(tmp_path: Path, inventory: Path, env: dict) -> subprocess.CompletedProcess:
    out = tmp_path / "out"
    return subprocess.run(ansible.render_hostfiles(inventory, out), cwd=REPO, env=env,
                          capture_output=True, text=True)


def test_hostfile_lists_launcher_first_and_leaves_out_zero_slot_hosts(tmp_path, tool_env):
    inventory = write_inventory(tmp_path, {
        "mac1": {"ansible_host": "mac1.local", "thunderbolt_ip": "192.168.200.1"},
        "mac2": {"ansible_host": "mac2.local", "thunderbolt_ip": "192.168.200.2",
                 "mpi_slots": 2},
        "spare": {"ansible_host": "spare.local", "thunderbolt_ip": "192.168.200.3",
                  "mpi_slots": 0},
    }, launcher="mac2")
    proc = render(tmp_path, inventory, tool_env)
    assert proc.returncode == 0, proc.stdout
    lines = [line for line in (tmp_path / "out" / "hostfile").read_text().splitlines()
             if not line.startswith("#")]
    assert lines == ["192.168.200.2 slots=2", "192.168.200.1 slots=1"]
    hosts = json.loads((tmp_path / "out" / "hosts.json").read_text())
    assert hosts["backend"] == "ring"
    assert [h["ips"] for h in hosts["hosts"]] == [["192.168.200.2"], ["192.168.200.2"],
                                                  ["192.168.200.1"]]
    assert all(h["ssh"] == h["ips"][0] for h in hosts["hosts"])


def test_bad_inventory_is_rejected_and_nothing_is_written(tmp_path, tool_env):
    inventory = write_inventory(tmp_path, {
        "mac1": {"ansible_host": "mac1.local", "thunderbolt_ip": "192.168.200.1"},
        "mac2": {"ansible_host": "mac2.local", "thunderbolt_ip": "192.168.200.1"},
    }, launcher="mac1")
    proc = render(tmp_path, inventory, tool_env)
    assert proc.returncode != 0
    assert "thunderbolt_ip 192.168.200.1 is used by both mac1 and mac2" in proc.stdout
    assert not (tmp_path / "out").exists()


def test_shipped_inventories_validate_and_render(tmp_path, tool_env):
    for inventory in ("inventory/example/hosts.yml", "inventory/local/hosts.yml"):
        proc = render(tmp_path, REPO / inventory, tool_env)
        assert proc.returncode == 0, proc.stdout
    local = (tmp_path / "out" / "hostfile").read_text()
    assert "127.0.0.1 slots=2" in local
