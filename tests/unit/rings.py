"""Ranks started here on MLX's ring backend, as mlx.launch starts them, for tests that train or serve on
several (tests/unit/ring_ranks.py).

mlx.launch gives the ranks of a ring listening ports from one starting port up (32323 by default).
Two such tests at once, on two pytest-xdist workers, would listen on the same ports and reset each
other's connections: each worker takes ports of its own, below Linux's ephemeral range (32768 up),
where no outgoing connection picks its port.
"""

from __future__ import annotations

import os
import sys

FIRST_PORT = 30000
PORTS_PER_WORKER = 100  # a ring of up to 100 ranks per worker


def starting_port() -> int:
    """This test process's first port: one block per xdist worker (gw0, gw1, ...), the first alone."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    return FIRST_PORT + PORTS_PER_WORKER * index


def launch(ranks: int) -> list[str]:
    """`ranks` ring ranks on this machine as mlx.launch starts them (tests/unit/ring_ranks.py, which
    does not keep a core busy while they run), up to the `--` before the program."""
    return [sys.executable, "-m", "tests.unit.ring_ranks", "-n", str(ranks),
            "--starting-port", str(starting_port()), "--"]
