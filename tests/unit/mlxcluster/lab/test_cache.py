"""The lab's offline cache: what it downloads follows the roles' pins."""

from __future__ import annotations

from mlxcluster.lab import cache
from mlxcluster.paths import REPO


def test_node_requirements_follow_the_role_pins():
    assert cache.node_requirements() == ["mlx[cpu]==0.32.4", "mlx-lm==0.32.2", *cache.EXAMPLE_PACKAGES]


def test_the_examples_pin_what_the_lab_caches():
    """Each example's docstring tells the user the pin to provision with: the one the lab tests."""
    examples = REPO / "training" / "examples"
    said = {name: (examples / f"{name}.py").read_text() for name in ("xgboost_tracker", "mpi4py_allreduce")}
    assert "xgboost-cpu==3.2.0" in said["xgboost_tracker"] and "mpi4py==4.1.2" in said["mpi4py_allreduce"]
    assert set(cache.EXAMPLE_PACKAGES) == {"xgboost-cpu==3.2.0", "mpi4py==4.1.2"}
