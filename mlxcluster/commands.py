"""Command lines the invoke tasks run, built by plain functions so tests can assert on them."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def build_dir_for(inventory: str | Path) -> Path:
    """Controller build folder of one inventory: build/<inventory folder name>.

    Each inventory gets its own so that rendering the lab's hostfiles never
    overwrites those of the real cluster.
    """
    path = Path(inventory).resolve()
    folder = path if path.is_dir() else path.parent
    if folder == REPO / "inventory":  # inventory/<name>.yml: the user's own clusters
        name = "cluster" if path.is_dir() else path.stem
    elif folder.name == "inventory":  # e.g. /srv/mlx-lab/lab0/inventory/hosts.yml
        name = folder.parent.name
    else:  # inventory/local/hosts.yml
        name = folder.name
    return REPO / "build" / re.sub(r"[^A-Za-z0-9_.-]", "_", name)


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


def join(cmd: Sequence[str]) -> str:
    return shlex.join(cmd)


_RECAP = re.compile(
    r"^(?P<host>\S+)\s+:\s+ok=(?P<ok>\d+)\s+changed=(?P<changed>\d+)\s+"
    r"unreachable=(?P<unreachable>\d+)\s+failed=(?P<failed>\d+)", re.M)


def parse_recap(output: str) -> dict[str, dict[str, int]]:
    """Per-host counters from the PLAY RECAP of an ansible-playbook run."""
    return {m["host"]: {k: int(m[k]) for k in ("ok", "changed", "unreachable", "failed")}
            for m in _RECAP.finditer(output)}
