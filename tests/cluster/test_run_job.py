"""`invoke run` stopped on the controller, as a terminal's Ctrl-C or a service manager stops it, on
the two provisioned lab nodes: every rank of the job ends on every node, and invoke says so and
exits non-zero.

Without a tty (output piped, as here, in CI or under a service) ssh hangs nothing up on the
launcher: invoke run stops the job there itself (mlxcluster/jobs/everywhere.py), as invoke train
does, by the job's tag. The job is a program that never ends by itself and never talks to the other
rank, so nothing but that stop can end it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from mlxcluster.lab import hosts
from tests.cluster.conftest import LabCluster

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
INVOKE = str(Path(sys.executable).parent / "invoke")
NODES = (1, 2)


def job_processes(cluster: LabCluster, token: str) -> dict[int, list[int]]:
    """Each node's processes whose command line holds `token` (the ranks, and mpirun's or
    mlx-cluster-launch's own): a node's own are those of its network namespace (hosts.processes)."""
    return {node: hosts.processes(cluster.lab, node, token.encode(), python_only=False) for node in NODES}


def _ctrl_c_as_at_a_terminal() -> None:
    # A command started in the background by a shell without job control (as a CI script may
    # be) ignores SIGINT, and so does everything it starts: give invoke run the default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize(("stop", "backend"), [(signal.SIGINT, "mpi"), (signal.SIGTERM, "ring")],
                         ids=["ctrl-c-mpirun", "sigterm-mlx.launch"])
def test_stopping_invoke_run_stops_every_rank_on_every_node(provisioned, tmp_path, stop, backend):
    """Ctrl-C (SIGINT to invoke alone, as `kill -INT` or a terminal without ssh's tty sends it) over
    mpirun, and SIGTERM (a service manager's) over mlx-cluster-launch, which stops its ranks as it
    ends: no process of the job is left on either node, and invoke exits 130 with its line."""
    token = f"run-job-{uuid.uuid4().hex[:12]}"  # the ranks' own words: not invoke run's tag
    # Files, not pipes: a process left behind holding them must not hold up reading them.
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("w") as stdout, err.open("w") as stderr:
        job = subprocess.Popen(
            [INVOKE, "run", "-i", str(provisioned.inventory), "--backend", backend, "--",
             "python", "-c", "import time; time.sleep(600)", token],
            cwd=REPO, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
            preexec_fn=_ctrl_c_as_at_a_terminal)

    def said() -> str:
        return f"{out.read_text()[-2000:]}\n{err.read_text()[-2000:]}"

    try:
        deadline = time.monotonic() + 180
        while not all(hosts.processes(provisioned.lab, node, token.encode()) for node in NODES):
            if job.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the job's ranks never ran on both nodes (exit {job.poll()}): "
                            f"{job_processes(provisioned, token)}\n{said()}")
            time.sleep(0.3)
        stopped = time.monotonic()
        job.send_signal(stop)
        job.wait(timeout=90)
        returned = time.monotonic() - stopped
        deadline = time.monotonic() + 30
        while any((left := job_processes(provisioned, token)).values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        print(f"{signal.Signals(stop).name} ({backend}) -> invoke run exited {job.returncode} in "
              f"{returned:.1f} s; {time.monotonic() - stopped:.1f} s after the signal, left: {left}")
        assert left == {node: [] for node in NODES}, f"still running 30 s after invoke exited: {left}"
        assert job.returncode == 130, said()
        assert "interrupted: every rank of the job was stopped (node1, node2)" in err.read_text(), said()
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        for pids in job_processes(provisioned, token).values():  # never left for the next test
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
