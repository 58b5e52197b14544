"""The input rows `training.prepare` reads, and each row as chat messages.

Rows come from JSON Lines (or a .json file holding a list) in one of three formats, dolly, alpaca
or chat, told apart by the first row's keys; `training/prepare.py`'s docstring says how each
becomes messages. A row that does not fit its format is a `DataError` naming the file, the line (or
row) and what is wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant")

# Per format: the fields that must hold text, and the optional one appended to the instruction.
ROW_FIELDS = {
    "dolly": ("instruction", "response", "context"),
    "alpaca": ("instruction", "output", "input"),
}

Message = dict[str, Any]


# training.prepare raises it too, and exports it: this is the lowest module that raises it.
class DataError(ValueError):
    """Input that cannot be prepared; the message says where and what is wrong."""


@dataclass(frozen=True)
class Row:
    location: str  # "file:line" for JSON Lines, "file: row N" for a JSON list
    value: Any


def read_rows(path: Path) -> list[Row]:
    """The rows of a JSON Lines file (blank lines skipped) or of a .json file holding a list."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"{path}: cannot read: {error}") from None
    if path.suffix == ".json":
        try:
            values = json.loads(text) if text.strip() else []
        except json.JSONDecodeError as error:
            raise DataError(f"{path}:{error.lineno}: not valid JSON ({error.msg})") from None
        if not isinstance(values, list):
            raise DataError(f"{path}: a .json input must hold a list of rows (use .jsonl for JSON Lines)")
        return [Row(f"{path}: row {index}", value) for index, value in enumerate(values, 1)]
    rows = []
    # JSON Lines are split at "\n" only: splitlines() would also split valid JSON strings that
    # hold U+2028 or U+0085.
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            rows.append(Row(f"{path}:{number}", json.loads(line)))
        except json.JSONDecodeError as error:
            where = f"{path}:{number}"
            raise DataError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
    return rows


def detect_format(row: Row) -> str:
    """'chat', 'alpaca' or 'dolly', from the keys of one row."""
    if not isinstance(row.value, dict):
        raise DataError(f"{row.location}: expected a JSON object, got {type(row.value).__name__}")
    keys = row.value.keys()
    if "messages" in keys:
        return "chat"
    if "output" in keys or "input" in keys:
        return "alpaca"
    if "response" in keys or "context" in keys:
        return "dolly"
    raise DataError(
        f"{row.location}: cannot tell the format from the keys {sorted(keys)}: expected 'messages' (chat), "
        "'instruction' + 'output' (alpaca) or 'instruction' + 'response' (dolly)"
    )


def to_messages(row: Row, data_format: str, system_prompt: str | None = None) -> list[Message]:
    """One row as chat messages, or a DataError naming the row and what is wrong with it."""
    if not isinstance(row.value, dict):
        raise DataError(f"{row.location}: expected a JSON object, got {type(row.value).__name__}")
    if data_format == "chat":
        messages = checked_messages(row)
    else:
        messages = instruction_messages(row, data_format)
    if system_prompt and not any(message["role"] == "system" for message in messages):
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


def instruction_messages(row: Row, data_format: str) -> list[Message]:
    instruction_key, answer_key, extra_key = ROW_FIELDS[data_format]
    texts = {}
    for key in (instruction_key, answer_key, extra_key):
        value = row.value.get(key)
        if value is None and key == extra_key:
            value = ""
        if value is None:
            raise DataError(f"{row.location}: {data_format} row has no '{key}'")
        if not isinstance(value, str):
            raise DataError(f"{row.location}: {data_format} row's '{key}' is not a string")
        texts[key] = value.strip()
        if not texts[key] and key != extra_key:
            raise DataError(f"{row.location}: {data_format} row has an empty '{key}'")
    prompt = texts[instruction_key]
    if texts[extra_key]:
        prompt = f"{prompt}\n\n{texts[extra_key]}"
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": texts[answer_key]}]


def checked_messages(row: Row) -> list[Message]:
    if "messages" not in row.value:
        raise DataError(f"{row.location}: chat row has no 'messages'")
    messages = row.value["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{row.location}: chat row's 'messages' must be a non-empty list")
    for number, message in enumerate(messages, 1):
        where = f"{row.location}: message {number}"
        if not isinstance(message, dict):
            raise DataError(f"{where} is not a JSON object")
        if "role" not in message:
            raise DataError(f"{where} has no 'role'")
        if message["role"] not in ROLES:
            raise DataError(f"{where} has role {message['role']!r}: expected one of {', '.join(ROLES)}")
        if "content" not in message:
            raise DataError(f"{where} has no 'content'")
        if not isinstance(message["content"], str):
            raise DataError(f"{where}: 'content' is not a string")
        if unknown := sorted(set(message) - {"role", "content"}):
            raise DataError(f"{where} has keys {unknown} besides role and content: a chat message "
                            "holds those two only")
        if message["role"] != "system" and not message["content"].strip():
            raise DataError(f"{where}: an empty {message['role']} message: drop the row or fill it in")
    if not any(message["role"] == "user" for message in messages):
        raise DataError(f"{row.location}: chat row has no user message")
    if messages[-1]["role"] != "assistant":
        last = messages[-1]["role"]
        raise DataError(f"{row.location}: chat row must end with an assistant message, not a {last} one")
    check_turns(row.location, messages)
    return messages


def check_turns(location: str, messages: list[Message]) -> None:
    """An optional system message first, then user and assistant messages in turn."""
    turns = messages[1:] if messages[0]["role"] == "system" else messages
    offset = len(messages) - len(turns)
    for index, message in enumerate(turns):
        expected = "user" if index % 2 == 0 else "assistant"
        if message["role"] != expected:
            raise DataError(f"{location}: message {index + offset + 1} is a {message['role']} message "
                            f"where a {expected} one must come: a chat is an optional system "
                            "message, then user and assistant messages in turn")
