"""The input rows `training.data.prepare` reads, and each row as chat messages.

Rows come from JSON Lines (or a .json file holding a list) in one of three formats, dolly, alpaca
or chat, told apart by the first row's keys; `training/data/prepare.py`'s docstring says how each
becomes messages. A row that does not fit its format is a `DataError` naming the file, the line (or
row) and what is wrong.
"""

from __future__ import annotations

import codecs
import json
import os
import stat
import sys
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

# What an input that is not a regular file is, for the message: reading a FIFO waits for a writer
# forever, and a device such as /dev/zero never ends.
NOT_REGULAR = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a named pipe (FIFO)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


# training.data.prepare raises it too, and exports it: this is the lowest module that raises it.
class DataError(ValueError):
    """Input that cannot be prepared; the message says where and what is wrong."""


@dataclass(frozen=True)
class Row:
    location: str  # "file:line" for JSON Lines, "file: row N" for a JSON list
    value: Any


def read_rows(path: Path) -> list[Row]:
    """The rows of a JSON Lines file (blank lines skipped) or of a .json file holding a list."""
    text = read_text(path)
    if path.suffix == ".json":
        values = parse_json(text, path) if text.strip() else []
        if not isinstance(values, list):
            raise DataError(f"{path}: a .json input must hold a list of rows (use .jsonl for JSON Lines)")
        return [Row(f"{path}: row {index}", value) for index, value in enumerate(values, 1)]
    # JSON Lines are split at "\n" only: splitlines() would also split valid JSON strings that
    # hold U+2028 or U+0085.
    return [Row(f"{path}:{number}", parse_json(line, path, number))
            for number, line in enumerate(text.split("\n"), 1) if line.strip()]


def read_text(path: Path) -> str:
    """The text of a UTF-8 file; a byte order mark (editors on Windows write one) is dropped."""
    data = read_regular_file(path).removeprefix(codecs.BOM_UTF8)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise DataError(f"{path}:{line}: not UTF-8 text (byte 0x{data[error.start]:02x}): "
                        "save the file as UTF-8") from None


def read_regular_file(path: Path) -> bytes:
    """The bytes of `path`, refused unless it is a regular file (see NOT_REGULAR)."""
    try:
        check_regular(path, path.stat().st_mode)
        # Should the path become a FIFO after that check, a non-blocking open does not wait for a
        # writer, and fstat refuses it.
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as file:
            check_regular(path, os.fstat(file.fileno()).st_mode)
            return file.read()
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except OSError as error:
        raise DataError(f"{path}: cannot read it: {error.strerror or error}") from None


def check_regular(path: Path, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = NOT_REGULAR.get(stat.S_IFMT(mode), "a special file")
        raise DataError(f"{path}: is {kind}, not a regular file: the input must be a .jsonl or .json file")


def parse_json(text: str, path: Path, line: int | None = None) -> Any:
    """One JSON value; `line` is the JSON Lines line that `text` is, None for a whole .json file.

    json.loads raises more than JSONDecodeError on hostile text: RecursionError on deep nesting,
    ValueError on an integer longer than Python converts (sys.get_int_max_str_digits()).
    """
    where = f"{path}:{line}" if line else str(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        # Some messages end in " at" ("Invalid control character at"), others do not.
        problem = error.msg.removesuffix(" at")
        raise DataError(f"{path}:{line or error.lineno}: not valid JSON ({problem} at column "
                        f"{error.colno})") from None
    except RecursionError:
        raise DataError(f"{where}: JSON nested too deeply to read (lists or objects about "
                        f"{sys.getrecursionlimit()} levels inside each other): flatten that value "
                        "or drop it") from None
    except ValueError:
        raise DataError(f"{where}: a number too long to read (over {sys.get_int_max_str_digits()} "
                        "digits): write it as a string or drop it") from None


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type: a `null` row is not a "NoneType" to the user."""
    names = {type(None): "null", bool: "true/false", int: "number", float: "number", str: "string"}
    return names.get(type(value), type(value).__name__)


def detect_format(row: Row) -> str:
    """'chat', 'alpaca' or 'dolly', from the keys of one row."""
    if not isinstance(row.value, dict):
        raise DataError(f"{row.location}: expected a JSON object, got {json_type(row.value)}")
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
        raise DataError(f"{row.location}: expected a JSON object, got {json_type(row.value)}")
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
