"""Completions and text rows, kept in their own formats; files that mix formats; the first row's
keys that decide the format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.unit.training.data.samples import chat_row, completions_row, dolly_row, text_row, tool_chat_row
from tests.unit.training.data.test_prepare import all_rows, run, write_jsonl
from training.data import prepare as tp

Row = dict[str, Any]


def refused(tmp_path: Path, rows: list[Any], **options: Any) -> str:
    """The refusal of `rows`, with the input's path shown as IN; nothing is written."""
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    with pytest.raises(tp.DataError) as caught:
        run(source, tmp_path / "out", **options)
    assert not (tmp_path / "out").exists()
    return str(caught.value).replace(str(source), "IN")


@pytest.mark.parametrize(("bad", "says"), [
    ({"completion": "c"}, "completions row has no 'prompt'"),
    ({"prompt": "p"}, "completions row has no 'completion'"),
    ({"prompt": "p", "completion": None}, "completions row has no 'completion'"),
    ({"prompt": 3, "completion": "c"}, "completions row's 'prompt' is not a string"),
    ({"prompt": "p", "completion": ["c"]}, "completions row's 'completion' is not a string"),
    ({"prompt": "p", "completion": " \n"}, "completions row has an empty 'completion'"),
    ({"prompt": "", "completion": "c"}, "completions row has an empty 'prompt'"),
    ({"prompt": "p", "completion": "c", "tools": "get_weather"},
     "'tools' must be a list of objects (function schemas such as {\"type\": \"function\", \"function\": "
     "{\"name\": ..., \"parameters\": {...}}}), not a string"),
])
def test_a_bad_completions_row_is_named(tmp_path: Path, bad: Row, says: str) -> None:
    assert refused(tmp_path, [completions_row(1), completions_row(2), bad]) == f"IN:3: {says}"


@pytest.mark.parametrize(("bad", "says"), [
    ({"id": 3}, "text row has no 'text'"),
    ({"text": ["a", "b"]}, "text row's 'text' is not a string"),
    ({"text": 7}, "text row's 'text' is not a string"),
    ({"text": " \n\t"}, "text row has an empty 'text'"),
    ({"text": "bad \ud800 text"},
     "text that is not valid Unicode (surrogates not allowed, '\\ud800'): fix or drop the row"),
])
def test_a_bad_text_row_is_named(tmp_path: Path, bad: Row, says: str) -> None:
    assert refused(tmp_path, [text_row(1), text_row(2), bad]) == f"IN:3: {says}"


@pytest.mark.parametrize(("first", "other", "found", "expected"), [
    (completions_row, text_row, "text", "completions"),
    (text_row, chat_row, "chat", "text"),
    (text_row, completions_row, "completions", "text"),
    (chat_row, completions_row, "completions", "chat"),
    (tool_chat_row, text_row, "text", "chat"),
    (dolly_row, text_row, "text", "dolly"),
    (completions_row, dolly_row, "dolly", "completions"),
])
def test_a_file_mixing_formats_is_refused_at_the_first_row_that_differs(
    tmp_path: Path, first: Any, other: Any, found: str, expected: str
) -> None:
    rows = [first(0), first(1), first(2), other(3), other(4), first(5)]
    assert refused(tmp_path, rows) == (f"IN:4: a {found} row in a file of {expected} rows (the first row's "
                                       "keys decide the format): every row must be of one format")


@pytest.mark.parametrize(("make", "data_format"), [(completions_row, "completions"), (text_row, "text")])
def test_a_system_prompt_is_refused_for_formats_without_a_system_message(
    tmp_path: Path, make: Any, data_format: str
) -> None:
    rows = [make(index) for index in range(4)]
    assert refused(tmp_path, rows, system_prompt="Be a pirate.") == (
        f"IN: --system-prompt given for {data_format} rows, which have no system message (mlx-lm trains "
        "on them as written): drop it, or use chat rows")


@pytest.mark.parametrize("make", [completions_row, text_row])
def test_other_keys_of_completions_and_text_rows_are_dropped(tmp_path: Path, make: Any) -> None:
    rows = [make(index) | {"id": index, "meta": {"source": "crawl"}} for index in range(4)]
    run(write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out")
    assert sorted(all_rows(tmp_path / "out"), key=json.dumps) == sorted(map(make, range(4)), key=json.dumps)


def test_the_first_row_with_no_known_keys_lists_every_format(tmp_path: Path) -> None:
    assert refused(tmp_path, [{"question": "q", "answer": "a"}, text_row(1)]) == (
        "IN:1: cannot tell the format from the keys ['answer', 'question']: expected 'messages' (chat), "
        "'prompt' + 'completion' (completions), 'instruction' + 'output' (alpaca), 'instruction' + "
        "'response' (dolly), 'text' (text)")


@pytest.mark.parametrize(("make", "data_format"), [
    (lambda i: chat_row(i) | {"text": f"a rendering of chat {i}"}, "chat"),
    (lambda i: completions_row(i) | {"text": f"completion {i}"}, "completions"),
    (lambda i: {"instruction": f"i{i}", "input": "", "output": "o", "text": f"### Instruction: i{i}"},
     "alpaca"),
    (lambda i: dolly_row(i) | {"text": f"dolly {i}"}, "dolly"),
])
def test_a_row_with_a_text_column_besides_its_own_keys_is_of_its_own_format(
    tmp_path: Path, make: Any, data_format: str
) -> None:
    summary = run(write_jsonl(tmp_path / "in.jsonl", [make(1), make(2)]), tmp_path / "out")
    assert summary.format == data_format
    assert all("text" not in written for written in all_rows(tmp_path / "out"))
