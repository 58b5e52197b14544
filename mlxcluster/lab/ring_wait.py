"""The library that stops a waiting ring rank from spinning on this machine's cores (ring_wait.c),
built once with the C compiler, for the tests' local ranks (mlxcluster/devtools.py) and the lab's
nodes (mlxcluster/lab/hosts.py).

MLX's ring backend retries a pending recv at once while its peer has sent nothing: a waiting rank
keeps a core busy (mlx/distributed/ring/ring.cpp). Real Macs each give their ranks cores of their
own; here two cores carry every node and every test's ranks, and a rank waiting for its peer took
the cores from the rank it waited for. Two local ranks, one computing while the other waits in
all_sum: 2.3 to 2.4 s of CPU without it, 1.5 s with it (three runs each, a quiet machine). The
pipeline's unit tests (2- and 3-rank rings, their launcher's polling gone too, tests/unit/rings.py):
197 s of CPU and 113 s against 87 s and 66 s. Only the waiting changes: what recv and send return,
errors and EAGAIN included, is the same.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_suffix(".c")


def library(folder: Path) -> Path | None:
    """The built library in `folder` (built there if it is not yet, named by its source's hash, so
    that an edited source is rebuilt); None where this machine has no C compiler."""
    source = SOURCE.read_bytes()
    built = folder / f"ring-wait-{hashlib.sha256(source).hexdigest()[:12]}.so"
    if built.is_file():
        return built
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    partial = built.with_suffix(f".{os.getpid()}.tmp")
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(partial), str(SOURCE), "-ldl"],
                   check=True, capture_output=True)
    partial.replace(built)  # whole or not at all: several workers may build it at once
    return built
