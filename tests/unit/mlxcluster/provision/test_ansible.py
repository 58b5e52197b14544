from __future__ import annotations

from pathlib import Path

from mlxcluster import paths
from mlxcluster.provision import ansible

REPO = Path(__file__).resolve().parents[4]


def test_provision_runs_site_yml_and_renders_into_the_inventorys_build_folder():
    cmd = ansible.provision(REPO / "inventory/local/hosts.yml", check=True, tags="ssh")
    assert cmd[:4] == ["ansible-playbook", "-i", str(REPO / "inventory/local/hosts.yml"),
                       str(REPO / "site.yml")]
    assert ["-e", f"hostfile_build_dir={REPO / 'build' / 'local'}"] == cmd[4:6]
    assert "--check" in cmd
    assert cmd[cmd.index("--tags") + 1] == "ssh"


def test_build_folders_differ_per_inventory(tmp_path):
    lab = tmp_path / "lab3" / "inventory"
    lab.mkdir(parents=True)
    (lab / "hosts.yml").touch()
    assert paths.build_dir_for(lab / "hosts.yml") == REPO / "build" / "lab3"
    assert paths.build_dir_for(REPO / "inventory/hosts.yml") == REPO / "build" / "hosts"
    assert paths.build_dir_for(REPO / "inventory/local/hosts.yml") == REPO / "build" / "local"


def test_parse_recap_reads_every_host():
    out = """
PLAY RECAP *********************************************************************
node1                      : ok=40   changed=0    unreachable=0    failed=0    skipped=9
node2                      : ok=38   changed=3    unreachable=1    failed=0    skipped=9
"""
    assert ansible.parse_recap(out) == {
        "node1": {"ok": 40, "changed": 0, "unreachable": 0, "failed": 0, "skipped": 9},
        "node2": {"ok": 38, "changed": 3, "unreachable": 1, "failed": 0, "skipped": 9},
    }


def test_parse_profile_reads_the_tasks_recap_slowest_first():
    out = """
TASK [hostfile : Render] *******************************************************
ok: [node1]
TASKS RECAP ********************************************************************
Monday 23 November 2026  12:05:48 +0000 (0:00:04.294)       0:04:40.537 *******
===============================================================================
python_env : Install the pinned packages into the virtual environment -- 14.38s
ssh_mesh : Pin every node's host key under each of its names ----------- 21.71s
Read the installed Debian packages ------------------------------------- 0.10s
"""
    assert ansible.parse_profile(out) == [
        ("ssh_mesh : Pin every node's host key under each of its names", 21.71),
        ("python_env : Install the pinned packages into the virtual environment", 14.38),
        ("Read the installed Debian packages", 0.10),
    ]
    assert ansible.parse_profile("PLAY RECAP") == []


def test_timed_run_counts_tasks_per_host_and_changes():
    run = ansible.TimedRun(1.0, {"node1": {"ok": 40, "changed": 2, "unreachable": 0,
                                           "failed": 0, "skipped": 9}}, [])
    assert run.tasks_per_host() == {"node1": 49} and run.changed() == 2
