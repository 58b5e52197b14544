"""The launch command lines (mlxcluster/launch/builder.py), built from the layout provisioning records
(mlxcluster/describe/cluster.py), and how the controller reaches a node (mlxcluster/launch/remote.py)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from mlxcluster.describe.cluster import Cluster, NotReady, check_ready
from mlxcluster.errors import UserError
from mlxcluster.launch import builder
from mlxcluster.launch.builder import Job, describe_failure, killed, killed_on, mpirun_command
from mlxcluster.launch.remote import rsync_ssh, shell_line, ssh_command


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
    cmd = mpirun_command(layout(), Job(["python", "-m", "training.finetune"], btl_tcp_links=2),
                         {"OPENBLAS_NUM_THREADS": "1"})
    assert cmd == [
        "/usr/bin/mpirun", "--hostfile", "/opt/mlx-cluster/hostfile", "-np", "3", "--bind-to", "none",
        "--mca", "btl_tcp_if_include", "bridge0", "--mca", "oob_tcp_if_include", "bridge0",
        "--mca", "btl_tcp_links", "2", "--mca", "plm_rsh_args", "-o BatchMode=yes",
        "-x", "PATH", "-x", "VIRTUAL_ENV", "-x", "LD_PRELOAD",
        "-x", "OPENBLAS_NUM_THREADS=1", "--wdir", "/opt/mlx-cluster/work",
        "/opt/mlx-cluster/venv/bin/python", "-m", "training.finetune"]


def test_mpirun_on_macs_points_orted_at_homebrew_and_exports_dyld_path():
    cmd = mpirun_command(layout("Darwin"), Job(["python"], interface="en5"), {})
    assert cmd[0] == "/opt/homebrew/bin/mpirun"
    assert cmd[cmd.index("--prefix") + 1] == "/opt/homebrew"
    assert cmd[cmd.index("btl_tcp_if_include") + 1] == "en5"
    assert "DYLD_LIBRARY_PATH" in cmd and "LD_PRELOAD" not in cmd


def test_root_needs_an_explicit_allowance():
    as_root = layout(node1={"connection": {"type": "ssh", "host": "node1.mgmt", "user": "root"}})
    assert "--allow-run-as-root" in mpirun_command(as_root, Job(["x"]), {})
    assert "--allow-run-as-root" not in mpirun_command(layout(), Job(["x"]), {})


def test_the_launcher_line_sources_the_env_file_first():
    line = shell_line(layout().head, ["mpirun", "-np", "3", "hostname"], workdir="/opt/w d")
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
    with pytest.raises(NotReady, match="does not match the inventory"):
        check_ready(cluster, "10.0.0.1 slots=2\n")
    with pytest.raises(NotReady, match="node2 could not be reached"):
        check_ready(layout(node2={"reachable": False}), "10.0.0.1 slots=2\n10.0.0.2 slots=1\n")


def test_ranks_fill_the_hostfile_in_order():
    assert layout().rank_nodes() == ["node1", "node1", "node2"]


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
    (KILLED, "rank 2 on node2 was killed by signal 9; last step reported: 10 of 100; "
             "a rank killed with SIGKILL is most often out of memory: --parallel tensor splits the model "
             "across the nodes, each holding a shard of it; a smaller batch_size or max_micro_batch, or "
             "grad_checkpoint, shrink the activations"),
    (EXITED, "rank 1 on node1 exited with status 1; last step reported: 10 of 40"),
    (CONFIG, "rank 1 on node1: batch_size 3 is not divisible by the 2 ranks; no step was reported"),
    (RING, "rank 1 on node1 exited with status 255; last step reported: 20 of 60"),
    ("ssh: connect to host node1.mgmt: No route to host", "no step was reported"),
])
def test_a_failed_launch_is_described_by_rank_node_and_last_step(output, description):
    assert describe_failure(layout(), output) == description


def test_a_rank_killed_as_out_of_memory_is_told_to_shard_the_model():
    ring = "\x1b[33m[WARN] Node with rank 0 exited with code -9 \x1b[0m\n"
    assert describe_failure(layout(), ring).startswith("rank 0 on node1 was killed by signal 9")
    # A rank behind ssh: its shell's 128 + 9 (builder.RANK_WAITS), where ssh alone says 255.
    remote = "\x1b[33m[WARN] Node with rank 2 exited with code 137 \x1b[0m\n"
    assert describe_failure(layout(), remote).startswith("rank 2 on node2 was killed by signal 9")
    assert killed(remote) and killed_on(layout(), remote) == "node2"
    assert not killed(RING) and killed_on(layout(), RING) is None
    # Said after another rank's end (its peer gone), the killed one is still the cause.
    both = "\x1b[33m[WARN] Node with rank 0 exited with code 1 \x1b[0m\n" + remote
    assert describe_failure(layout(), both).startswith("rank 2 on node2 was killed by signal 9")
    assert "--parallel tensor splits the model" in describe_failure(layout(), ring)
    # One process run directly: the shell's 137; in tensor parallelism, more nodes.
    assert "more nodes give each a smaller shard" in describe_failure(layout(), "", 137, "tensor")
    assert "out of memory" not in describe_failure(layout(), RING, 255)
    # The node's kernel counted an out-of-memory kill: said for sure, whatever the exit status.
    told = describe_failure(layout(), RING, 255, "data", ["node1"])
    assert "out of memory: the kernel's out-of-memory killer ended a process on node1" in told
    assert "--parallel tensor splits the model" in told and "most often" not in told


def test_a_rank_killed_while_its_node_counted_no_out_of_memory_kill_was_killed_from_outside():
    ring = "\x1b[33m[WARN] Node with rank 1 exited with code -9 \x1b[0m\n"
    for output, code in ((KILLED, None), (ring, None)):
        told = describe_failure(layout(), output, code, "data", [], ["node1", "node2"])
        assert "killed from outside the run, not for memory" in told and "out-of-memory count" in told
        assert "--parallel tensor" not in told
    # Where the count cannot be read (a Mac: jetsam has none), the likeliest cause, hedged.
    assert "most often out of memory" in describe_failure(layout(), ring, None, "data", [], ["node2"])


def rank_shell(tmp_path: Path, *program: str) -> subprocess.Popen:
    """One rank of mlx-cluster-launch as ssh starts it on its node: `bash -c <rank_script> python
    ...`, with an env.sh that puts this interpreter first on PATH as `python`."""
    (tmp_path / "bin").mkdir(exist_ok=True)
    if not (tmp_path / "bin" / "python").exists():
        (tmp_path / "bin" / "python").symlink_to(sys.executable)
    (tmp_path / "env.sh").write_text(f'export PATH="{tmp_path}/bin:$PATH"\n')
    script = builder.rank_script(str(tmp_path / "env.sh"), "export RANK_SETUP_RAN=yes")
    return subprocess.Popen(["bash", "-c", script, "python", *program], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def pids_holding(token: str) -> list[int]:
    """The processes whose command line holds `token` (as pkill -f matches them)."""
    found = subprocess.run(["pgrep", "-f", token], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    return [int(pid) for pid in found.stdout.split() if int(pid) != os.getpid()]


def started(rank: subprocess.Popen, token: str) -> list[int]:
    """Waits until python runs under the rank's shell: the pids holding `token` then."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pids = pids_holding(token)
        if pids and rank.pid not in pids:  # the shell has exec'd into the one that waits
            return pids
        time.sleep(0.05)
    rank.kill()
    raise AssertionError(f"python never started: {rank.communicate()}")


def test_a_rank_s_arguments_reach_python_intact_after_its_env_file_and_setup(tmp_path):
    rank = rank_shell(tmp_path, "-c", "import os, sys; print(sys.argv[1:], os.environ['RANK_SETUP_RAN'], "
                                      "os.environ.get('MLX_CLUSTER_RANK_ARGS'))",
                      "a b", "it's", "$HOME", "", "*", "--iters", "5")
    out, err = rank.communicate(timeout=60)
    assert rank.returncode == 0, err
    assert out.strip() == str(['a b', "it's", '$HOME', '', '*', '--iters', '5']) + " yes None"
    failing = rank_shell(tmp_path, "-c", "raise SystemExit(3)")
    failing.communicate(timeout=60)
    assert failing.returncode == 3


def test_pkill_f_of_the_program_kills_python_alone_and_its_rank_exits_as_killed(tmp_path):
    """What a user does on a node (`pkill -9 -f training.finetune`) kills the rank's python, not
    the shell that waits for it: the rank exits 137, which the launcher reports and describe_failure
    names as a kill, where a killed shell would make ssh exit 255, as for a lost connection."""
    token = f"training.finetune.{uuid.uuid4().hex}"
    rank = rank_shell(tmp_path, "-c", "import time; time.sleep(120)", token)
    assert len(started(rank, token)) == 1  # only python holds the program's words
    subprocess.run(["pkill", "-9", "-f", token], check=True, stdin=subprocess.DEVNULL)
    assert rank.wait(timeout=30) == 128 + signal.SIGKILL
    rank.communicate()
    ring = f"[WARN] Node with rank 2 exited with code {rank.returncode}\n"
    assert describe_failure(layout(), ring).startswith("rank 2 on node2 was killed by signal 9")
    assert not pids_holding(token)
    # The launcher stops a rank by ending its ssh, whose hang-up reaches the rank's shell (a local
    # rank's shell gets TERM, as here): its trap passes TERM on to python.
    rank = rank_shell(tmp_path, "-c", "import time; time.sleep(120)", token)
    assert len(started(rank, token)) == 1
    rank.send_signal(signal.SIGTERM)
    assert rank.wait(timeout=30) == 128 + signal.SIGTERM
    rank.communicate()
    assert not pids_holding(token)


# --- the one builder --------------------------------------------------------------------------------


def words_after(cmd: list[str], marker: str) -> list[str]:
    line = cmd[-1]
    return shlex.split(line[line.index(marker):])


def test_every_backend_gives_the_ranks_the_same_environment():
    cluster = layout()
    job = Job(["python", "-m", "training.finetune"], threads=2)
    expected = {"HF_HUB_OFFLINE": "1", "TTY_COMPATIBLE": "0", "OPENBLAS_NUM_THREADS": "2"}
    assert builder.rank_env(cluster, job) == expected
    mpi = words_after(builder.command(cluster, job), "mpirun")
    assert {mpi[i + 1] for i, w in enumerate(mpi) if w == "-x" and "=" in mpi[i + 1]} == \
        {f"{k}={v}" for k, v in expected.items()}
    ring = words_after(builder.command(cluster, Job(job.program, backend="ring", threads=2)), "/opt")
    assert {ring[i + 1] for i, w in enumerate(ring) if w == "--env"} == \
        {f"{k}={v}" for k, v in expected.items()}
    direct = words_after(builder.command(cluster, Job(job.program, backend="direct", threads=2)), "env ")
    assert direct[1:4] == sorted(f"{k}={v}" for k, v in expected.items())
    # At a terminal rank 0 may draw its bar; several slots on a node share its cores.
    assert builder.rank_env(cluster, Job(["x"], interactive=True)) == {
        "HF_HUB_OFFLINE": "1", "OPENBLAS_NUM_THREADS": "1"}


def test_one_rank_on_the_launcher_runs_without_a_launcher():
    one = layout().first_nodes(1)
    assert one.world_size == 2  # node1's two slots
    assert builder.backend_for(one, None) == "mpi"
    alone = layout(node1={"slots": 1}).first_nodes(1)
    assert (builder.backend_for(alone, None), builder.backend_for(alone, "ring")) == ("direct", "ring")
    with pytest.raises(UserError, match="--backend must be auto, ring, jaccl, jaccl-ring, mpi, not 'nccl'"):
        builder.backend_for(alone, "nccl")


def test_sub_layouts_keep_the_recorded_nodes_and_change_only_slots():
    cluster = layout()
    assert cluster.first_nodes(1).hostfile_lines() == ["10.0.0.1 slots=2"]
    assert cluster.one_rank_per_node().hostfile_lines() == ["10.0.0.1 slots=1", "10.0.0.2 slots=1"]
    alone = cluster.only(cluster.nodes[1])
    assert (alone.launcher, alone.world_size, alone.head.connection["host"]) == ("node2", 1, "node2.mgmt")


def test_a_layouts_ring_hosts_file_has_one_entry_per_rank_like_the_rendered_one():
    assert builder.ring_hosts(layout(), ["A=1"]) == {
        "backend": "ring", "envs": ["A=1"],
        "hosts": [{"ssh": "10.0.0.1", "ips": ["10.0.0.1"]}, {"ssh": "10.0.0.1", "ips": ["10.0.0.1"]},
                  {"ssh": "10.0.0.2", "ips": ["10.0.0.2"]}]}


def test_the_stop_command_targets_only_this_runs_processes():
    cmd = builder.stop_command(layout(), "--tag links-20260101-000000")
    # The launcher's children (a rank each) listed first, stopped once it has ended.
    assert cmd[-1] == ("ranks=$(for p in $(pgrep -f 'mlx-cluster-launch .*--tag links-20260101-000000'); do "
                       'pgrep -P "$p"; done); '
                       "pkill -TERM -f '(mpirun|mlx-cluster-launch|python) .*--tag links-20260101-000000'; "
                       'for p in $(echo $ranks); do kill -TERM "$p" 2>/dev/null; done')
    assert "python) .*runs/20260101-000000'; " in builder.stop_command(layout(), "runs/20260101-000000")[-1]
    with pytest.raises(ValueError, match="marker"):
        builder.stop_command(layout(), "x'; reboot")


def test_a_failed_launch_report_says_how_why_which_node_and_what_next():
    tail = ("Traceback (most recent call last):\n  noise\n\x1b[33m[WARN] Node with rank 2 exited "
            "with code 255 \x1b[0m\nrank 1: error: MLX joined 1 ranks\n")
    cluster = layout(node1={"slots": 1}, spare={"slots": 1})
    message = builder.failure_report(cluster, "ring", 0, tail, "inv.yml")
    assert message.splitlines() == [
        "the ring launch exited 0 but rank 0 printed no result:",
        "  [WARN] Node with rank 2 exited with code 255",
        "  rank 1: error: MLX joined 1 ranks",
        "ranks: 0 node1, 1 node2, 2 spare",
        "check the cluster with: invoke doctor -i inv.yml"]
    assert "timed out (raise --timeout if it was still making progress):\n  (see the output above)" \
        in builder.failure_report(cluster, "mpi", None, "", "i")


def test_a_layout_of_fewer_ranks_than_provisioned_launches_ring_with_hosts_of_its_own():
    # The provisioned hosts.json lists every node: a launch of fewer (bench.tensor's one process,
    # bench.scaling's first nodes) writes its own, with its ranks only.
    cluster = layout(node1={"slots": 1}, node2={"slots": 1})
    whole = " ".join(builder.command(cluster, Job(["x"], backend="ring")))
    assert f"--hostfile {cluster.head.cluster_root}/hosts.json" in whole and "printf '%s" not in whole
    assert cluster.one_rank_per_node().provisioned  # the same ranks: the provisioned file still fits
    one = cluster.first_nodes(1)
    assert not one.provisioned
    line = " ".join(builder.command(one, Job(["x"], backend="ring")))
    assert f"--hostfile {one.head.work_dir}/{builder.LAYOUT_HOSTS_FILE}" in line
    assert builder.ring_hosts(one)["hosts"] == [{"ssh": "10.0.0.1", "ips": ["10.0.0.1"]}]
    # Asked for nothing, one rank runs directly, whatever the cabling would pick for more.
    assert builder.backend_for(one, None) == "direct" and builder.backend_for(one, "ring") == "ring"
