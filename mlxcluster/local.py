"""Commands the controller runs on itself: the venv's tools, from the repository root.

The venv's bin directory comes first on PATH (ansible-playbook, ruff, molecule...) and the
repository is the working directory, so ansible.cfg applies. Output goes straight to this
terminal (colours and all); a failure is a `CommandFailed` with the command's exit status.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence

from mlxcluster.errors import UserError
from mlxcluster.paths import REPO

VENV_BIN = os.path.dirname(sys.executable)


class CommandFailed(UserError):
    """A local command failed; its own output said why."""


def tool_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment with the venv's tools first on PATH (and `extra` on top)."""
    return {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            **(extra or {})}


def run(cmd: Sequence[str], env: Mapping[str, str] | None = None) -> None:
    """Run `cmd` with its output on this terminal; CommandFailed if it fails."""
    code = subprocess.run(list(cmd), cwd=REPO, env=tool_env(env)).returncode
    if code:
        raise CommandFailed(f"{shlex.join(cmd)[:300]} failed (exit {code})", code=code)


def python_module(module: str, args: Sequence[str]) -> None:
    """`python -m module args` with this venv's python."""
    run([sys.executable, "-m", module, *args])
