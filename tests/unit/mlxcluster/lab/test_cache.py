"""The lab's offline cache: what it downloads follows the roles' pins."""

from __future__ import annotations

import yaml

from mlxcluster.lab import cache
from mlxcluster.paths import REPO


def test_node_requirements_follow_the_role_pins():
    assert cache.node_requirements() == ["mlx[cpu]==0.32.4", "mlx-lm==0.32.2", *cache.EXAMPLE_PACKAGES]


def test_the_examples_pin_what_the_lab_caches():
    """Each example's docstring tells the user the pin to provision with: the one the lab tests."""
    examples = REPO / "training" / "examples"
    text = {name: (examples / f"{name}.py").read_text() for name in ("xgboost_tracker", "mpi4py_allreduce")}
    assert "xgboost-cpu==3.2.0" in text["xgboost_tracker"] and "mpi4py==4.1.2" in text["mpi4py_allreduce"]
    assert set(cache.EXAMPLE_PACKAGES) == {"xgboost-cpu==3.2.0", "mpi4py==4.1.2"}


def test_every_lab_host_pip_installs_as_the_lab_says():
    """Molecule's shared inventory is YAML: it states the lab's pip arguments again, and must not drift."""
    shared = yaml.safe_load((REPO / "molecule/shared/inventory/hosts.yml").read_text())
    assert shared["cluster"]["vars"]["python_env_pip_extra_args"] == cache.PIP_ARGS
    assert "--no-compile" in cache.PIP_ARGS.split() and f"--find-links={cache.WHEELHOUSE}" in cache.PIP_ARGS
