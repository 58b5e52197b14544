"""What the lab asks of this machine: commands run as root, and their failures said as a lab
error with the command and what it printed (hosts.py, cache.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from mlxcluster.errors import UserError

# Tools the lab itself needs on the host (they become part of every lab host's base image).
HOST_TOOLS = {"sshd": "openssh-server", "ssh": "openssh-client", "ip": "iproute2"}


class LabError(UserError):
    """A lab operation failed in a way the user can fix; the message says how."""

    def __init__(self, message: str):
        super().__init__(f"lab: {message}")


def run(cmd: list[str], *, capture: bool = False, check: bool = True,
        input: str | None = None) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(cmd, check=check, text=True, input=input,
                              capture_output=capture)
    except subprocess.CalledProcessError as exc:
        detail = (exc.stderr or "").strip()
        raise LabError(f"command failed ({exc.returncode}): {' '.join(cmd)}\n{detail}") from exc


def link_exists(name: str) -> bool:
    return run(["ip", "link", "show", name], capture=True, check=False).returncode == 0


def require_root() -> None:
    if os.geteuid() != 0:
        raise LabError("the lab cluster needs root (network namespaces, overlay mounts): "
                       "run it as root, e.g. `sudo invoke lab.up`")
    missing = [pkg for tool, pkg in HOST_TOOLS.items()
               if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists()]
    if missing:
        raise LabError("the lab needs these Debian packages on this machine: "
                       f"apt-get install {' '.join(sorted(set(missing)))}")
