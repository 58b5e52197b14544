"""The nodes and the controller must run the same MLX: one set of pins, checked here."""

from __future__ import annotations

import tomllib
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[3]


def test_node_pins_match_the_controller_pins():
    defaults = yaml.safe_load((REPO / "roles/python_env/defaults/main.yml").read_text())
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"mlx[cpu]=={defaults['python_env_mlx_version']}; sys_platform == 'linux'" in deps
    assert f"mlx=={defaults['python_env_mlx_version']}; sys_platform == 'darwin'" in deps
    assert f"mlx-lm=={defaults['python_env_mlx_lm_version']}" in deps


def test_every_controller_dependency_is_pinned():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    for dep in project["project"]["dependencies"] + project["dependency-groups"]["dev"]:
        assert "==" in dep, f"{dep} is not pinned"
