"""Fixtures the data tests share."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.training.data.samples import save_tools_tokenizer
from training.data import prepare as tp


@pytest.fixture(scope="session")
def tools_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A byte-level tokenizer whose chat template renders tools and tool calls, loaded as mlx-lm
    loads a model's tokenizer for training (its TokenizerWrapper)."""
    return tp.load_tokenizer(save_tools_tokenizer(tmp_path_factory.mktemp("tools-tokenizer")))
