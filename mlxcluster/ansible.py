"""The ansible-playbook command lines, and what a run's recap says.

Built by plain functions so tests can assert on them. `provision` renders the controller's copy
of the hostfiles and the recorded layout into the inventory's build folder (mlxcluster/paths.py).
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from mlxcluster import local
from mlxcluster.errors import UserError
from mlxcluster.paths import REPO, build_dir_for


def ansible_playbook(playbook: str, inventory: str | Path, *,
                     extra_vars: Mapping[str, str] | None = None,
                     check: bool = False, diff: bool = False,
                     tags: str | None = None, limit: str | None = None,
                     verbose: int = 0) -> list[str]:
    """The ansible-playbook command line for ``playbook`` on ``inventory``."""
    cmd = ["ansible-playbook", "-i", str(inventory), str(playbook)]
    for key, value in (extra_vars or {}).items():
        cmd += ["-e", f"{key}={value}"]
    if check:
        cmd.append("--check")
    if diff:
        cmd.append("--diff")
    if tags:
        cmd += ["--tags", tags]
    if limit:
        cmd += ["--limit", limit]
    if verbose:
        cmd.append("-" + "v" * verbose)
    return cmd


def provision(inventory: str | Path, **kwargs: object) -> list[str]:
    """``site.yml`` on the inventory, rendering the controller files into its build folder."""
    extra = {"hostfile_build_dir": str(build_dir_for(inventory))}
    return ansible_playbook(str(REPO / "site.yml"), inventory, extra_vars=extra,
                            **kwargs)  # type: ignore[arg-type]


def render_hostfiles(inventory: str | Path, output: str | Path) -> list[str]:
    """Render the MPI hostfile and MLX hosts.json into ``output``, touching no host."""
    return ansible_playbook(str(REPO / "playbooks" / "render.yml"), inventory,
                            extra_vars={"hostfile_build_dir": str(Path(output).resolve())})


_RECAP = re.compile(
    r"^(?P<host>\S+)\s+:\s+ok=(?P<ok>\d+)\s+changed=(?P<changed>\d+)\s+"
    r"unreachable=(?P<unreachable>\d+)\s+failed=(?P<failed>\d+)", re.M)


def parse_recap(output: str) -> dict[str, dict[str, int]]:
    """Per-host counters from the PLAY RECAP of an ansible-playbook run."""
    return {m["host"]: {k: int(m[k]) for k in ("ok", "changed", "unreachable", "failed")}
            for m in _RECAP.finditer(output)}


def timed_run(cmd: list[str], env: Mapping[str, str] | None = None) -> tuple[float, dict]:
    """Run a playbook quietly: (seconds it took, its recap); a UserError with its output's tail
    if it fails."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=local.tool_env(env), capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise UserError(f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}")
    return elapsed, parse_recap(proc.stdout)
