"""Ranks started here on MLX's ring backend (mlx.launch), for tests that train or serve on several.

mlx.launch gives the ranks of a ring listening ports from one starting port up (32323 by default).
Two such tests at once, on two pytest-xdist workers, would listen on the same ports and reset each
other's connections: each worker takes ports of its own, below Linux's ephemeral range (32768 up),
where no outgoing connection picks its port.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

FIRST_PORT = 30000
PORTS_PER_WORKER = 100  # a ring of up to 100 ranks per worker


def starting_port() -> int:
    """This test process's first port: one block per xdist worker (gw0, gw1, ...), the first alone."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    return FIRST_PORT + PORTS_PER_WORKER * index


def launch(ranks: int) -> list[str]:
    """mlx.launch of `ranks` ring ranks on this machine, up to the `--` before the program."""
    return [str(Path(sys.executable).parent / "mlx.launch"), "--backend", "ring", "-n", str(ranks),
            "--starting-port", str(starting_port()), "--"]
