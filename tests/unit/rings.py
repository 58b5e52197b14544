"""Ranks started here on MLX's ring backend by the cluster's own launcher (the venv's
mlx-cluster-launch, roles/python_env/files/mlx_cluster_launch.py), for tests that train or serve on
several: every rank's host 127.0.0.1, so each runs in a shell of this machine, not over ssh.

The launcher gives the ranks of a ring listening ports from one starting port up (32323 by default).
Two such tests at once, on two pytest-xdist workers, would listen on the same ports and reset each
other's connections: each worker takes ports of its own, below Linux's ephemeral range (32768 up),
where no outgoing connection picks its port.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from mlxcluster.paths import REPO

LAUNCHER = REPO / "roles" / "python_env" / "files" / "mlx_cluster_launch.py"
FIRST_PORT = 30000
PORTS_PER_WORKER = 100  # a ring of up to 100 ranks per worker


def starting_port() -> int:
    """This test process's first port: one block per xdist worker (gw0, gw1, ...), the first alone."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    return FIRST_PORT + PORTS_PER_WORKER * index


def local_hosts(ranks: int) -> Path:
    """MLX's hosts file of `ranks` ranks on this machine, in a file of this worker's own."""
    hosts = {"backend": "ring", "hosts": [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * ranks}
    path = Path(tempfile.gettempdir()) / f"mlx-cluster-rings-{os.getuid()}-{starting_port()}-{ranks}.json"
    path.write_text(json.dumps(hosts) + "\n")
    return path


def launch(ranks: int) -> list[str]:
    """`ranks` ring ranks on this machine as the cluster's launcher starts them, up to the `--`
    before the program."""
    return [sys.executable, str(LAUNCHER), "--hostfile", str(local_hosts(ranks)),
            "--starting-port", str(starting_port()), "--"]
