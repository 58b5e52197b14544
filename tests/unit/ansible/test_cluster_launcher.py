"""The venv's mlx-cluster-launch (roles/python_env/files/mlx_cluster_launch.py): what each rank gets
from MLX's hosts file, as mlx.launch gives it, run for real on local hosts; that it waits without
spending the CPU its ranks need; and that a hosts file it cannot use is refused, naming it."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from tests.unit import rings

spec = importlib.util.spec_from_file_location("mlx_cluster_launch", rings.LAUNCHER)
launcher = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launcher)

SHOW = ("import json, os; print(json.dumps({k: os.environ.get(k) for k in "
        "('MLX_RANK', 'MLX_JACCL_COORDINATOR', 'MLX_JACCL_RING', 'A')} | "
        "{'file': open(os.environ.get('MLX_HOSTFILE') or os.environ['MLX_IBV_DEVICES']).read(), "
        "'cwd': os.getcwd()}), flush=True)")


def run(tmp_path, hosts: dict, *args: str) -> subprocess.CompletedProcess:
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps(hosts))
    return subprocess.run([sys.executable, str(rings.LAUNCHER), "--hostfile", str(hostfile), *args, "--",
                           sys.executable, "-c", SHOW], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


def local(count: int, ips: int = 1, **more) -> list[dict]:
    return [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"] * ips, **more} for _ in range(count)]


def test_a_ring_s_ranks_get_their_rank_the_ring_of_ports_and_the_hosts_file_s_variables(tmp_path):
    done = run(tmp_path, {"backend": "ring", "envs": ["A=from the file"], "hosts": local(3, ips=2)},
               "--starting-port", "31000", "--cwd", str(tmp_path))
    assert done.returncode == 0, done.stderr
    ranks = sorted((json.loads(line) for line in done.stdout.splitlines()), key=lambda r: r["MLX_RANK"])
    # One port per address, counting up from the starting port across the hosts, as mlx.launch does.
    ring = [[f"127.0.0.1:{31000 + 2 * rank}", f"127.0.0.1:{31001 + 2 * rank}"] for rank in range(3)]
    assert [r["MLX_RANK"] for r in ranks] == ["0", "1", "2"]
    assert all(json.loads(r["file"]) == ring and r["A"] == "from the file" for r in ranks), ranks
    assert {r["cwd"] for r in ranks} == {str(tmp_path)}
    # One rank alone has an empty hosts file: MLX's ring then runs as a group of one.
    alone = run(tmp_path, {"hosts": local(1)}, "--env", "A=flag")
    assert json.loads(alone.stdout) | {"cwd": None} == {
        "MLX_RANK": "0", "MLX_JACCL_COORDINATOR": None, "MLX_JACCL_RING": None, "A": "flag", "file": "\n",
        "cwd": None}


@pytest.mark.parametrize("backend", ["jaccl", "jaccl-ring"])
def test_jaccl_s_ranks_get_the_coordinator_and_each_rank_s_rdma_devices(tmp_path, backend):
    rdma = [[None, "rdma_en2"], ["rdma_en2", None]]
    hosts = [{"ssh": "127.0.0.1", "ips": ["10.0.0.1"], "rdma": rdma[0]},
             {"ssh": "127.0.0.1", "ips": [], "rdma": rdma[1]}]
    done = run(tmp_path, {"backend": backend, "hosts": hosts}, "--starting-port", "32400")
    assert done.returncode == 0, done.stderr
    for rank in map(json.loads, done.stdout.splitlines()):
        assert rank["MLX_JACCL_COORDINATOR"] == "10.0.0.1:32400" and json.loads(rank["file"]) == rdma
        assert rank["MLX_JACCL_RING"] == ("1" if backend == "jaccl-ring" else None)


def test_ranks_on_other_hosts_run_over_ssh_with_a_terminal_that_their_end_hangs_up():
    script = launcher.rank_script(2, "/w d", ["A=b c"], {"MLX_HOSTFILE": "[]"}, ["bash", "-c", "x"],
                                  remote=True)
    assert script == ("stty -echo 2>/dev/null; cd '/w d' || "
                      "{ echo 'Failed to change directory to' '/w d' >&2; exit 1; }; export A='b c'; "
                      "f=$(mktemp) && printf \"%s\\n\" '[]' > \"$f\" && "
                      "export MLX_HOSTFILE=\"$f\"; export MLX_RANK=2; exec bash -c x")
    assert launcher.SSH[:2] == ("ssh", "-tt")  # a pty: ssh's end hangs it up, which stops the rank


def test_the_launcher_waits_without_spending_the_cpu_its_ranks_need(tmp_path):
    """mlx.launch keeps a core busy for as long as its ranks run (about 1 s of CPU a second); this
    launcher blocks in wait() and read(). Its own CPU time, not the wall clock, is measured: a
    loaded machine makes the ranks' 3 s last longer, not the launcher's CPU larger."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps({"hosts": local(2)}))
    process = subprocess.Popen([sys.executable, str(rings.LAUNCHER), "--hostfile", str(hostfile),
                                "--starting-port", str(rings.starting_port()), "--", sys.executable, "-c",
                                "import time; [print(i, flush=True) or time.sleep(0.1) for i in range(30)]"],
                               stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    lines = process.stdout.read().splitlines()
    _, status, usage = os.wait4(process.pid, 0)
    process.stdout.close()
    process.returncode = os.waitstatus_to_exitcode(status)
    assert process.returncode == 0 and len(lines) == 60  # every line of both ranks passed on
    assert usage.ru_utime + usage.ru_stime < 1.0, usage


def test_two_ranks_lines_written_in_pieces_come_out_whole(tmp_path):
    """Each rank writes every line in two pieces with a pause between them (as a JSON row or a
    progress bar written in parts is): the launcher passes each rank's output on in whole lines,
    so no line of one rank ever runs into a line of the other (a clean-clone CI run once read two
    ranks' JSON rows as one line)."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps({"hosts": local(2)}))
    pieces = ("import os, sys, time\n"
              "rank = os.environ['MLX_RANK']\n"
              "for i in range(12):\n"
              "    sys.stdout.write(f'rank {rank} line {i}: first half'); sys.stdout.flush()\n"
              "    time.sleep(0.03)\n"
              "    sys.stdout.write(' second half\\n'); sys.stdout.flush()\n"
              "sys.stdout.write(f'rank {rank} bar 50%\\r'); sys.stdout.flush(); time.sleep(0.03)\n"
              "sys.stdout.write(f'rank {rank} bar 100%\\n')\n")
    done = subprocess.run([sys.executable, str(rings.LAUNCHER), "--hostfile", str(hostfile),
                           "--starting-port", str(rings.starting_port()), "--", sys.executable, "-c", pieces],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.replace("\r", "\n").splitlines()
    shape = r"rank [01] (line \d+: first half second half|bar \d+%)"
    whole = [line for line in lines if re.fullmatch(shape, line)]
    assert whole == lines and len(lines) == 2 * 14, lines


@pytest.mark.parametrize(("content", "says"), [
    ("not json", "not MLX's hosts file"),
    ('{"hosts": []}', "every host needs its ssh name"),
    ('{"hosts": [{"ssh": "10.0.0.1"}]}', "ring: every host needs its ips"),
])
def test_a_hosts_file_it_cannot_use_is_refused_naming_it(tmp_path, content, says):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(content)
    done = subprocess.run([sys.executable, str(rings.LAUNCHER), "--hostfile", str(hostfile), "--", "true"],
                          capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert done.returncode == 2 and str(hostfile) in done.stderr and says in done.stderr, done.stderr
    assert done.stdout == ""  # no rank started
