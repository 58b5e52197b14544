from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
# Tools that shell out to ansible-inventory, molecule & co. (testinfra's ansible backend)
# must find the venv's, however pytest was started.
if str(VENV_BIN) not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"


@pytest.fixture
def tool_env() -> dict[str, str]:
    """Environment in which the venv's ansible-playbook & co. come first on PATH."""
    return {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"}
