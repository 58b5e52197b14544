"""What lab hosts install from, since they reach no registry: the Debian packages the roles
install, in this machine's /var/cache/apt/archives, and the pinned wheels, in a wheelhouse; both
are seen by every lab host through its /var overlay."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import yaml

from mlxcluster.lab.system import require_root, run
from mlxcluster.paths import REPO

WHEELHOUSE = Path("/var/cache/mlx-lab/wheels")
# How a lab host's pip installs (python_env_pip_extra_args): from the wheelhouse alone, and without
# byte-compiling what it installs. Compiling every module of transformers and the rest was three
# quarters of a venv's install (mlx and mlx-lm: 42 s against 11 s), and a lab host imports a few of
# them; Python compiles those on first import, as it would on a user's Mac.
PIP_ARGS = f"--no-index --find-links={WHEELHOUSE} --no-compile"
# Debian packages the roles install on Linux nodes; the lab caches them.
APT_PACKAGES = ("openmpi-bin", "libopenmpi-dev", "libopenblas0-pthread", "python3-venv", "g++",
                "iputils-ping", "rsync")
# The packages of invoke run's examples (training/examples/, docs/any-job.md), as pinned there: the
# lab installs them with python_env_extra_packages, as a user would.
EXAMPLE_PACKAGES = ("xgboost-cpu==3.2.0", "mpi4py==4.1.2")


def node_requirements() -> list[str]:
    """The pip requirements the python_env role installs on a Linux node, from its defaults, and
    those of the examples."""
    defaults = yaml.safe_load((REPO / "roles/python_env/defaults/main.yml").read_text())
    return [f"mlx[cpu]=={defaults['python_env_mlx_version']}",
            f"mlx-lm=={defaults['python_env_mlx_lm_version']}", *EXAMPLE_PACKAGES]


def prepare_offline_cache(mlx_requirements: list[str] | None = None) -> None:
    """Fill the caches lab hosts install from: apt archives and a wheelhouse.

    Idempotent and quick when the caches are already full. Needs the registries
    (run it where they are reachable: CI and developer machines).
    """
    require_root()
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    # Several labs (test runs side by side) fill the same caches: one at a time, as apt's own
    # lock would otherwise fail the second with "Could not get lock".
    with open(WHEELHOUSE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _fill_caches(mlx_requirements or node_requirements())


def _fill_caches(mlx_requirements: list[str]) -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    download = ["apt-get", "install", "-y", "-q", "--download-only", *APT_PACKAGES]
    if subprocess.run(download, env=env, capture_output=True).returncode != 0:
        # The package lists may be missing or stale on a fresh machine.
        run(["apt-get", "update", "-q"], capture=True)
        run(download, capture=True)
    run([sys.executable, "-m", "pip", "download", "-q", "--dest", str(WHEELHOUSE),
         "--only-binary=:all:", *mlx_requirements, "pip", "setuptools", "wheel"], capture=True)
