"""A dry run before provisioning (mlxcluster/provision/preview.py): the layout from the inventory
alone, through the real render playbook, and validation's refusal shown alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[4]
INVOKE = str(Path(sys.executable).parent / "invoke")


def links_inventory(tmp_path: Path, **node_vars: dict) -> Path:
    hosts = {f"n{i}": {"ansible_host": f"10.9.0.{i}", **node_vars.get(f"n{i}", {})} for i in (1, 2, 3, 4)}
    inventory = {
        "cluster": {"children": {"linux": {"hosts": hosts}},
                    "vars": {"thunderbolt_topology": "links", "thunderbolt_link_pool": "10.0.0.0/8",
                             "thunderbolt_links": [["n1:en2", "n2:en2"], ["n2:en3", "n3:en2"],
                                                   ["n3:en3", "n4:en2"], ["n4:en3", "n1:en3"]]}},
        "launcher": {"hosts": {"n1": None}},
    }
    path = tmp_path / "inventory" / "hosts.yml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(inventory))
    return path


def dry_run(inventory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([INVOKE, "train", "-i", str(inventory), "--dry-run"], cwd=REPO,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)


def test_a_dry_run_shows_validations_refusal_alone_with_every_problem(tmp_path):
    inventory = links_inventory(tmp_path, n2={"batch_share": 0},
                                n3={"batch_share": "fast", "max_micro_batch": -1})
    proc = dry_run(inventory)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "The inventory has problems; fix them and run again:",
        "thunderbolt_link_pool 10.0.0.0/8 holds the management address of n1 (10.9.0.1), n2 (10.9.0.2), "
        "n3 (10.9.0.3), n4 (10.9.0.4): the cables' /30s would take it over; choose a pool outside the "
        "network Ansible reaches the nodes on (the default is 192.168.200.0/24)",
        "n2: batch_share 0 must be a positive number (its ranks' weight beside the other nodes', e.g. 3 "
        "beside 1) or auto (from invoke bench.calibrate)",
        "n3: batch_share 'fast' must be a positive number (its ranks' weight beside the other nodes', "
        "e.g. 3 beside 1) or auto (from invoke bench.calibrate)",
        "n3: max_micro_batch -1 must be a whole number of examples, at least 0 (0: no limit)",
    ]


def test_a_ring_of_four_plans_on_the_inventory_alone(tmp_path):
    inventory = links_inventory(tmp_path)
    text = inventory.read_text().replace("10.0.0.0/8", "192.168.200.0/24")
    inventory.write_text(text)
    proc = dry_run(inventory)
    assert proc.returncode == 0, proc.stderr
    assert "# backend ring: the cables make a ring" in proc.stdout
