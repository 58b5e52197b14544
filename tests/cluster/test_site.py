"""site.yml on a real 3-node lab cluster, as a user would run it.

The tests run in file order and share one cluster (the session's, which test_train.py then
trains on): dry run on fresh nodes, first
converge, idempotent second run, checks on every node (testinfra), MPI across the
nodes over the Thunderbolt-like link, `invoke bench.links` and `bench.scaling` on it, then the bad-input
paths: a node added to the inventory while another is unreachable, a node whose OS does not
match its group.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import testinfra
import yaml

from mlxcluster.lab import hosts, limits
from tests.cluster.conftest import SITE_VERIFIED

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
CLUSTER_ROOT = "/opt/mlx-cluster"  # set by the lab inventory
VENV_BIN = Path(sys.executable).parent


def host(cluster, node: int):
    return testinfra.get_host(f"ansible://node{node}?ansible_inventory={cluster.inventory}")


STATE = ("dpkg-query -W -f '${Status}' openmpi-bin 2>&1; ls -A /opt/mlx-cluster 2>&1; "
         "ls -A /root/.ssh; ip -br addr show dev bridge0")


def test_check_mode_on_fresh_nodes_changes_nothing(lab_cluster):
    before = [lab_cluster.ssh(i, STATE).stdout for i in (1, 2, 3)]
    run = lab_cluster.playbook(check=True)
    assert run.returncode == 0, json.dumps(run.failures, indent=1) + run.stderr[-2000:]
    assert [lab_cluster.ssh(i, STATE).stdout for i in (1, 2, 3)] == before


def test_first_run_converges(lab_cluster):
    run = lab_cluster.playbook()
    assert run.returncode == 0, json.dumps(run.failures, indent=1) + run.stderr[-3000:]
    # validate.yml's guard against an inventory without nodes runs on the controller: it changes nothing.
    nodes = {host: stats for host, stats in run.stats.items() if host != "localhost"}
    assert set(nodes) == {"node1", "node2", "node3"}
    assert all(stats["changed"] > 0 for stats in nodes.values())
    assert run.stats.get("localhost", {}).get("changed", 0) == 0


def test_second_run_changes_nothing(lab_cluster):
    run = lab_cluster.playbook()
    assert run.returncode == 0, json.dumps(run.failures, indent=1)
    assert run.changed == {}, f"not idempotent: {run.changed}"


RECORD_TASK = "hostfile : Record the resolved cluster layout, and write the hostfiles, on the controller"


def layout_path(cluster) -> Path:
    return REPO / "build" / f"lab{cluster.lab.lab_id}" / "cluster.json"


# `--limit` and `--check` leave the record alone too: the record task's own test runs both
# (tests/unit/mlxcluster/describe/test_record.py), and site.yml --check runs whole on fresh nodes
# above. A full site.yml run on three nodes is CI's costliest step: these two tags, whose plays
# skip the roles that set the record's facts, are the ones only a real cluster run shows.
@pytest.mark.parametrize("args", [("--tags", "hostfile"), ("--tags", "ssh,hostfile")],
                         ids=["tags-hostfile", "tags-ssh-hostfile"])
def test_a_partial_run_leaves_the_recorded_layout_as_the_full_run_wrote_it(lab_cluster, args):
    layout = layout_path(lab_cluster)
    full = layout.read_text()
    assert all(n["provisioned"] and n["venv"] for n in json.loads(full)["nodes"])
    run = lab_cluster.playbook(*args)
    assert run.returncode == 0, json.dumps(run.failures, indent=1) + run.stderr[-2000:]
    assert layout.read_text() == full
    assert not any(RECORD_TASK in tasks for tasks in run.changed.values()), run.changed
    if args == ("--tags", "hostfile"):
        code, checks, _ = doctor(lab_cluster)
        assert code == 0, [c for c in checks if not c["ok"]]


def test_a_first_run_with_only_tags_hostfile_records_nodes_not_provisioned(lab_cluster):
    layout = layout_path(lab_cluster)
    full = layout.read_text()
    layout.unlink()  # as before any full run
    try:
        run = lab_cluster.playbook("--tags", "hostfile")
        assert run.returncode == 0, json.dumps(run.failures, indent=1)
        nodes = json.loads(layout.read_text())["nodes"]
        assert [(n["provisioned"], n["venv"], n["reachable"]) for n in nodes] == \
            [(False, None, True)] * 3
        proc = subprocess.run([str(VENV_BIN / "invoke"), "run", "-i", str(lab_cluster.inventory),
                               "--", "hostname"], cwd=REPO, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=120)
        assert proc.returncode != 0
        assert "node1, node2, node3 not provisioned yet" in proc.stderr, proc.stderr
        assert "run invoke provision" in proc.stderr and "Traceback" not in proc.stderr
    finally:
        layout.write_text(full)


FAN_OUT = "model : Copy the model from the launcher to the node over the cluster link"


def model_sums(cluster, node: int) -> dict[str, str]:
    """sha256 of every file of the node's copy of the session's model (by file name)."""
    out = cluster.ssh(node, f"cd {CLUSTER_ROOT}/models/{cluster.model.name} && sha256sum *").stdout
    return {name: digest for digest, name in (line.split() for line in out.splitlines())}


def test_the_model_is_installed_and_recorded_on_every_training_node(lab_cluster):
    # Fetched once into the controller's cache, the same bytes on every node.
    cache = REPO / "models" / lab_cluster.model.name
    expected = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in cache.iterdir()}
    assert {"manifest.json", "model.safetensors", "config.json"} <= set(expected)
    for node in (1, 2, 3):
        assert model_sums(lab_cluster, node) == expected, f"node{node}"
    layout = json.loads((REPO / "build" / f"lab{lab_cluster.lab.lab_id}" / "cluster.json").read_text())
    for node in layout["nodes"]:
        assert node["model"]["path"] == f"{CLUSTER_ROOT}/models/{lab_cluster.model.name}"
        assert node["model"]["manifest_sha256"] == expected["manifest.json"]


def test_a_corrupted_model_copy_is_found_and_replaced_by_the_next_run(lab_cluster):
    weights = f"{CLUSTER_ROOT}/models/{lab_cluster.model.name}/model.safetensors"
    good = model_sums(lab_cluster, 2)
    # Same size, same mtime, four bytes flipped: the stamp of the last check no longer holds (the
    # write moved ctime), so the quick check hashes the copy and finds it.
    corrupt = lab_cluster.ssh(2, (
        f"touch -r {weights} /tmp/mtime && printf '\\377\\377\\377\\377' "
        f"| dd of={weights} bs=1 seek=4096 conv=notrunc status=none && touch -r /tmp/mtime {weights}"))
    assert corrupt.returncode == 0, corrupt.stderr
    assert model_sums(lab_cluster, 2) != good
    run = lab_cluster.playbook("--tags", "model")
    assert run.returncode == 0, json.dumps(run.failures, indent=1)
    assert run.changed == {"node2": [FAN_OUT]}  # from the launcher, over the cluster link
    assert model_sums(lab_cluster, 2) == good
    again = lab_cluster.playbook("--tags", "model")
    assert again.returncode == 0 and again.changed == {}, again.changed


def test_a_node_with_no_slots_gets_no_model(lab_cluster, tmp_path):
    inventory = yaml.safe_load(lab_cluster.inventory.read_text())
    inventory["cluster"]["children"]["linux"]["hosts"]["node3"]["mpi_slots"] = 0
    path = tmp_path / "inventory" / "hosts.yml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(inventory))
    models = f"{CLUSTER_ROOT}/models"
    lab_cluster.ssh(3, f"mv {models} {models}.aside")
    try:
        run = lab_cluster.playbook("--tags", "model", inventory=path)
        assert run.returncode == 0, json.dumps(run.failures, indent=1)
        # The record of this new inventory is written (it is tagged always); no model task changes.
        model_tasks = [t for tasks in run.changed.values() for t in tasks if t.startswith("model :")]
        assert model_tasks == [], run.changed
        assert lab_cluster.ssh(3, f"test -e {models}").returncode == 1
    finally:
        lab_cluster.ssh(3, f"rm -rf {models} && mv {models}.aside {models}")


@pytest.mark.parametrize("node", [1, 2, 3])
def test_each_node_has_mpi_the_venv_and_its_thunderbolt_address(lab_cluster, node):
    h = host(lab_cluster, node)
    assert h.run("mpirun --version").stdout.startswith("mpirun (Open MPI) 4.")
    probe = h.run(f". {CLUSTER_ROOT}/env.sh && python -c 'import mlx.core as mx, mlx_lm; "
                  "print(mx.__version__, mx.distributed.is_available())'")
    assert probe.rc == 0, probe.stderr
    assert probe.stdout.split() == ["0.32.4", "True"]
    assert h.file(f"{CLUSTER_ROOT}/venv/bin/python").exists
    addresses = h.interface("bridge0").addresses
    assert lab_cluster.lab.tb_ip(node) in addresses
    # Every process of a lab node preloads the library that keeps a waiting ring rank off the cores
    # the nodes share (mlxcluster/lab/ring_wait.py): this probe's python too.
    maps = h.run(f"{CLUSTER_ROOT}/venv/bin/python -c 'print(open(\"/proc/self/maps\").read())'")
    assert "/ring-wait-" in maps.stdout, maps.stderr
    # Root's shell files are a fresh Debian's, not this machine's (whose .bashrc may start pyenv
    # at every ssh command): mlxcluster/lab/hosts.py's FRESH_ROOT_SHELL.
    assert h.file("/root/.bashrc").content_string == Path("/usr/share/base-files/dot.bashrc").read_text()
    # One BLAS thread for the ranks of a node: the nodes share this machine's cores (hosts.py's sshd).
    assert h.run("echo $OPENBLAS_NUM_THREADS").stdout.strip() == "1"
    # The cluster's launcher of MLX's backends is in the venv, and runs there.
    launcher = h.run(f"{CLUSTER_ROOT}/venv/bin/python {CLUSTER_ROOT}/venv/bin/mlx-cluster-launch --help")
    assert launcher.rc == 0 and "--hostfile" in launcher.stdout, launcher.stderr


@pytest.mark.parametrize("node", [1, 2, 3])
def test_each_node_has_the_hostfiles_rendered_from_inventory(lab_cluster, node):
    lab_obj = lab_cluster.lab
    hostfile = host(lab_cluster, node).file(f"{CLUSTER_ROOT}/hostfile").content_string
    entries = [line for line in hostfile.splitlines() if line and not line.startswith("#")]
    assert entries == [f"{lab_obj.tb_ip(i)} slots=1" for i in (1, 2, 3)]
    hosts_json = json.loads(host(lab_cluster, node).file(f"{CLUSTER_ROOT}/hosts.json")
                            .content_string)
    assert [h["ips"] for h in hosts_json["hosts"]] == [[lab_obj.tb_ip(i)] for i in (1, 2, 3)]
    build = REPO / "build" / f"lab{lab_obj.lab_id}" / "hostfile"
    assert build.read_text() == hostfile


def test_ssh_between_nodes_by_every_name_needs_no_password_and_no_prompt(lab_cluster):
    lab_obj = lab_cluster.lab
    for target in (lab_obj.tb_ip(3), lab_obj.mgmt_ip(3), "node3"):
        probe = lab_cluster.ssh(1, f"ssh -o BatchMode=yes {target} hostname")
        assert probe.returncode == 0, f"node1 -> {target}: {probe.stderr}"
        assert probe.stdout.strip() == "node3"
    effective = lab_cluster.ssh(1, f"ssh -G {lab_obj.tb_ip(3)}").stdout.lower().splitlines()
    assert "stricthostkeychecking ask" in effective or "stricthostkeychecking true" in effective


def test_each_role_s_molecule_checks_hold_on_the_nodes_site_yml_converged(lab_cluster):
    # Where the scenarios' own paths would be: the model's (molecule-tiny) and the hostfiles' build folder.
    run = lab_cluster.verify(*((role, "default") for role in SITE_VERIFIED),
                             __verify_cache=str(REPO / "models" / lab_cluster.model.name),
                             __verify_copy=f"{CLUSTER_ROOT}/models/{lab_cluster.model.name}",
                             __verify_build_dir=str(layout_path(lab_cluster).parent))
    assert run.returncode == 0, json.dumps(run.failures, indent=1) + run.stderr[-2000:]
    assert run.changed == {}
    nodes = {host for host in run.stats if host != "localhost"}
    assert nodes == {"node1", "node2", "node3"}, run.stats
    # Every scenario's checks ran, in order: each play of each verify.yml is in the run (a verify.yml
    # may also import a playbook, whose plays come in between).
    ran = iter(play["play"]["name"] for play in json.loads(run.stdout)["plays"])
    expected = [play["name"] for role in SITE_VERIFIED for play in
                yaml.safe_load((REPO / "roles" / role / "molecule/default/verify.yml").read_text())
                if "hosts" in play]
    assert all(name in ran for name in expected), expected


def test_mpirun_on_the_launcher_reaches_every_node_over_the_thunderbolt_link(lab_cluster):
    probe = lab_cluster.ssh(1, (
        f". {CLUSTER_ROOT}/env.sh && mpirun --allow-run-as-root "
        f"--hostfile {CLUSTER_ROOT}/hostfile -np 3 "
        "--mca btl_tcp_if_include bridge0 --mca oob_tcp_if_include bridge0 hostname"))
    assert probe.returncode == 0, probe.stderr
    assert sorted(probe.stdout.split()) == ["node1", "node2", "node3"]


def doctor(cluster) -> tuple[int, list[dict], str]:
    """invoke doctor --json: (exit status, the checks, its summary line)."""
    proc = subprocess.run([str(VENV_BIN / "invoke"), "doctor", "--json", "-i", str(cluster.inventory)],
                          cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=120)
    return proc.returncode, json.loads(proc.stdout), proc.stderr.strip()


def test_doctor_is_green_on_the_healthy_cluster(lab_cluster):
    start = time.perf_counter()
    code, checks, summary = doctor(lab_cluster)
    elapsed = time.perf_counter() - start
    assert code == 0, [c for c in checks if not c["ok"]]
    assert {"mpirun -np 3 hostname", "MLX all_sum over every rank", "ssh over the cluster link",
            "interface bridge0", "hostfile", "mlx-lm", "Open MPI"} <= {c["name"] for c in checks}
    # Every ordered pair of nodes was tried over the cluster link.
    assert len([c for c in checks if c["name"] == "ssh over the cluster link"]) == 6
    # And the venv's Python, as a rank, connected to every peer (Local Network Privacy's case).
    reached = [c for c in checks if c["name"] == "the venv's Python reaches it"]
    assert len(reached) == 6 and all("a TCP connect from the venv's Python" in c["detail"] for c in reached)
    assert re.search(r"(\d+) of \1 checks passed on 3 nodes", summary), summary
    # A figure, not a check: a loaded runner is slower (the speed is bench.rehearsal's to measure).
    print(f"invoke doctor on a healthy 3-node lab: {elapsed:.1f} s")


MLX_LM_METADATA = f"{CLUSTER_ROOT}/venv/lib/python3*/site-packages/mlx_lm-*.dist-info/METADATA"


def test_doctor_names_a_broken_key_a_version_mismatch_and_a_down_interface(lab_cluster):
    node1_key = lab_cluster.ssh(1, "cat /root/.ssh/id_ed25519.pub").stdout.split()[1]
    breakage = {
        # node3 no longer accepts node1's key
        3: f"cp /root/.ssh/authorized_keys /root/ak.bak && grep -v '{node1_key}' /root/ak.bak "
           "> /root/.ssh/authorized_keys",
        # node2's venv reports another mlx-lm, and its cluster link is down
        2: f"m=$(echo {MLX_LM_METADATA}) && cp $m /root/md.bak && "
           "sed -i 's/^Version: .*/Version: 0.31.0/' $m && ip link set bridge0 down",
    }
    repair = {
        3: "mv /root/ak.bak /root/.ssh/authorized_keys",
        2: f"m=$(echo {MLX_LM_METADATA}) && mv /root/md.bak $m && ip link set bridge0 up",
    }
    for node, command in breakage.items():
        assert lab_cluster.ssh(node, command).returncode == 0
    # node3 is also a smaller machine: a control group holds it to 768 MiB (a container, a slice),
    # room for the default run's rank (its peak and its process) all the same.
    lab = lab_cluster.lab
    limits.limit(lab.lab_id, 3, lab.netns(3), memory_bytes=768 * 2**20)
    try:
        code, checks, summary = doctor(lab_cluster)
    finally:
        limits.clear(lab.lab_id, 3)
        for node, command in repair.items():
            assert lab_cluster.ssh(node, command).returncode == 0
    memory = next(c for c in checks if c["scope"] == "node3" and c["name"] == "free memory")
    assert int(re.match(r"(\d+) MiB free", memory["detail"])[1]) <= 768 and memory["ok"], memory
    assert code != 0 and "failed (see the fix column)" in summary
    red = {(c["scope"], c["name"]): c for c in checks if not c["ok"]}
    key = red["node1 -> node3", "ssh over the cluster link"]
    assert "Permission denied" in key["detail"] and "ssh_mesh" in key["fix"]
    version = red["node2", "mlx-lm"]
    assert version["detail"] == "0.31.0, but node1 0.32.2, node3 0.32.2"
    assert "nodes must agree" in version["fix"]
    link = red["node2", "interface bridge0"]
    assert link["detail"].startswith("down") and "thunderbolt role" in link["fix"]
    # With node2's link down nothing crosses it either way, and the MPI jobs wait for a
    # cluster without red checks; nothing else is red.
    link = "ssh over the cluster link"
    assert set(red) == {("node1 -> node3", link),
                        ("node2", "mlx-lm"), ("node2", "interface bridge0"),
                        ("node1 -> node2", link), ("node3 -> node2", link),
                        ("node2 -> node1", link), ("node2 -> node3", link),
                        ("cluster", "MPI jobs (mpirun hostname, MLX all_sum, send/recv)")}, sorted(red)
    assert doctor(lab_cluster)[0] == 0  # repaired


def test_an_extra_package_unpinned_or_not_to_be_had_is_refused_with_the_reason(lab_cluster):
    """python_env_extra_packages (a cluster's own packages): each pinned, and a pin no index has
    stops provisioning with pip's reason; the venv stays as it was (doctor green after)."""
    def provision_with(packages: list[str]) -> str:
        run = lab_cluster.playbook("--tags", "python", "--limit", "node1",
                                   "-e", json.dumps({"python_env_extra_packages": packages}))
        assert run.returncode != 0, run.stdout[-2000:]
        return " ".join(m for messages in run.failures.values() for m in messages)

    said = provision_with(["xgboost-cpu"])
    assert "must pin each package to one version" in said and "xgboost-cpu" in said, said
    said = provision_with(["no-such-package-here==1.0.0"])
    assert "pip could not install the venv's pinned packages on node1" in said, said
    assert "no-such-package-here==1.0.0" in said and "No matching distribution" in said, said
    assert doctor(lab_cluster)[0] == 0


def test_a_fourth_node_joins_while_an_unreachable_one_is_named_and_it_catches_up_once_back(lab_cluster):
    # One run for both, as it happens: a Mac added to the inventory while another is off. (Two runs
    # less than one test for each; a full site.yml run is CI's costliest step.)
    hosts.up(4, lab_cluster.lab.lab_id)
    hosts.stop_node(lab_cluster.lab, 3)
    run = lab_cluster.playbook()
    assert run.returncode != 0
    assert run.stats["node3"]["unreachable"] >= 1
    assert all(run.stats[node]["failures"] == 0 for node in ("node1", "node2", "node4")), run.failures
    assert run.stats["node4"]["changed"] > 0
    # The others change their mesh and hostfiles for node4, nothing else; the launch code's record
    # says node3 is down.
    for node in ("node1", "node2"):
        changed = run.changed.get(node, [])
        unexpected = [t for t in changed if not t.startswith(("ssh_mesh : ", "hostfile : "))]
        assert unexpected == [], f"{node} changed more than the mesh and hostfiles: {unexpected}"
        assert any(t.startswith("hostfile : Install") for t in changed), changed
    layout = REPO / "build" / f"lab{lab_cluster.lab.lab_id}" / "cluster.json"
    assert [n["reachable"] for n in json.loads(layout.read_text())["nodes"]] == [True, True, False, True]
    # Fixed (node3 is back, its network namespace made anew) and re-run: all converge, node4 too.
    hosts.up(4, lab_cluster.lab.lab_id)
    run = lab_cluster.playbook()
    assert run.returncode == 0, json.dumps(run.failures, indent=1)
    assert [n["reachable"] for n in json.loads(layout.read_text())["nodes"]] == [True] * 4
    tb4 = lab_cluster.lab.tb_ip(4)
    for node in (1, 2, 3):
        assert lab_cluster.ssh(node, f"ssh -o BatchMode=yes {tb4} hostname").stdout.strip() \
            == "node4"
        assert f"{tb4} slots=1" in lab_cluster.ssh(node, f"cat {CLUSTER_ROOT}/hostfile").stdout
    probe = lab_cluster.ssh(4, f"ssh -o BatchMode=yes {lab_cluster.lab.tb_ip(3)} hostname")
    assert probe.stdout.strip() == "node3", probe.stderr


def test_a_node_whose_os_does_not_match_its_group_gets_a_clear_message(lab_cluster, tmp_path):
    inventory = yaml.safe_load(lab_cluster.inventory.read_text())
    linux = inventory["cluster"]["children"]["linux"]["hosts"]
    inventory["cluster"]["children"]["macs"]["hosts"] = {"node2": linux.pop("node2")}
    path = tmp_path / "inventory" / "hosts.yml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(inventory))
    # The check is in base.yml's plays, which every run has (tag always): its own tag runs them alone.
    run = lab_cluster.playbook("--tags", "base", inventory=path)
    assert run.returncode != 0
    message = " ".join(run.failures.get("node2", []))
    assert "node2 runs Debian" in message and "macs" in message, run.failures
    assert "node1" not in run.failures
