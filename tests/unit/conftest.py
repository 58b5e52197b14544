"""Fixtures the unit test modules share."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def uneven_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama, uneven chat data, and one single-process run over them (global batch 4), the
    baseline that runs on several ranks must match (test_shares_training, test_tensor_parallel)."""
    from tests.unit.training.test_shares_training import uneven_baseline

    return uneven_baseline(tmp_path_factory.mktemp("shares"))
