from __future__ import annotations

from pathlib import Path

from mlxcluster import ansible, paths

REPO = Path(__file__).resolve().parents[2]


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
        "node1": {"ok": 40, "changed": 0, "unreachable": 0, "failed": 0},
        "node2": {"ok": 38, "changed": 3, "unreachable": 1, "failed": 0},
    }
