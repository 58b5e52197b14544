"""The launch command lines, built from the layout provisioning records."""

from __future__ import annotations

import pytest

from mlxcluster.launch import (
    Cluster,
    LaunchError,
    MpiOptions,
    check_ready,
    describe_failure,
    mpirun_command,
    on_launcher,
    rank_nodes,
    rsync_ssh,
    ssh_command,
)


def layout(os_family: str = "Debian", **overrides) -> Cluster:
    def node(name, ip, slots, **extra):
        return {"name": name, "thunderbolt_ip": ip, "slots": slots, "os_family": os_family,
                "thunderbolt_interface": "bridge0", "cluster_root": "/opt/mlx-cluster",
                "venv": "/opt/mlx-cluster/venv", "env_file": "/opt/mlx-cluster/env.sh",
                "openmpi_prefix": "/usr" if os_family == "Debian" else "/opt/homebrew",
                "reachable": True,
                "connection": {"type": "ssh", "host": f"{name}.mgmt", "user": "mlx",
                               "private_key_file": "/keys/id", "ssh_common_args":
                               "-o UserKnownHostsFile=/keys/known_hosts"}, **extra}
    nodes = [node("node1", "10.0.0.1", 2), node("node2", "10.0.0.2", 1),
             node("spare", "10.0.0.3", 0)]
    for n in nodes:
        n.update(overrides.get(n["name"], {}))
    return Cluster.from_json({"launcher": "node1", "nodes": nodes})


def test_mpirun_uses_the_hostfile_all_slots_and_pins_the_cluster_link():
    cmd = mpirun_command(layout(), ["python", "-m", "training.finetune"],
                         MpiOptions(btl_tcp_links=2, env={"OPENBLAS_NUM_THREADS": "1"}))
    assert cmd == [
        "/usr/bin/mpirun", "--hostfile", "/opt/mlx-cluster/hostfile", "-np", "3", "--bind-to", "none",
        "--mca", "btl_tcp_if_include", "bridge0", "--mca", "oob_tcp_if_include", "bridge0",
        "--mca", "btl_tcp_links", "2", "--mca", "plm_rsh_args", "-o BatchMode=yes",
        "-x", "PATH", "-x", "VIRTUAL_ENV", "-x", "LD_PRELOAD",
        "-x", "OPENBLAS_NUM_THREADS=1", "python", "-m", "training.finetune"]


def test_mpirun_on_macs_points_orted_at_homebrew_and_exports_dyld_path():
    cmd = mpirun_command(layout("Darwin"), ["python"], MpiOptions(interface="en5"))
    assert cmd[0] == "/opt/homebrew/bin/mpirun"
    assert cmd[cmd.index("--prefix") + 1] == "/opt/homebrew"
    assert cmd[cmd.index("btl_tcp_if_include") + 1] == "en5"
    assert "DYLD_LIBRARY_PATH" in cmd and "LD_PRELOAD" not in cmd


def test_root_needs_an_explicit_allowance():
    assert "--allow-run-as-root" in mpirun_command(layout(), ["x"],
                                                  MpiOptions(allow_run_as_root=True))
    assert "--allow-run-as-root" not in mpirun_command(layout(), ["x"], MpiOptions())


def test_the_launcher_line_sources_the_env_file_first():
    line = on_launcher(layout(), ["mpirun", "-np", "3", "hostname"], workdir="/opt/w d")
    assert line == ". /opt/mlx-cluster/env.sh && cd '/opt/w d' && mpirun -np 3 hostname"


def test_ssh_reaches_the_launcher_like_ansible_does():
    cluster = layout()
    assert ssh_command(cluster.head, "true") == [
        "ssh", "-o", "BatchMode=yes", "-i", "/keys/id",
        "-o", "UserKnownHostsFile=/keys/known_hosts", "mlx@node1.mgmt", "true"]
    assert rsync_ssh(cluster.head) == ("ssh -o BatchMode=yes -i /keys/id "
                                       "-o UserKnownHostsFile=/keys/known_hosts")
    local = layout(node1={"connection": {"type": "local"}})
    assert ssh_command(local.head, "true") == ["bash", "-c", "true"]


def test_check_ready_names_what_to_fix():
    cluster = layout()
    check_ready(cluster, "# header\n10.0.0.1 slots=2\n10.0.0.2 slots=1\n")
    with pytest.raises(LaunchError, match="does not match the inventory"):
        check_ready(cluster, "10.0.0.1 slots=2\n")
    with pytest.raises(LaunchError, match="node2 could not be reached"):
        check_ready(layout(node2={"reachable": False}), "10.0.0.1 slots=2\n10.0.0.2 slots=1\n")


def test_ranks_fill_the_hostfile_in_order():
    assert rank_nodes(layout()) == ["node1", "node1", "node2"]


KILLED = """iter  5/100  loss 2.1
iter 10/100  loss 1.9
--------------------------------------------------------------------------
mpirun noticed that process rank 2 with PID 0 on node 10.0.0.2 exited on signal 9 (Killed).
--------------------------------------------------------------------------
"""

EXITED = """iter 10/40  loss 1.9
Primary job  terminated normally, but 1 process returned
a non-zero exit code. Per user-direction, the job has been aborted.
--------------------------------------------------------------------------
mpirun detected that one or more processes exited with non-zero status, thus causing
the job to be terminated. The first process to do so was:

  Process name: [[4711,1],1]
  Exit code:    1
"""

CONFIG = "rank 1: error: batch_size 3 is not divisible by the 2 ranks\n"

RING = "iter 20/60  loss 4.2\n\x1b[33m[WARN] Node with rank 1 exited with code 255 \x1b[0m\n"


@pytest.mark.parametrize(("output", "description"), [
    (KILLED, "rank 2 on node2 was killed by signal 9; last step reported: 10 of 100"),
    (EXITED, "rank 1 on node1 exited with status 1; last step reported: 10 of 40"),
    (CONFIG, "rank 1 on node1: batch_size 3 is not divisible by the 2 ranks; no step was reported"),
    (RING, "rank 1 on node1 exited with status 255; last step reported: 20 of 60"),
    ("ssh: connect to host node1.mgmt: No route to host", "no step was reported"),
])
def test_a_failed_launch_is_described_by_rank_node_and_last_step(output, description):
    assert describe_failure(layout(), output) == description
