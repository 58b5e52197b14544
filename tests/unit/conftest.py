"""Fixtures the unit test modules share."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def uneven_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama, uneven chat data, and one single-process run over them (global batch 4), the
    baseline that runs on several ranks must match (test_shares_training, test_tensor_parallel)."""
    from tests.unit.training.model.test_folder import tiny_model
    from tests.unit.training.test_finetune import training_args
    from tests.unit.training.test_shares_training import uneven
    from training import finetune as ft

    root = tmp_path_factory.mktemp("shares")
    tiny_model(root / "model")
    (root / "data").mkdir()
    (root / "data" / "train.jsonl").write_text("".join(json.dumps(uneven(i)) + "\n" for i in range(24)))
    (root / "data" / "valid.jsonl").write_text("".join(json.dumps(uneven(i)) + "\n" for i in range(500, 508)))
    with contextlib.redirect_stdout(io.StringIO()):
        assert ft.main(training_args(root / "model", root / "data", root / "single"), environ={}) == 0
    return root
