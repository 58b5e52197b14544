"""training.data.prepare: formats, validation, hash split, filtering, atomic output, CLI; the pirate data."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from training.data import make_pirate
from training.data import prepare as tp
from training.tools import pirate

PIRATE_DATA = Path(tp.__file__).with_name("pirate.jsonl")
# One token per whitespace-separated word, plus "<role>" and "</s>" around each message.
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} </s> {% endfor %}"


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    # As mlx-lm reads them: lines end at "\n" (a JSON string may hold U+2028).
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]


def dolly(index: int, context: str = "") -> dict[str, str]:
    return {
        "instruction": f"Question number {index}?",
        "context": context,
        "response": f"Answer number {index}.",
        "category": "open_qa",
    }


def run(source: Path, output: Path, **options: Any) -> tp.Summary:
    return tp.prepare(source, output, console=Console(file=io.StringIO()), **options)


def all_rows(output: Path) -> list[dict[str, Any]]:
    """Every example written, whatever its split."""
    names = [f"{name}.jsonl" for name in ("train", "valid", "test")]
    return [row for name in names if (output / name).exists() for row in read_jsonl(output / name)]


def split_of(output: Path) -> dict[str, str]:
    """The split each example (by its user message) landed in."""
    found = {}
    for name in ("train", "valid", "test"):
        path = output / f"{name}.jsonl"
        if path.exists():
            for row in read_jsonl(path):
                user = next(m["content"] for m in row["messages"] if m["role"] == "user")
                found[user] = name
    return found


def snapshot(directory: Path) -> dict[str, str]:
    return {path.name: path.read_text() for path in directory.iterdir()}


@pytest.fixture
def tiny_tokenizer(tmp_path: Path) -> Path:
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "</s>": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    directory = tmp_path / "model"
    fast.save_pretrained(directory)
    return directory


# formats


def test_dolly_rows_become_chat_with_context_appended_only_when_present(tmp_path: Path) -> None:
    rows = [dolly(1, context="Some passage."), dolly(2), dolly(3, context="   "), dolly(4)]
    del rows[3]["context"]
    summary = run(write_jsonl(tmp_path / "d.jsonl", rows), tmp_path / "out", valid_fraction=0.5)
    assert summary.format == "dolly"
    found = {row["messages"][0]["content"]: row["messages"] for row in all_rows(tmp_path / "out")}
    assert found["Question number 1?\n\nSome passage."] == [
        {"role": "user", "content": "Question number 1?\n\nSome passage."},
        {"role": "assistant", "content": "Answer number 1."},
    ]
    assert {"Question number 2?", "Question number 3?", "Question number 4?"} <= found.keys()


def test_alpaca_rows_append_input_only_when_non_empty(tmp_path: Path) -> None:
    rows = [
        {"instruction": "Translate.", "input": "Hello", "output": "Ahoy"},
        {"instruction": "Greet me.", "input": "", "output": "Ahoy, matey"},
    ]
    summary = run(write_jsonl(tmp_path / "a.jsonl", rows), tmp_path / "out", valid_fraction=0.5)
    assert summary.format == "alpaca"
    users = sorted(row["messages"][0]["content"] for row in all_rows(tmp_path / "out"))
    assert users == ["Greet me.", "Translate.\n\nHello"]
    assistants = sorted(row["messages"][1]["content"] for row in all_rows(tmp_path / "out"))
    assert assistants == ["Ahoy", "Ahoy, matey"]


def test_chat_rows_pass_through_and_the_system_prompt_fills_only_missing_ones(tmp_path: Path) -> None:
    own = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]
    plain = [{"role": "user", "content": "Yo"}, {"role": "assistant", "content": "Ahoy"}]
    source = write_jsonl(tmp_path / "c.jsonl", [{"messages": own}, {"messages": plain, "id": 7}])
    summary = run(source, tmp_path / "out", valid_fraction=0.5, system_prompt="Talk like a pirate.")
    assert summary.format == "chat"
    rows = sorted(all_rows(tmp_path / "out"), key=lambda row: len(row["messages"][0]["content"]))
    assert rows == [
        {"messages": own},
        {"messages": [{"role": "system", "content": "Talk like a pirate."}, *plain]},
    ]


def test_a_json_file_holding_a_list_is_accepted(tmp_path: Path) -> None:
    source = tmp_path / "rows.json"
    source.write_text(json.dumps([dolly(1), dolly(2), dolly(3)]))
    summary = run(source, tmp_path / "out")
    assert (summary.rows_read, summary.kept, summary.train + summary.valid) == (3, 3, 3)


def test_a_bad_row_in_a_json_list_is_named_by_its_position(tmp_path: Path) -> None:
    source = tmp_path / "rows.json"
    source.write_text(json.dumps([dolly(1), {"instruction": "x", "context": ""}]))
    with pytest.raises(tp.DataError, match=r"rows\.json: row 2: dolly row has no 'response'"):
        run(source, tmp_path / "out")


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"instruction": "x", "input": "y"}, "alpaca row has no 'output'"),
        ({"instruction": "x"}, "alpaca row has no 'output'"),
        (
            {"instruction": "x", "response": "y"},
            "a dolly row in a file of alpaca rows (the first row's keys decide the format): every row "
            "must be of one format",
        ),
        ({"input": "y", "output": "z"}, "alpaca row has no 'instruction'"),
        ({"instruction": "x", "output": 3}, "alpaca row's 'output' is not a string"),
        ({"instruction": " ", "output": "z"}, "alpaca row has an empty 'instruction'"),
        (["instruction", "output"], "expected a JSON object, got list"),
    ],
)
def test_a_row_missing_its_fields_names_file_line_and_field(tmp_path: Path, row: Any, message: str) -> None:
    good = {"instruction": "Say hi.", "input": "", "output": "Ahoy"}
    source = write_jsonl(tmp_path / "data.jsonl", [good, good | {"output": "Arr"}, row])
    with pytest.raises(tp.DataError) as caught:
        run(source, tmp_path / "out")
    assert str(caught.value) == f"{source}:3: {message}"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ("hi", "chat row's 'messages' must be a non-empty list"),
        ([], "chat row's 'messages' must be a non-empty list"),
        (
            [{"role": "function", "content": "x"}],
            "message 1 has role 'function': expected one of system, user, assistant, tool",
        ),
        ([{"role": "user", "content": None}], "message 1: 'content' is null, which only an assistant "
         "message with tool_calls may be"),
        ([{"content": "x"}], "message 1 has no 'role'"),
        ([{"role": "user"}], "message 1 has no 'content'"),
        ([{"role": "user", "content": ["x"]}], "message 1: 'content' is not a string"),
        (
            [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}],
            "chat row has no user message",
        ),
        (
            [{"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}],
            "chat row must end with an assistant message, not a user one",
        ),
    ],
)
def test_chat_messages_are_validated(tmp_path: Path, messages: Any, message: str) -> None:
    good = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
    source = write_jsonl(tmp_path / "chat.jsonl", [good, {"messages": messages}])
    with pytest.raises(tp.DataError) as caught:
        run(source, tmp_path / "out")
    assert str(caught.value) == f"{source}:2: {message}"


def test_a_chat_file_with_an_instruction_row_names_the_row_and_both_formats(tmp_path: Path) -> None:
    good = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
    source = write_jsonl(tmp_path / "chat.jsonl", [good, dolly(1)])
    with pytest.raises(tp.DataError, match=r"chat\.jsonl:2: a dolly row in a file of chat rows"):
        run(source, tmp_path / "out")


def test_a_chat_file_with_a_row_of_no_format_says_the_row_has_no_messages(tmp_path: Path) -> None:
    good = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
    source = write_jsonl(tmp_path / "chat.jsonl", [good, {"id": 2}])
    with pytest.raises(tp.DataError, match=r"chat\.jsonl:2: chat row has no 'messages'"):
        run(source, tmp_path / "out")


def test_an_unknown_format_is_an_error(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "x.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(tp.DataError, match=r"x\.jsonl:1: cannot tell the format"):
        run(source, tmp_path / "out")


# bad input writes nothing


def test_a_malformed_line_names_file_and_line_and_leaves_the_output_untouched(tmp_path: Path) -> None:
    source = tmp_path / "data.jsonl"
    lines = [json.dumps(dolly(index)) for index in range(20)]
    lines.insert(16, '{"instruction": "broken", ')
    source.write_text("\n".join(lines) + "\n")
    output = tmp_path / "out"
    output.mkdir()
    (output / "train.jsonl").write_text("old train\n")
    (output / "valid.jsonl").write_text("old valid\n")
    before = snapshot(output)

    with pytest.raises(tp.DataError, match=r"^.*data\.jsonl:17: not valid JSON"):
        run(source, output)
    assert snapshot(output) == before
    assert sorted(path.name for path in tmp_path.iterdir()) == ["data.jsonl", "out"]


def test_cli_reports_bad_input_on_stderr_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_jsonl(tmp_path / "data.jsonl", [dolly(1), {"instruction": "x", "context": ""}])
    assert tp.main(["--input", str(source), "--output", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"error: {source}:2: dolly row has no 'response'\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_an_empty_input_is_an_error(tmp_path: Path, text: str) -> None:
    source = tmp_path / "empty.jsonl"
    source.write_text(text)
    with pytest.raises(tp.DataError, match="no rows: the input is empty"):
        run(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_missing_input_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(tp.DataError, match="no such file"):
        run(tmp_path / "nope.jsonl", tmp_path / "out")


def test_one_example_after_dropping_duplicates_is_too_few(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "d.jsonl", [dolly(1), dolly(1), dolly(1)])
    with pytest.raises(tp.DataError) as caught:
        run(source, tmp_path / "out")
    assert "only 1 example after filtering: need at least 2 (one for train, one for valid)" in str(
        caught.value
    )
    assert "2 duplicates" in str(caught.value)


def test_a_test_split_needs_three_examples(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "d.jsonl", [dolly(1), dolly(2)])
    with pytest.raises(tp.DataError, match=r"only 2 examples after filtering: need at least 3"):
        run(source, tmp_path / "out", test_fraction=0.1)


@pytest.mark.parametrize(("valid", "test"), [(0.0, 0.0), (1.0, 0.0), (0.2, -0.1), (0.6, 0.4)])
def test_impossible_fractions_are_refused(tmp_path: Path, valid: float, test: float) -> None:
    source = write_jsonl(tmp_path / "d.jsonl", [dolly(1), dolly(2)])
    with pytest.raises(tp.DataError, match="fraction"):
        run(source, tmp_path / "out", valid_fraction=valid, test_fraction=test)


# the split


def test_the_split_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "d.jsonl", [dolly(index) for index in range(100)])
    run(source, tmp_path / "one", seed=3, test_fraction=0.1)
    run(source, tmp_path / "two", seed=3, test_fraction=0.1)
    assert snapshot(tmp_path / "one").keys() == {"train.jsonl", "valid.jsonl", "test.jsonl", "summary.json"}
    for name in ("train.jsonl", "valid.jsonl", "test.jsonl"):
        assert (tmp_path / "one" / name).read_text() == (tmp_path / "two" / name).read_text()


def test_appending_rows_never_moves_existing_examples(tmp_path: Path) -> None:
    original = write_jsonl(tmp_path / "a.jsonl", [dolly(i) for i in range(150)])
    first = run(original, tmp_path / "a", test_fraction=0.1)
    grown = write_jsonl(tmp_path / "b.jsonl", [dolly(i) for i in range(400)])
    second = run(grown, tmp_path / "b", test_fraction=0.1)
    before, after = split_of(tmp_path / "a"), split_of(tmp_path / "b")
    assert min(first.train, first.valid, first.test) > 0
    assert {user: after[user] for user in before} == before
    assert second.kept == 400


def test_different_seeds_give_different_splits(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "d.jsonl", [dolly(index) for index in range(100)])
    run(source, tmp_path / "zero", seed=0)
    run(source, tmp_path / "one", seed=1)
    assert split_of(tmp_path / "zero") != split_of(tmp_path / "one")


def test_fractions_are_expected_shares() -> None:
    positions = [tp.split_position(0, {"text": str(i)}) for i in range(4000)]
    counts = Counter(tp.assign_splits(positions, valid_fraction=0.2, test_fraction=0.1))
    assert counts["test"] / 4000 == pytest.approx(0.1, abs=0.02)
    assert counts["valid"] / 4000 == pytest.approx(0.2, abs=0.02)


def test_the_system_prompt_does_not_move_examples() -> None:
    plain = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]}
    with_system = {"messages": [{"role": "system", "content": "Be a pirate."}, *plain["messages"]]}
    assert tp.split_position(0, plain) == tp.split_position(0, with_system)
    assert tp.split_position(0, plain) != tp.split_position(1, plain)


def test_chats_without_tools_split_as_they_did_before_tools_were_accepted() -> None:
    # The hash then: sha256(seed, the non-system messages as canonical JSON); data prepared
    # earlier must not move between splits.
    messages = [{"role": "user", "content": "ü"}, {"role": "assistant", "content": "a"}]
    before = hashlib.sha256(('7\0[{"content":"ü","role":"user"},{"content":"a","role":"assistant"}]')
                            .encode()).digest()
    position = tp.split_position(7, {"messages": [{"role": "system", "content": "s"}, *messages]})
    assert position == int.from_bytes(before[:8], "big") / 2**64


@pytest.mark.parametrize(
    ("positions", "valid", "test", "expected"),
    [
        # valid came out empty: the train example with the smallest hash moves to valid
        ([0.9, 0.5, 0.7], 0.2, 0.0, ["train", "valid", "train"]),
        # test and valid empty: test gets the smallest hash, valid the next
        ([0.9, 0.8, 0.5], 0.2, 0.1, ["train", "valid", "test"]),
        # train empty: the valid example with the largest hash moves to train
        ([0.05, 0.1], 0.2, 0.0, ["valid", "train"]),
        # nothing empty: nothing moves
        ([0.05, 0.1, 0.5], 0.2, 0.0, ["valid", "valid", "train"]),
    ],
)
def test_empty_splits_are_filled_deterministically(
    positions: list[float], valid: float, test: float, expected: list[str]
) -> None:
    assert tp.assign_splits(positions, valid, test) == expected


def test_tiny_data_sets_still_get_train_and_valid(tmp_path: Path) -> None:
    for seed in range(10):
        summary = run(write_jsonl(tmp_path / "d.jsonl", [dolly(1), dolly(2)]), tmp_path / "out", seed=seed)
        assert (summary.train, summary.valid) == (1, 1)


# filtering


def test_duplicates_are_dropped_and_counted(tmp_path: Path) -> None:
    rows = [dolly(1), dolly(2), dolly(1), dolly(3), dolly(2) | {"category": "other"}, dolly(1, "ctx")]
    summary = run(write_jsonl(tmp_path / "d.jsonl", rows), tmp_path / "out")
    assert (summary.rows_read, summary.kept, summary.dropped_duplicates) == (6, 4, 2)
    assert summary.train + summary.valid == 4
    users = [row["messages"][0]["content"] for row in all_rows(tmp_path / "out")]
    assert len(users) == len(set(users)) == 4


def test_examples_over_max_tokens_are_dropped_not_truncated(tmp_path: Path, tiny_tokenizer: Path) -> None:
    tokenizer = tp.load_tokenizer(tiny_tokenizer)
    # tokens: <user> + words + </s> + <assistant> + words + </s>
    rows = [
        {"instruction": "one two", "input": "", "output": "three"},  # 7
        {"instruction": "a b c d", "input": "", "output": "e f g h"},  # 12
        {"instruction": "x", "input": "", "output": "y"},  # 6
        {"instruction": "p q r", "input": "s", "output": "t u v w x"},  # 13
    ]
    summary = run(
        write_jsonl(tmp_path / "a.jsonl", rows), tmp_path / "out", max_tokens=12, tokenizer=tokenizer
    )
    assert (summary.rows_read, summary.kept, summary.dropped_too_long) == (4, 3, 1)
    assert (summary.length_unit, summary.length_min, summary.length_max) == ("tokens", 6, 12)
    assert summary.length_mean == pytest.approx((7 + 12 + 6) / 3, abs=0.05)
    assistants = {row["messages"][1]["content"] for row in all_rows(tmp_path / "out")}
    assert assistants == {"three", "e f g h", "y"}


def test_without_a_chat_template_the_contents_are_counted(tiny_tokenizer: Path) -> None:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_tokenizer)
    tokenizer.chat_template = None
    record = {"messages": [{"role": "user", "content": "a b c"}, {"role": "assistant", "content": "d e"}]}
    assert tp.example_length(record, tokenizer) == 5
    assert tp.example_length(record) == len("a b c") + len("d e")


def test_max_tokens_needs_a_tokenizer(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "d.jsonl", [dolly(1), dolly(2)])
    with pytest.raises(tp.DataError, match="needs a tokenizer"):
        run(source, tmp_path / "out", max_tokens=10)


# output


def test_summary_is_returned_printed_and_written(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "d.jsonl", [dolly(index) for index in range(10)])
    buffer = io.StringIO()
    summary = tp.prepare(source, tmp_path / "out", console=Console(file=buffer, width=120))
    assert json.loads((tmp_path / "out" / "summary.json").read_text()) == asdict(summary)
    assert (summary.length_unit, summary.dropped_too_long, summary.test) == ("characters", 0, 0)
    printed = buffer.getvalue()
    for label in (
        "rows read",
        "kept",
        "dropped: duplicates",
        "train",
        "valid",
        "characters min / mean / max",
    ):
        assert label in printed
    assert len(read_jsonl(tmp_path / "out" / "train.jsonl")) == summary.train


def test_rerunning_replaces_outputs_and_drops_a_stale_test_split(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "d.jsonl", [dolly(index) for index in range(40)])
    output = tmp_path / "out"
    run(source, output, test_fraction=0.2)
    assert (output / "test.jsonl").exists()
    (output / "notes.txt").write_text("mine")
    summary = run(source, output)
    assert sorted(path.name for path in output.iterdir()) == [
        "notes.txt",
        "summary.json",
        "train.jsonl",
        "valid.jsonl",
    ]
    assert len(all_rows(output)) == summary.kept == 40
    assert sorted(path.name for path in tmp_path.iterdir()) == ["d.jsonl", "out"]


# CLI


def test_cli_writes_the_splits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_jsonl(tmp_path / "d.jsonl", [dolly(index) for index in range(30)])
    argv = [
        "--input",
        str(source),
        "--output",
        str(tmp_path / "out"),
        "--test-fraction",
        "0.2",
        "--seed",
        "4",
    ]
    assert tp.main([*argv, "--system-prompt", "Talk like a pirate."]) == 0
    assert "rows read" in capsys.readouterr().out
    rows = all_rows(tmp_path / "out")
    assert len(rows) == 30
    assert all(row["messages"][0] == {"role": "system", "content": "Talk like a pirate."} for row in rows)


def test_cli_max_tokens_requires_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_jsonl(tmp_path / "d.jsonl", [dolly(1), dolly(2)])
    with pytest.raises(SystemExit) as exited:
        tp.main(["--input", str(source), "--output", str(tmp_path / "out"), "--max-tokens", "10"])
    assert exited.value.code == 2
    assert "--max-tokens needs --model" in capsys.readouterr().err


def test_cli_counts_tokens_with_the_model_tokenizer(tmp_path: Path, tiny_tokenizer: Path) -> None:
    rows = [dolly(index) for index in range(6)] + [dolly(99) | {"response": " ".join(["word"] * 50)}]
    source = write_jsonl(tmp_path / "d.jsonl", rows)
    argv = ["--input", str(source), "--output", str(tmp_path / "out"), "--max-tokens", "20"]
    assert tp.main([*argv, "--model", str(tiny_tokenizer)]) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["kept"], summary["dropped_too_long"], summary["length_unit"]) == (6, 1, "tokens")


def test_cli_rejects_a_missing_model_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = write_jsonl(tmp_path / "d.jsonl", [dolly(1), dolly(2)])
    argv = ["--input", str(source), "--output", str(tmp_path / "out"), "--max-tokens", "9"]
    assert tp.main([*argv, "--model", str(tmp_path / "nope")]) == 2
    assert "not a directory" in capsys.readouterr().err


# the bundled pirate data


def test_the_pirate_data_set_prepares_cleanly(tmp_path: Path) -> None:
    summary = run(PIRATE_DATA, tmp_path / "out")
    assert summary.format == "dolly"
    assert summary.rows_read >= 300
    assert summary.kept == summary.rows_read
    assert summary.train > summary.valid > 0
    rows = read_jsonl(PIRATE_DATA)
    assert len({row["category"] for row in rows}) >= 8
    assert all(pirate.pirate_score(row["response"]) >= 2 for row in rows)


def test_the_pirate_data_set_is_what_its_generator_makes() -> None:
    assert PIRATE_DATA.read_text(encoding="utf-8") == make_pirate.render()


def test_held_out_prompts_are_not_in_the_data_set() -> None:
    instructions = {row["instruction"] for row in read_jsonl(PIRATE_DATA)}
    assert len(pirate.HELD_OUT_PROMPTS) == len(set(pirate.HELD_OUT_PROMPTS)) == 20
    assert instructions.isdisjoint(pirate.HELD_OUT_PROMPTS)


# pirate_score


@pytest.mark.parametrize(
    ("text", "score"),
    [
        ("The capital of France is Paris.", 0),
        ("Arr, matey! Ye be wantin' treasure?", 4),
        ("ARRR, me HEARTIES", 2),
        ("'Tis true, and \u2019tis grand.", 2),
        ("Ye'll find it, aye.", 2),
        ("Yearly players treasured the ayes of yeoman matey's", 1),
        ("Yo-ho-ho, cap'n!", 2),
        ("", 0),
    ],
)
def test_pirate_score_counts_whole_marker_words(text: str, score: int) -> None:
    assert pirate.pirate_score(text) == score


def test_pirate_markers_are_lowercase_and_unique() -> None:
    assert all(marker == marker.lower() for marker in pirate.PIRATE_MARKERS)
    assert len(set(pirate.PIRATE_MARKERS)) == len(pirate.PIRATE_MARKERS)


def test_score_answers_sums_up_per_answer_counts() -> None:
    result = pirate.score_answers(["Arr, matey!", "Paris.", "Ahoy, ye scallywag"])
    assert result == {"mean_markers_per_answer": 5 / 3, "answers_with_markers": 2, "answers": 3,
                      "scores": [2, 0, 3]}


def test_pirate_evaluation_answers_every_held_out_prompt(tmp_path: Path, capsys) -> None:
    from tests.unit.training.model.test_folder import tiny_model
    from training.model import folder as model_tools

    tiny_model(tmp_path / "src")
    model_dir = model_tools.fetch(str(tmp_path / "src"), tmp_path / "tiny", dtype="float32")
    out = tmp_path / "scores.json"
    assert pirate.main(["--model", str(model_dir), "--max-tokens", "3", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["answers"] == len(result["scores"]) == len(result["examples"]) == 20
    assert [e["prompt"] for e in result["examples"]] == list(pirate.HELD_OUT_PROMPTS)
    with pytest.raises(SystemExit):
        pirate.main(["--model", str(tmp_path / "missing")])
    assert "--model" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["train.jsonl", "valid.jsonl", "test.jsonl"])
def test_an_output_folder_that_would_replace_the_input_is_refused(tmp_path, name):
    source = write_jsonl(tmp_path / name, [dolly(i) for i in range(10)])
    before = source.read_bytes()
    with pytest.raises(tp.DataError, match=f"--output {tmp_path} would replace the input {source}"):
        run(source, tmp_path)
    assert source.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_a_lone_surrogate_is_named_by_its_row_not_a_traceback(tmp_path):
    rows = [dolly(i) for i in range(10)]
    rows[3]["response"] = "bad \ud800 text"
    source = write_jsonl(tmp_path / "in.jsonl", rows)  # json.dumps escapes it: valid JSON text
    with pytest.raises(tp.DataError, match=r"in\.jsonl:4: text that is not valid Unicode"):
        run(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_output_folder_under_a_file_is_refused(tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [dolly(i) for i in range(10)])
    (tmp_path / "file").write_text("x")
    with pytest.raises(tp.DataError, match="a path above it is not a folder"):
        run(source, tmp_path / "file" / "out")


@pytest.mark.parametrize("char", ["\u2028", "\u0085", "\u2029"])
def test_json_strings_holding_unicode_line_separators_are_kept_whole(tmp_path, char):
    rows = [dolly(i) for i in range(10)]
    rows[0]["response"] = f"one{char}two"
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    run(source, tmp_path / "out")
    texts = [m["content"] for name in ("train.jsonl", "valid.jsonl")
             for row in read_jsonl(tmp_path / "out" / name) for m in row["messages"]]
    assert f"one{char}two" in texts


@pytest.mark.parametrize(("messages", "says"), [
    ([{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"},
      {"role": "assistant", "content": "a"}], "message 1 is an assistant message where a user one must come"),
    ([{"role": "user", "content": "q"}, {"role": "user", "content": "q2"},
      {"role": "assistant", "content": "a"}], "message 2 is a user message where an assistant one"),
    ([{"role": "user", "content": "q"}, {"role": "system", "content": "s"},
      {"role": "assistant", "content": "a"}], "message 2 is a system message"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}],
     "message 2: an empty assistant message"),
    ([{"role": "user", "content": "q", "tool_calls": []}, {"role": "assistant", "content": "a"}],
     "message 1: a user message with 'tool_calls': only assistant messages have it"),
    ([{"role": "user", "content": "q", "weight": 0}, {"role": "assistant", "content": "a"}],
     "message 1 has keys ['weight'] besides role, content, tool_calls, tool_call_id, name: the keys "
     "chat templates read"),
])
def test_chat_rows_out_of_order_empty_or_with_unknown_keys_are_named(tmp_path, messages, says):
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
            for i in range(10)]
    rows[4] = {"messages": messages}
    source = write_jsonl(tmp_path / "chat.jsonl", rows)
    with pytest.raises(tp.DataError, match=r"chat\.jsonl:5: ") as info:
        run(source, tmp_path / "out")
    assert says in str(info.value)


def test_a_system_message_then_turns_in_order_is_accepted(tmp_path):
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "a2"}]
    rows = [{"messages": [dict(m, content=f"{m['content']} {i}") for m in chat]} for i in range(10)]
    assert run(write_jsonl(tmp_path / "chat.jsonl", rows), tmp_path / "out").kept == 10


# hostile input, through the real command line (as `invoke data.prepare` runs it)

REPO = Path(tp.__file__).resolve().parents[2]
DEEP = "[" * 100_000 + "]" * 100_000  # past json's recursion limit
HUGE = "9" * 5000  # past Python's 4300-digit limit on reading an int


def prepare_cli(source: Path | str, output: Path | str) -> subprocess.CompletedProcess[str]:
    """`python -m training.data.prepare`; the timeout turns a hang (a FIFO read) into a failure."""
    argv = [sys.executable, "-m", "training.data.prepare", "--input", str(source), "--output", str(output)]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)


def assert_refused(result: subprocess.CompletedProcess[str], says: str) -> None:
    """Refused in one line that says `says`: no traceback, exit status 2."""
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert says in result.stderr, result.stderr


@pytest.mark.parametrize(("line", "says"), [
    pytest.param(DEEP, "JSON nested too deeply to read", id="deep-list"),
    pytest.param('{"messages": ' + DEEP + "}", "JSON nested too deeply to read", id="deep-messages"),
    pytest.param(HUGE, "a number too long to read (over 4300 digits)", id="huge-number"),
    pytest.param('{"instruction": "q", "response": "a", "id": ' + HUGE + "}",
                 "a number too long to read (over 4300 digits)", id="huge-number-in-row"),
    pytest.param('{"instruction": "q", "response": NaN}', "dolly row's 'response' is not a string",
                 id="nan"),
    pytest.param('{"instruction": "q", "response": -Infinity}', "dolly row's 'response' is not a string",
                 id="infinity"),
    pytest.param("null", "expected a JSON object, got null", id="null"),
    pytest.param('"a row"', "expected a JSON object, got string", id="string"),
    pytest.param('{"instruction": "q\x00", "response": "a"}',
                 "not valid JSON (Invalid control character at column 19)", id="nul-byte"),
    pytest.param('{"instruction": "q\\ud800", "response": "a"}', "text that is not valid Unicode",
                 id="lone-surrogate"),
])
def test_cli_refuses_a_hostile_row_naming_its_line(tmp_path: Path, line: str, says: str) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(f"{json.dumps(dolly(1))}\n{json.dumps(dolly(2))}\n{line}\n", encoding="utf-8")
    assert_refused(prepare_cli(source, tmp_path / "out"), f"error: {source}:3: {says}")
    assert [path.name for path in tmp_path.iterdir()] == ["in.jsonl"]


@pytest.mark.parametrize(("text", "says"), [
    (f"[{json.dumps(dolly(1))}, {DEEP}]", "JSON nested too deeply to read"),
    (f"[{json.dumps(dolly(1))}, {HUGE}]", "a number too long to read"),
])
def test_cli_refuses_a_hostile_json_list_naming_the_file(tmp_path: Path, text: str, says: str) -> None:
    source = tmp_path / "in.json"
    source.write_text(text, encoding="utf-8")
    assert_refused(prepare_cli(source, tmp_path / "out"), f"error: {source}: {says}")
    assert [path.name for path in tmp_path.iterdir()] == ["in.json"]


def fifo(tmp_path: Path) -> Path:
    os.mkfifo(tmp_path / "in.jsonl")  # nobody writes to it: reading would wait forever
    return tmp_path / "in.jsonl"


def directory(tmp_path: Path) -> Path:
    (tmp_path / "in.jsonl").mkdir()
    return tmp_path / "in.jsonl"


def under_a_file(tmp_path: Path) -> Path:
    (tmp_path / "in.jsonl").write_text(json.dumps(dolly(1)))
    return tmp_path / "in.jsonl" / "rows.jsonl"


def symlink_loop(tmp_path: Path) -> Path:
    (tmp_path / "in.jsonl").symlink_to("in.jsonl")
    return tmp_path / "in.jsonl"


@pytest.mark.parametrize(("make", "says"), [
    (fifo, "is a named pipe (FIFO), not a regular file: the input must be a .jsonl or .json file"),
    (directory, "is a directory, not a regular file"),
    (lambda tmp_path: Path("/dev/zero"), "is a character device, not a regular file"),  # never ends
    (lambda tmp_path: tmp_path / "missing.jsonl", "no such file"),
    (under_a_file, "cannot read it: Not a directory"),
    (symlink_loop, "cannot read it: Too many levels of symbolic links"),
], ids=["fifo", "directory", "device", "missing", "under-a-file", "symlink-loop"])
def test_cli_refuses_an_input_that_is_not_a_regular_file(tmp_path: Path, make: Any, says: str) -> None:
    source = make(tmp_path)
    before = sorted(path.name for path in tmp_path.iterdir())
    assert_refused(prepare_cli(source, tmp_path / "out"), f"error: {source}: {says}")
    assert sorted(path.name for path in tmp_path.iterdir()) == before


def test_cli_refuses_an_input_that_is_not_utf8_naming_the_line(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_bytes(json.dumps(dolly(1)).encode() + b'\n{"instruction": "caf\xe9", "response": "a"}\n')
    assert_refused(prepare_cli(source, tmp_path / "out"),
                   f"error: {source}:2: not UTF-8 text (byte 0xe9): save the file as UTF-8")
    assert [path.name for path in tmp_path.iterdir()] == ["in.jsonl"]


def test_a_utf8_byte_order_mark_is_dropped(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text("\ufeff" + "".join(json.dumps(dolly(i)) + "\n" for i in range(4)), encoding="utf-8")
    assert run(source, tmp_path / "out").kept == 4


def read_only_folder(tmp_path: Path) -> Path:
    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder")
    (tmp_path / "locked").mkdir(mode=0o555)
    return tmp_path / "locked" / "out"


def output_under_a_file(tmp_path: Path) -> Path:
    (tmp_path / "file").write_text("x")
    return tmp_path / "file" / "out"


def output_is_a_file(tmp_path: Path) -> Path:
    (tmp_path / "out").write_text("x")
    return tmp_path / "out"


def output_under_a_symlink_loop(tmp_path: Path) -> Path:
    (tmp_path / "loop").symlink_to("loop")
    return tmp_path / "loop" / "out"


def under_proc(tmp_path: Path) -> Path:
    if not Path("/proc/self").is_dir():
        pytest.skip("no /proc here")
    return Path("/proc/x")


@pytest.mark.parametrize(("make", "says"), [
    (under_proc, "cannot write there (No such file or directory): choose a folder you can write to"),
    (read_only_folder, "cannot write there (Permission denied): choose a folder you can write to"),
    (output_under_a_file, "a path above it is not a folder (a file or a broken link)"),
    (output_under_a_symlink_loop, "a path above it is not a folder (a file or a broken link)"),
    (output_is_a_file, "exists and is not a folder"),
], ids=["proc", "read-only", "under-a-file", "under-a-symlink-loop", "a-file"])
def test_cli_refuses_an_output_folder_it_cannot_write(tmp_path: Path, make: Any, says: str) -> None:
    source = write_jsonl(tmp_path / "in.jsonl", [dolly(i) for i in range(10)])
    output = make(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    assert_refused(prepare_cli(source, output), f"error: --output {output}: {says}")
    assert sorted(tmp_path.rglob("*")) == before  # no output, no staging folder left behind
    assert not Path("/proc/x").exists()
