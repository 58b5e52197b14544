"""The input rows `training.data.prepare` reads, their format, and the checks of the simple ones.

Rows come from JSON Lines (or a .json file holding a list) in one of five formats, told apart by
the first row's keys (FORMAT_KEYS): chat ("messages"), completions ("prompt", "completion"),
alpaca ("instruction", "input", "output"), dolly ("instruction", "context", "response") and text
("text"). A later row with another format's keys is refused. Here dolly and alpaca rows become
chat messages, and completions and text rows keep their strings as written; chat rows, with their
tools and tool calls, are checked in `training/data/chat.py`. `training/data/prepare.py`'s
docstring says what each becomes. A row that does not fit its format is a `DataError` naming the
file, the line (or row) and what is wrong.
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

# Each format and the keys that tell it, tried in this order: a row with the keys of two formats is
# of the first. Text comes last because alpaca exports often carry a "text" column that holds the
# whole prompt already formatted; its instruction keys say more.
FORMAT_KEYS = {
    "chat": ("messages",),
    "completions": ("prompt", "completion"),
    "alpaca": ("output", "input"),
    "dolly": ("response", "context"),
    "text": ("text",),
}
FORMAT_SHAPES = {
    "chat": "'messages' (chat)",
    "completions": "'prompt' + 'completion' (completions)",
    "alpaca": "'instruction' + 'output' (alpaca)",
    "dolly": "'instruction' + 'response' (dolly)",
    "text": "'text' (text)",
}

# Per instruction format: the fields that must hold text, and the optional one appended to the
# instruction.
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


def format_of(row: Row) -> str | None:
    """The format whose keys the row has (FORMAT_KEYS), None when it has none of them."""
    if not isinstance(row.value, dict):
        raise DataError(f"{row.location}: expected a JSON object, got {json_type(row.value)}")
    return next((name for name, keys in FORMAT_KEYS.items() if any(key in row.value for key in keys)), None)


def detect_format(row: Row) -> str:
    """The format of the first row, which every other row must then be of."""
    found = format_of(row)
    if found is None:
        shapes = ", ".join(FORMAT_SHAPES.values())
        raise DataError(f"{row.location}: cannot tell the format from the keys {sorted(row.value)}: "
                        f"expected {shapes}")
    return found


def check_same_format(row: Row, data_format: str) -> None:
    """Refuse a row that has another format's keys; a row with none is left to its format's checks,
    which name the key it misses."""
    found = format_of(row)
    if found is not None and found != data_format:
        raise DataError(f"{row.location}: a {found} row in a file of {data_format} rows (the first "
                        "row's keys decide the format): every row must be of one format")


def required_text(row: Row, data_format: str, key: str) -> str:
    """The row's string under `key`, as written; missing, not a string or blank is a DataError."""
    value = row.value.get(key)
    if value is None:
        raise DataError(f"{row.location}: {data_format} row has no '{key}'")
    if not isinstance(value, str):
        raise DataError(f"{row.location}: {data_format} row's '{key}' is not a string")
    if not value.strip():
        raise DataError(f"{row.location}: {data_format} row has an empty '{key}'")
    return value


def instruction_messages(row: Row, data_format: str) -> list[Message]:
    """A dolly or alpaca row as a user message (the instruction, then any context or input after
    a blank line) and the assistant's answer, each stripped of surrounding blank space."""
    instruction_key, answer_key, extra_key = ROW_FIELDS[data_format]
    instruction = required_text(row, data_format, instruction_key).strip()
    answer = required_text(row, data_format, answer_key).strip()
    extra = row.value.get(extra_key)
    if extra is not None and not isinstance(extra, str):
        raise DataError(f"{row.location}: {data_format} row's '{extra_key}' is not a string")
    prompt = f"{instruction}\n\n{extra.strip()}" if extra and extra.strip() else instruction
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


def completions_record(row: Row) -> dict[str, str]:
    """A completions row's prompt and completion, as written: mlx-lm trains on them as they are,
    and a leading space or newline in a completion can be what the model is to learn."""
    return {key: required_text(row, "completions", key) for key in ("prompt", "completion")}


def text_record(row: Row) -> dict[str, str]:
    """A text row's text, as written (mlx-lm learns all of it, with no template around it)."""
    return {"text": required_text(row, "text", "text")}
