"""The lab's offline cache: what it downloads follows the roles' pins."""

from __future__ import annotations

from mlxcluster.lab import cache


def test_node_requirements_follow_the_role_pins():
    assert cache.node_requirements() == ["mlx[cpu]==0.32.4", "mlx-lm==0.32.2"]
