from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

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


DOCUMENT = {
    "plays": [{"play": {"name": "site"}, "tasks": [
        {"task": {"name": "python_env : Install the pinned packages",
                  "duration": {"start": "2026-11-27T20:00:00.000000Z", "end": "2026-11-27T20:00:14.380000Z"}},
         "hosts": {"node1": {"changed": True}, "node2": {"changed": False}}},
        {"task": {"name": "Gathering Facts",
                  "duration": {"start": "2026-11-27T20:00:14.380000Z", "end": "2026-11-27T20:00:15.000000Z"}},
         "hosts": {"node1": {}, "node2": {"unreachable": True, "msg": "no route"}}},
        {"task": {"name": "python_env : Install the pinned packages",
                  "duration": {"start": "2026-11-27T20:00:15.000000Z", "end": "2026-11-27T20:00:16.000000Z"}},
         "hosts": {"node1": {"changed": False}}}]}],
    "stats": {"node1": {"ok": 3, "changed": 1, "unreachable": 0, "failures": 0, "skipped": 2, "rescued": 0,
                        "ignored": 0},
              "node2": {"ok": 1, "changed": 0, "unreachable": 1, "failures": 0, "skipped": 0, "rescued": 0,
                        "ignored": 0}}}


def test_a_recap_says_what_each_host_did_and_where_the_time_went():
    recap = ansible.Recap.read("[WARNING]: noise before the document\n" + json.dumps(DOCUMENT))
    assert recap.changed() == 1
    assert recap.changed_tasks == {"node1": ["python_env : Install the pinned packages"]}
    assert recap.tasks_per_host() == {"node1": 5, "node2": 1}
    assert recap.failures == {"node2": ["no route"]}
    # The same task twice (a second play, a handler): its times summed; slowest first.
    assert recap.profile == [("python_env : Install the pinned packages", 15.38), ("Gathering Facts", 0.62)]


@pytest.mark.parametrize("stdout", ["", "PLAY RECAP\nnode1 : ok=3 changed=0 unreachable=0 failed=0",
                                    '{"plays": []}', "[1, 2]"])
def test_a_recap_that_cannot_be_read_is_an_error_not_zero_changes(stdout):
    with pytest.raises(ansible.UnreadableRecap, match="recap could not be read"):
        ansible.Recap.read(stdout)


def test_a_timed_run_reads_its_recap_from_json_whatever_the_environment_asked(tmp_path):
    """bench.provision's run: the JSON callback is set by timed_run itself, so a caller's environment
    cannot leave it with a text recap it would read as no change."""
    playbook = tmp_path / "play.yml"
    playbook.write_text("- hosts: localhost\n  gather_facts: false\n  tasks:\n"
                        "    - name: Change something\n      ansible.builtin.command: 'true'\n"
                        "      changed_when: true\n")
    run = ansible.timed_run(["ansible-playbook", "-i", "localhost,", "-c", "local", str(playbook),
                             "-e", f"ansible_python_interpreter={sys.executable}"],
                            env={"ANSIBLE_STDOUT_CALLBACK": "default"})
    assert run.recap.changed() == 1 and run.recap.changed_tasks == {"localhost": ["Change something"]}
