"""The lab's naming and the inventory it writes (bringing hosts up is in tests/cluster)."""

from __future__ import annotations

import pytest
import yaml

from mlxcluster.describe.inventory import inventory_errors
from mlxcluster.lab import hosts


def test_labs_do_not_share_names_or_addresses():
    a, b = hosts.Lab(0), hosts.Lab(5)
    assert a.netns(1) != b.netns(1) and a.mgmt_bridge != b.mgmt_bridge
    assert (a.mgmt_ip(2), a.tb_ip(2)) == ("10.77.0.12", "10.78.0.12")
    assert b.mgmt_ip(2) == "10.77.5.12"
    assert max(len(n) for n in (b.netns(9), b.mgmt_bridge, b.tb_bridge)) <= 15  # IFNAMSIZ


def test_lab_id_out_of_range_is_refused():
    with pytest.raises(hosts.LabError, match="lab id must be 0-9"):
        hosts.Lab(10)


def test_written_inventory_is_valid_and_pins_the_lab_host_keys(tmp_path, monkeypatch):
    monkeypatch.setattr(hosts, "LAB_ROOT", tmp_path)
    the_lab = hosts.Lab(3)
    path = hosts.write_inventory(the_lab, [1, 2, 3])
    inventory = yaml.safe_load(path.read_text())
    linux = inventory["cluster"]["children"]["linux"]["hosts"]
    assert list(linux) == ["node1", "node2", "node3"]
    assert list(inventory["launcher"]["hosts"]) == ["node1"]
    settings = inventory["cluster"]["vars"]
    assert settings["ansible_ssh_common_args"] == f"-o UserKnownHostsFile={the_lab.known_hosts}"
    assert "StrictHostKeyChecking" not in path.read_text()
    assert not (path.parent / "group_vars").exists()  # one file: a copy is a whole inventory
    groups = {"cluster": list(linux), "linux": list(linux), "launcher": ["node1"]}
    hostvars = {h: {**v, "thunderbolt_interface": settings["thunderbolt_interface"]}
                for h, v in linux.items()}
    assert inventory_errors(groups, hostvars) == []

