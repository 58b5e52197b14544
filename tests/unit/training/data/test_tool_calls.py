"""Chat rows with tools and tool calls (mlx-lm's tools format): what is accepted and written through,
and each refusal, named by file, line and what is wrong."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.unit.training.data.samples import TIME, WEATHER, call_only_row, completions_row, tool_chat_row
from tests.unit.training.data.test_prepare import all_rows, run, write_jsonl
from training.data import prepare as tp
from training.data.chat import TURNS
from training.data.tool_calls import CALL_SHAPE, TOOL_SHAPE

Row = dict[str, Any]


def refusal(tmp_path: Path, bad: Row, make: Callable[[int], Row] = tool_chat_row) -> str:
    """The message that refuses a file whose third row is `bad`; nothing is written."""
    rows = [make(index) for index in range(5)]
    rows[2] = bad
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    with pytest.raises(tp.DataError) as caught:
        run(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    prefix = f"{source}:3: "
    assert str(caught.value).startswith(prefix)
    return str(caught.value).removeprefix(prefix)


def changed(change: Callable[[Row], Any]) -> Row:
    """Row 2 of tool_chat_row with `change` made to it (messages 1-6: system, user, the assistant's
    two calls, their two results, the assistant's reply)."""
    row = tool_chat_row(2)
    change(row)
    return row


def message(number: int) -> Callable[[Row], Row]:
    return lambda row: row["messages"][number - 1]


def call(number: int) -> Callable[[Row], Row]:
    return lambda row: row["messages"][2]["tool_calls"][number - 1]


TOOL_REFUSALS = {
    "tools-not-a-list": (lambda row: row.update(tools=WEATHER),
                         f"'tools' must be a list of objects (function schemas such as {TOOL_SHAPE}), "
                         "not an object"),
    "tools-of-names": (lambda row: row.update(tools=["get_weather", "get_time"]),
                       f"'tools' must be a list of objects (function schemas such as {TOOL_SHAPE}), "
                       "not a list of strings"),
    "tool-without-function": (
        lambda row: row["tools"].__setitem__(0, {"type": "function", "name": "get_weather"}),
        f"tool 1 has no 'function' object: a tool is {TOOL_SHAPE}"),
    "tool-of-another-type": (lambda row: row["tools"].__setitem__(1, {"type": "retrieval"}),
                             f"tool 2 has type 'retrieval': only function tools are rendered ({TOOL_SHAPE})"),
    "tool-without-name": (lambda row: row["tools"].__setitem__(0, {"function": {"parameters": {}}}),
                          "tool 1: the function has no name (a non-empty string in 'name')"),
    "tool-parameters-not-a-schema": (
        lambda row: row["tools"].__setitem__(0, {"function": {"name": "get_weather", "parameters": "city"}}),
        "tool 1: the parameters of 'get_weather' must be an object (a JSON schema), not a string"),
    "tool-description-not-text": (
        lambda row: row["tools"].__setitem__(0, {"function": {"name": "get_weather", "description": 5}}),
        "tool 1: the description of 'get_weather' is not a string"),
    "tool-named-twice": (lambda row: row.update(tools=[WEATHER, TIME, WEATHER]),
                         "'tools' names 'get_weather' more than once"),
    "tool-number-not-json": (lambda row: row["tools"].__setitem__(0, {"function": {
        "name": "get_weather", "parameters": {"type": "number", "maximum": float("nan")}}}),
        "a number that JSON cannot hold (NaN or Infinity): write it as a string or drop it"),
}

CALL_REFUSALS = {
    "no-calls": (lambda row: message(3)(row).update(tool_calls=[]),
                 f"message 3: 'tool_calls' must be a non-empty list of calls such as {CALL_SHAPE}"),
    "calls-not-a-list": (lambda row: message(3)(row).update(tool_calls=call(1)(row)),
                         f"message 3: 'tool_calls' must be a non-empty list of calls such as {CALL_SHAPE}"),
    "call-not-an-object": (lambda row: message(3)(row)["tool_calls"].__setitem__(0, "get_weather"),
                           f"message 3: tool call 1 is not an object: a call is {CALL_SHAPE}"),
    "call-of-another-type": (lambda row: call(1)(row).update(type="code_interpreter"),
                             "message 3: tool call 1 has type 'code_interpreter': only function calls "
                             "are rendered"),
    "call-with-empty-id": (lambda row: call(1)(row).update(id=""),
                           "message 3: tool call 1: 'id' must be a non-empty string"),
    "call-without-function": (lambda row: call(1)(row).pop("function"),
                              f"message 3: tool call 1 has no 'function' object: a call is {CALL_SHAPE}"),
    "call-without-name": (lambda row: call(2)(row)["function"].pop("name"),
                          "message 3: tool call 2: the function has no name (a non-empty string in 'name')"),
    "call-of-an-unknown-tool": (lambda row: call(2)(row)["function"].update(name="get_news"),
                                "message 3: tool call 2 calls 'get_news', which is not among the row's "
                                "tools ('get_weather', 'get_time')"),
    "call-without-arguments": (lambda row: call(1)(row)["function"].pop("arguments"),
                               "message 3: tool call 1: the call of 'get_weather' has no 'arguments' "
                               "(give {} for none)"),
    "arguments-not-json": (lambda row: call(1)(row)["function"].update(arguments="city=Paris"),
                           "message 3: tool call 1: the arguments of 'get_weather' are a string that is "
                           "not JSON: write them as an object or as a JSON string of one"),
    "arguments-nested-too-deep": (lambda row: call(1)(row)["function"].update(arguments="[" * 100_000),
                                  "message 3: tool call 1: the arguments of 'get_weather' are a string "
                                  "that is not JSON: write them as an object or as a JSON string of one"),
    "arguments-a-json-list": (lambda row: call(1)(row)["function"].update(arguments='["Paris"]'),
                              "message 3: tool call 1: the arguments of 'get_weather' must be an object "
                              "(or a JSON string of one), not a list of strings"),
    "arguments-a-number": (lambda row: call(2)(row)["function"].update(arguments=3),
                           "message 3: tool call 2: the arguments of 'get_time' must be an object (or a "
                           "JSON string of one), not a number"),
}

MESSAGE_REFUSALS = {
    "null-content-without-calls": (lambda row: message(6)(row).update(content=None),
                                   "message 6: 'content' is null, which only an assistant message with "
                                   "tool_calls may be"),
    "no-content-without-calls": (lambda row: message(6)(row).pop("content"), "message 6 has no 'content'"),
    "tool-content-not-text": (lambda row: message(4)(row).update(content={"degrees": 2}),
                              "message 4: 'content' is not a string"),
    "empty-tool-result": (lambda row: message(5)(row).update(content=" "),
                          "message 5: an empty tool message: drop the row or fill it in"),
    "calls-on-a-user-message": (lambda row: message(2)(row).update(tool_calls=[call(1)(row)]),
                                "message 2: a user message with 'tool_calls': only assistant messages "
                                "have it"),
    "call-id-on-an-assistant": (lambda row: message(6)(row).update(tool_call_id="call_2a"),
                                "message 6: an assistant message with 'tool_call_id': only tool messages "
                                "have it"),
    "empty-name": (lambda row: message(4)(row).update(name=""),
                   "message 4: 'name' must be a non-empty string"),
    "call-id-not-text": (lambda row: message(4)(row).update(tool_call_id=7),
                         "message 4: 'tool_call_id' must be a non-empty string"),
    "unknown-key": (lambda row: message(3)(row).update(function_call={"name": "get_weather"}),
                    "message 3 has keys ['function_call'] besides role, content, tool_calls, "
                    "tool_call_id, name: the keys chat templates read"),
    "result-of-no-call": (lambda row: message(4)(row).update(tool_call_id="call_9"),
                          "message 4 answers tool_call_id 'call_9', which the calls before it do not have "
                          "('call_2a', 'call_2b')"),
    "result-of-an-uncalled-tool": (lambda row: message(4)(row).update(name="get_news"),
                                   "message 4 answers 'get_news', which the calls before it do not call "
                                   "(they call 'get_weather', 'get_time')"),
}

TURN_REFUSALS = {
    "a-tool-answers-the-user": (lambda row: row["messages"].__setitem__(2, {"role": "tool", "content": "x"}),
                                f"message 3 is a tool message where an assistant one must come: {TURNS}"),
    "calls-left-unanswered": (lambda row: row["messages"].__delitem__(slice(3, 5)),
                              f"message 4 is an assistant message where a tool one must come: {TURNS}"),
    "the-user-interrupts-the-results": (
        lambda row: row["messages"].insert(4, {"role": "user", "content": "well?"}),
        f"message 5 is a user message where a tool or an assistant one must come: {TURNS}"),
    "results-after-a-reply": (lambda row: row["messages"].append({"role": "tool", "content": "late"}),
                              "chat row must end with an assistant message, not a tool one"),
}


@pytest.mark.parametrize(("change", "says"), [
    *TOOL_REFUSALS.values(), *CALL_REFUSALS.values(), *MESSAGE_REFUSALS.values(), *TURN_REFUSALS.values()],
    ids=[*TOOL_REFUSALS, *CALL_REFUSALS, *MESSAGE_REFUSALS, *TURN_REFUSALS])
def test_a_chat_with_tools_that_cannot_be_rendered_is_refused_naming_line_and_place(
    tmp_path: Path, change: Callable[[Row], Any], says: str
) -> None:
    assert refusal(tmp_path, changed(change)) == says


def test_the_tools_of_completions_rows_are_checked_too(tmp_path: Path) -> None:
    bad = completions_row(2) | {"tools": [{"type": "function", "function": {"description": "no name"}}]}
    assert refusal(tmp_path, bad, completions_row) == "tool 1: the function has no name (a non-empty " \
        "string in 'name')"


# accepted


def accepted(tmp_path: Path, rows: list[Row], **options: Any) -> list[Row]:
    """The rows written, whatever their split."""
    run(write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out", **options)
    return all_rows(tmp_path / "out")


def by_user(rows: list[Row]) -> dict[str, Row]:
    return {next(m["content"] for m in row["messages"] if m["role"] == "user"): row for row in rows}


def test_other_keys_of_a_row_are_dropped_and_its_tools_kept(tmp_path: Path) -> None:
    rows = [tool_chat_row(index) | {"id": index, "source": "crawl"} for index in range(4)]
    expected = [tool_chat_row(index) for index in range(4)]
    assert sorted(accepted(tmp_path, rows), key=json.dumps) == sorted(expected, key=json.dumps)


def test_the_system_prompt_opens_tool_chats_that_have_none(tmp_path: Path) -> None:
    rows = [call_only_row(1), call_only_row(2), tool_chat_row(3)]
    written = by_user(accepted(tmp_path, rows, system_prompt="Call tools."))
    for index in (1, 2):
        row = written[f"What is the weather in town {index}?"]
        system = {"role": "system", "content": "Call tools."}
        assert row == {"messages": [system, *call_only_row(index)["messages"]], "tools": [WEATHER]}
    assert written["Weather and time in city 3?"] == tool_chat_row(3)


@pytest.mark.parametrize("content", ["", "Let me look.", None])
def test_an_assistant_that_calls_may_also_speak_or_say_nothing(tmp_path: Path, content: str | None) -> None:
    rows = [tool_chat_row(index) for index in range(3)]
    rows[1]["messages"][2]["content"] = content
    assert by_user(accepted(tmp_path, rows))["Weather and time in city 1?"] == rows[1]


def test_calls_without_ids_results_without_ids_and_rows_without_tools_are_accepted(tmp_path: Path) -> None:
    # Hugging Face's tool-use example: no ids, the result named by its function, no tools list.
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    rows = [{"messages": [{"role": "user", "content": f"Weather {index}?", "name": "ann"},
                          {"role": "assistant", "tool_calls": [call]},
                          {"role": "tool", "name": "get_weather", "content": "22"},
                          {"role": "assistant", "content": "22 degrees."}]} for index in range(3)]
    assert sorted(accepted(tmp_path, rows), key=json.dumps) == rows
