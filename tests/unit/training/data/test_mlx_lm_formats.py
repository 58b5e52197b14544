"""Every input format, prepared, then read back by mlx-lm itself (`load_local_dataset`, the loader
training uses) with a real tokenizer whose chat template renders tools: each example tokenizes and
renders what the row said; duplicates, the length filter, the split and summary.json work for
every format."""

from __future__ import annotations

import json
import types
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.tuner.datasets import load_local_dataset

from tests.unit.training.data.samples import KINDS
from tests.unit.training.data.test_prepare import all_rows, read_jsonl, run, write_jsonl
from training.data import prepare as tp

SPLITS = ("train", "valid", "test")


def mlx_lm_examples(output: Path, tokenizer: Any, mask_prompt: bool = False) -> list[tuple[Any, Any, int]]:
    """(dataset, tokens, prompt length) of every example, as mlx-lm's trainer gets them."""
    datasets = load_local_dataset(output, tokenizer, types.SimpleNamespace(mask_prompt=mask_prompt))
    return [(dataset, *dataset.process(dataset[index]))
            for dataset in datasets for index in range(len(dataset))]


def split_of_lines(output: Path) -> dict[str, str]:
    """The split each written line landed in."""
    return {json.dumps(row, sort_keys=True): name for name in SPLITS if (output / f"{name}.jsonl").exists()
            for row in read_jsonl(output / f"{name}.jsonl")}


@pytest.mark.parametrize("name", KINDS)
def test_every_prepared_example_tokenizes_as_mlx_lm_reads_it(tmp_path: Path, tools_tokenizer: Any,
                                                            name: str) -> None:
    kind = KINDS[name]
    rows = [kind.row(index) for index in range(12)]
    summary = run(write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out", test_fraction=0.25,
                  tokenizer=tools_tokenizer)
    assert (summary.format, summary.kept, summary.length_unit) == (kind.format, 12, "tokens")
    examples = mlx_lm_examples(tmp_path / "out", tools_tokenizer)
    assert len(examples) == 12 and {type(dataset) for dataset, _, _ in examples} == {kind.dataset}
    texts = [tools_tokenizer.decode(tokens) for _, tokens, _ in examples]
    for index in range(12):
        # Each row's example, and only it, renders every piece of the row.
        assert sum(all(piece in text for piece in kind.shows(index)) for text in texts) == 1, (index, texts)
    lengths = [len(tokens) for _, tokens, _ in examples]
    assert (summary.length_min, summary.length_max) == (min(lengths), max(lengths))
    if kind.as_written:
        assert sorted_rows(all_rows(tmp_path / "out")) == sorted_rows(rows)


def sorted_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda row: json.dumps(row, sort_keys=True))


@pytest.mark.parametrize("name", [name for name, kind in KINDS.items() if kind.format != "text"])
def test_with_prompt_masking_mlx_lm_finds_the_prompt_of_every_example(tmp_path: Path, tools_tokenizer: Any,
                                                                     name: str) -> None:
    rows = [KINDS[name].row(index) for index in range(6)]
    run(write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out", tokenizer=tools_tokenizer)
    for _, tokens, offset in mlx_lm_examples(tmp_path / "out", tools_tokenizer, mask_prompt=True):
        assert 0 < offset < len(tokens)


@pytest.mark.parametrize("name", KINDS)
def test_duplicates_and_long_examples_are_dropped_in_every_format(tmp_path: Path, tools_tokenizer: Any,
                                                                name: str) -> None:
    kind = KINDS[name]
    rows = [kind.row(index) for index in range(10)]
    longest = run(write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "first", tokenizer=tools_tokenizer)
    long_row = kind.row(10**400)  # the same shape, with a 401-digit number in its text
    source = write_jsonl(tmp_path / "in.jsonl", [*rows, rows[3], long_row, rows[7]])
    summary = run(source, tmp_path / "out", tokenizer=tools_tokenizer, max_tokens=longest.length_max)
    assert (summary.rows_read, summary.kept, summary.dropped_duplicates, summary.dropped_too_long) == (
        13, 10, 2, 1)
    assert json.loads((tmp_path / "out" / "summary.json").read_text()) == asdict(summary)
    assert len(all_rows(tmp_path / "out")) == summary.train + summary.valid == 10


@pytest.mark.parametrize("name", KINDS)
def test_the_split_of_every_format_is_stable_for_a_seed_and_when_rows_are_appended(
    tmp_path: Path, name: str
) -> None:
    kind = KINDS[name]
    rows = [kind.row(index) for index in range(40)]
    run(write_jsonl(tmp_path / "few.jsonl", rows[:25]), tmp_path / "few", seed=5, test_fraction=0.2)
    run(write_jsonl(tmp_path / "all.jsonl", rows), tmp_path / "all", seed=5, test_fraction=0.2)
    run(write_jsonl(tmp_path / "all.jsonl", rows), tmp_path / "again", seed=5, test_fraction=0.2)
    run(write_jsonl(tmp_path / "all.jsonl", rows), tmp_path / "other", seed=6, test_fraction=0.2)
    few, every = split_of_lines(tmp_path / "few"), split_of_lines(tmp_path / "all")
    assert len(few) == 25 and len(every) == 40
    assert {line: every[line] for line in few} == few
    assert split_of_lines(tmp_path / "again") == every != split_of_lines(tmp_path / "other")
    assert set(every.values()) == set(SPLITS)


def test_tool_calls_and_tools_count_as_characters() -> None:
    plain = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    calling = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "tool_calls": [call]}]}
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert tp.example_length(plain) == 2
    calls = len(tp.canonical([call]))
    assert tp.example_length(calling) == 1 + calls
    assert tp.example_length(calling | {"tools": tools}) == 1 + calls + len(tp.canonical(tools))
    assert tp.example_length({"prompt": "abc", "completion": "de"}) == 5
    assert tp.example_length({"text": " abc "}) == 5


def test_a_text_example_counts_the_end_token_mlx_lm_adds(tools_tokenizer: Any) -> None:
    assert tp.example_length({"text": "abc"}, tools_tokenizer) == 4
    assert tp.example_length({"text": "abc<|im_end|>"}, tools_tokenizer) == 4
