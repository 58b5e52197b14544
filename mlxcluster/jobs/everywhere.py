"""`invoke run -- CMD ARGS...`: any program on every slot, launched as training is.

The same launch builder as invoke train (mlxcluster/launch/builder.py): the rendered hostfile, the
cluster link pinned, env.sh and the environment training's ranks get; the training code is synced
first, so `python -m training.examples.logistic_regression` works on a freshly provisioned cluster.
"""

from __future__ import annotations

import shlex
import subprocess
import sys

from mlxcluster.describe.cluster import Cluster
from mlxcluster.errors import UserError
from mlxcluster.launch import builder, sync
from mlxcluster.paths import REPO


def program_of(words: str) -> list[str]:
    """The program from the words after `--` (invoke joins them: quote within them)."""
    program = shlex.split(words)
    if not program:
        raise UserError("nothing to run: invoke run -- CMD ARGS...  (e.g. invoke run -- hostname)")
    return program


def command(cluster: Cluster, program: list[str], interface: str | None = None,
            interactive: bool | None = None) -> list[str]:
    """The controller's command that starts `program` on every slot, as training starts."""
    if interactive is None:
        interactive = sys.stdin.isatty() and sys.stdout.isatty()
    # Any program, not only Python: mpirun starts it (mlx.launch starts Python programs only).
    return builder.command(cluster, builder.Job(program, backend=builder.backend_for(cluster, "mpi"),
                                              interface=interface, interactive=interactive))


def run(cluster: Cluster, program: list[str], *, interface: str | None = None,
        dry_run: bool = False) -> None:
    """Sync the code, then run `program` on every slot; a UserError with its exit status if it
    fails."""
    sync.run_steps(sync.push_code(cluster), dry_run=dry_run)
    cmd = command(cluster, program, interface)
    if dry_run:
        print(f"# run on {cluster.head.name}\n{shlex.join(cmd)}")
        return
    if code := subprocess.run(cmd, cwd=REPO).returncode:
        raise UserError(code=code)
