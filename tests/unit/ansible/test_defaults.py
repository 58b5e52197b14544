"""The shipped defaults (playbooks/group_vars/all) reach every inventory, wherever it lives, and
everything the user writes wins over them: the real render playbook and site.yml, no mocks."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from mlxcluster import paths
from mlxcluster.provision import ansible

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "inventory" / "example" / "hosts.yml"


def ranks(hostfile: Path) -> list[str]:
    return [line for line in hostfile.read_text().splitlines() if not line.startswith("#")]


def render(inventory: Path, out: Path, env: dict, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([*ansible.render_hostfiles(inventory, out), *extra], cwd=REPO,
                          env=env, capture_output=True, text=True)


def test_the_example_copied_anywhere_renders_with_the_documented_defaults(tmp_path, tool_env):
    copy = tmp_path / "clusters" / "studio" / "hosts.yml"  # as docs/inventory.md says: no group_vars
    copy.parent.mkdir(parents=True)
    shutil.copy(EXAMPLE, copy)
    proc = render(copy, tmp_path / "out", tool_env)
    assert proc.returncode == 0, proc.stdout  # no "mac1: no thunderbolt_interface"
    assert ranks(tmp_path / "out" / "hostfile") == ["192.168.200.1 slots=1",
                                                    "192.168.200.2 slots=1"]
    hosts = json.loads((tmp_path / "out" / "hosts.json").read_text())
    assert [h["ips"] for h in hosts["hosts"]] == [["192.168.200.1"], ["192.168.200.2"]]
    assert paths.build_dir_for(copy) == REPO / "build" / "studio"


def test_group_host_and_extra_vars_win_over_the_shipped_defaults(tmp_path, tool_env):
    inventory = yaml.safe_load(EXAMPLE.read_text())
    inventory["cluster"]["vars"]["mpi_slots"] = 2
    inventory["cluster"]["children"]["macs"]["hosts"]["mac2"].pop("mpi_slots")
    inventory["cluster"]["children"]["macs"]["hosts"]["mac1"].pop("mpi_slots")
    inventory["cluster"]["children"]["linux"] = {
        "hosts": {"box": {"thunderbolt_ip": "192.168.200.3", "mpi_slots": 4}},
        # The Linux group's MTU reaches the inventory check: it no longer matches the Macs'.
        "vars": {"thunderbolt_interface": "enp0s20f0u1", "thunderbolt_mtu": 9000}}
    path = tmp_path / "studio" / "hosts.yml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(inventory))
    proc = render(path, tmp_path / "out", tool_env)
    assert proc.returncode != 0
    message = " ".join(proc.stdout.split())
    assert "thunderbolt_mtu differs between the nodes" in message
    assert "9000: box" in message and "1500: mac1, mac2" in message
    proc = render(path, tmp_path / "out", tool_env, "-e", "thunderbolt_mtu=9000")
    assert proc.returncode == 0, proc.stdout
    assert sorted(ranks(tmp_path / "out" / "hostfile")) == [
        "192.168.200.1 slots=2", "192.168.200.2 slots=2", "192.168.200.3 slots=4"]
    proc = render(path, tmp_path / "out", tool_env, "-e", "thunderbolt_mtu=9000",
                  "-e", "mpi_slots=1")
    assert proc.returncode == 0, proc.stdout
    assert sorted(ranks(tmp_path / "out" / "hostfile")) == [
        "192.168.200.1 slots=1", "192.168.200.2 slots=1", "192.168.200.3 slots=1"]


def test_without_the_repo_precedence_the_check_says_how_to_fix_it(tmp_path, tool_env):
    env = {**tool_env, "ANSIBLE_PRECEDENCE": "all_inventory,groups_inventory,"
           "all_plugins_inventory,all_plugins_play,groups_plugins_inventory,groups_plugins_play"}
    proc = render(EXAMPLE, tmp_path / "out", env)
    assert proc.returncode != 0
    message = " ".join(proc.stdout.split())
    assert "the shipped defaults in playbooks/group_vars/all would override your inventory's " \
        "group vars" in message.replace("''", "'")
    assert "point ANSIBLE_CONFIG at it (and unset ANSIBLE_PRECEDENCE)" in message
    assert not (tmp_path / "out").exists()


def test_a_cluster_in_its_own_folder_renders_into_its_own_build_folder(tmp_path, tool_env):
    name = f"pytest-{tmp_path.name}"
    path = tmp_path / "inventory" / name / "hosts.yml"
    path.parent.mkdir(parents=True)
    shutil.copy(EXAMPLE, path)
    build = REPO / "build" / name
    try:
        proc = subprocess.run([f"{REPO}/.venv/bin/invoke", "hostfile", "-i", str(path)],
                              cwd=REPO, env=tool_env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert ranks(build / "hostfile") == ["192.168.200.1 slots=1", "192.168.200.2 slots=1"]
        assert (build / "hosts.json").exists()
    finally:
        shutil.rmtree(build, ignore_errors=True)


@pytest.fixture
def studio(tmp_path: Path) -> Path:
    """Two "nodes" that are this machine (local connection), Debian like it, each with its
    own cluster_root under tmp_path: site.yml can provision their hostfiles for real."""
    node = {"ansible_connection": "local"}
    inventory = {
        "cluster": {
            "children": {
                "linux": {
                    "hosts": {
                        "studio-a": {**node, "thunderbolt_ip": "127.0.0.1",
                                     "cluster_root": str(tmp_path / "a")},
                        "studio-b": {**node, "thunderbolt_ip": "127.0.0.2",
                                     "cluster_root": str(tmp_path / "b"), "mpi_slots": 3},
                    },
                    "vars": {"thunderbolt_interface": "enp0s20f0u1"},
                },
                "macs": {"hosts": {}},
            },
            "vars": {"mpi_slots": 2, "thunderbolt_prefix": 8,
                     "ansible_python_interpreter": "{{ ansible_playbook_python }}"},
        },
        "launcher": {"hosts": {"studio-a": None}},
    }
    path = tmp_path / "inventory" / "studio" / "hosts.yml"
    path.parent.mkdir(parents=True)
    path.write_text(yaml.safe_dump(inventory))
    return path


def test_provisioning_records_the_inventory_values_not_the_defaults(studio, tmp_path, tool_env):
    build = tmp_path / "build"
    cmd = ansible.ansible_playbook(
        REPO / "site.yml", studio, tags="hostfile",
        extra_vars={"hostfile_build_dir": str(build), "thunderbolt_mtu": "9000"})
    # The fact cache is keyed by host name: keep this machine's facts out of it.
    env = {**tool_env, "ANSIBLE_CACHE_PLUGIN": "memory"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    nodes = json.loads((build / "cluster.json").read_text())["nodes"]
    assert [(n["name"], n["slots"], n["thunderbolt_interface"], n["thunderbolt_prefix"],
             n["thunderbolt_mtu"], n["cluster_root"]) for n in nodes] == [
        ("studio-a", 2, "enp0s20f0u1", 8, 9000, str(tmp_path / "a")),
        ("studio-b", 3, "enp0s20f0u1", 8, 9000, str(tmp_path / "b")),
    ]
    for node in ("a", "b"):
        assert ranks(tmp_path / node / "hostfile") == ["127.0.0.1 slots=2", "127.0.0.2 slots=3"]


def test_an_unsafe_cluster_root_stops_every_node_before_anything_changes(studio, tmp_path, tool_env):
    inventory = yaml.safe_load(studio.read_text())
    bad = str(tmp_path / "my root")  # a space: old rsync would split the remote path there
    inventory["cluster"]["children"]["linux"]["hosts"]["studio-b"]["cluster_root"] = bad
    studio.write_text(yaml.safe_dump(inventory))
    cmd = ansible.ansible_playbook(REPO / "site.yml", studio, tags="hostfile",
                                   extra_vars={"hostfile_build_dir": str(tmp_path / "build")})
    proc = subprocess.run(cmd, cwd=REPO, env={**tool_env, "ANSIBLE_CACHE_PLUGIN": "memory"},
                          capture_output=True, text=True)
    assert proc.returncode != 0
    message = " ".join(proc.stdout.split())
    assert f"studio-b: cluster_root '{bad}' is not an absolute path of plain characters" in message
    assert "/opt/mlx-cluster" in message
    # Neither node got anything: the check runs before the roles, and stops every node.
    assert not (tmp_path / "a").exists() and not (tmp_path / "my root").exists()


@pytest.mark.parametrize("text", ["", "- node1\n- node2\n", "cluster: [n1]\n", "all:\n  hosts: {}\n"],
                         ids=["empty", "a-list", "cluster-a-list", "no-cluster-group"])
def test_an_inventory_without_cluster_hosts_is_refused_not_a_silent_success(tmp_path, tool_env, text):
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(text)
    cmd = ansible.ansible_playbook(REPO / "site.yml", inventory)
    proc = subprocess.run(cmd, cwd=REPO, env=tool_env, capture_output=True, text=True)
    assert proc.returncode != 0
    message = " ".join(proc.stdout.split())
    assert f"The inventory ({inventory}) has no hosts in group `cluster`" in message
    assert "inventory/example/hosts.yml" in message


def test_an_ssh_option_as_ansible_host_is_refused_before_ssh_runs(studio, tmp_path, tool_env):
    inventory = yaml.safe_load(studio.read_text())
    pwned = tmp_path / "pwned"
    node = inventory["cluster"]["children"]["linux"]["hosts"]["studio-b"]
    node.update(ansible_connection="ssh", ansible_host=f"-oProxyCommand=touch {pwned}")
    studio.write_text(yaml.safe_dump(inventory))
    proc = subprocess.run(ansible.ansible_playbook(REPO / "site.yml", studio), cwd=REPO,
                          env={**tool_env, "ANSIBLE_CACHE_PLUGIN": "memory"}, capture_output=True, text=True)
    assert proc.returncode != 0
    assert "studio-b: ansible_host '-oProxyCommand=touch" in " ".join(proc.stdout.split())
    assert not pwned.exists() and not (tmp_path / "a").exists()


def test_an_undefined_variable_in_a_host_setting_is_named_with_its_host(tmp_path, tool_env):
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({
        "cluster": {"children": {"macs": {"hosts": {
            "mac1": {"thunderbolt_ip": "192.168.200.1"},
            "mac2": {"thunderbolt_ip": "{{ undefined_address }}"}}}}},
        "launcher": {"hosts": {"mac1": None}}}))
    proc = render(inventory, tmp_path / "out", tool_env)
    assert proc.returncode != 0
    message = " ".join(proc.stdout.split())
    assert "mac2: thunderbolt_ip cannot be resolved ('undefined_address' is undefined)" in message
    assert not (tmp_path / "out").exists()
