"""What a user reads when something they gave cannot be used (mlxcluster/errors.py): a value in one
short line however big it is, and why a file cannot be read in words, not Python's own text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxcluster.errors import reason, shown
from mlxcluster.launch import shipment
from mlxcluster.launch.shipment import ShipmentError
from training.model.manifest import MANIFEST


def test_a_value_whose_items_repeat_without_end_is_shown_in_a_line():
    laughs: list = ["lol"] * 9
    for _ in range(40):  # 9**40 items once expanded: printing them whole would never end
        laughs = [laughs] * 9
    assert len(shown(laughs)) <= 304 and "\n" not in shown(laughs)
    assert shown(Path("/a b/c")) == "/a b/c" and shown("two\nlines") == "'two\\nlines'"


@pytest.mark.parametrize(("text", "says"), [
    ("", "not valid JSON: expecting value at line 1, column 1"),
    ('{"files": ', "not valid JSON: expecting value at line 1, column 11"),
    (b"\xff\xfe{", "not UTF-8 text"),
])
def test_a_file_that_cannot_be_read_is_said_in_words(tmp_path: Path, text: str | bytes, says: str):
    model = tmp_path / "model"
    model.mkdir()
    manifest = model / MANIFEST
    manifest.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ShipmentError) as refused:
        shipment.model(model)
    assert f"its {MANIFEST} cannot be read ({says}): fetch the model again" in str(refused.value)
    assert "char" not in str(refused.value) and "Errno" not in str(refused.value)


def test_an_os_error_is_its_description():
    with pytest.raises(OSError) as raised:
        Path("/nowhere/at/all").read_text()
    assert reason(raised.value) == "no such file or directory"
    with pytest.raises(json.JSONDecodeError) as broken:
        json.loads("[1,")
    assert reason(broken.value).startswith("not valid JSON: expecting value at line 1")
