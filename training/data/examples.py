"""An example per format: the record written out for a row, its length, and what its split hashes.

A record is one line of the prepared data, in the format mlx-lm trains on:
- chat, and dolly and alpaca rows made chat: {"messages": [...]}, with "tools" when the row has them;
- completions: {"prompt": ..., "completion": ...}, with "tools" when the row has them;
- text: {"text": ...}.
mlx-lm tells them apart by these keys (`mlx_lm.tuner.datasets.create_dataset`), so a record holds
no others.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from training.data.chat import checked_chat
from training.data.formats import (
    DataError,
    Message,
    Row,
    completions_record,
    instruction_messages,
    json_type,
    text_record,
)
from training.data.tool_calls import checked_tool_names

Record = dict[str, Any]

# The formats whose records have a place for a system message.
SYSTEM_PROMPT_FORMATS = ("chat", "dolly", "alpaca")


def to_record(row: Row, data_format: str, system_prompt: str | None = None) -> Record:
    """One row as the record written out, or a DataError naming the row and what is wrong with it.

    `system_prompt` opens a chat that has no system message of its own; see SYSTEM_PROMPT_FORMATS.
    """
    if not isinstance(row.value, dict):
        raise DataError(f"{row.location}: expected a JSON object, got {json_type(row.value)}")
    if data_format == "chat":
        record = checked_chat(row)
    elif data_format == "completions":
        record = completions_record(row)
        # mlx-lm's CompletionsDataset hands a row's tools to the chat template as ChatDataset does.
        if "tools" in row.value:
            checked_tool_names(row.location, row.value["tools"])
            record["tools"] = row.value["tools"]
    elif data_format == "text":
        record = text_record(row)
    else:
        record = {"messages": instruction_messages(row, data_format)}
    messages = record.get("messages")
    if system_prompt and messages and not any(message["role"] == "system" for message in messages):
        record["messages"] = [{"role": "system", "content": system_prompt}, *messages]
    return record


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def split_position(seed: int, record: Record) -> float:
    """Where (seed, the example without its system messages) hashes to in [0, 1)."""
    digest = hashlib.sha256(f"{seed}\0{split_key(record)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_key(record: Record) -> str:
    """What the split hashes: the record, less system messages (a system prompt moves nothing)."""
    if "messages" not in record:
        return canonical(record)
    turns = [message for message in record["messages"] if message["role"] != "system"]
    # A chat without tools hashes its list of messages alone, as before tools were accepted, so
    # that data prepared then splits the same way now.
    if "tools" not in record:
        return canonical(turns)
    return canonical({"messages": turns, "tools": record["tools"]})


def chat_of(record: Record) -> tuple[list[Message], list[Any] | None]:
    """The messages and tools mlx-lm renders through the chat template for a chat or completions
    record (CompletionsDataset makes the prompt a user message and the completion the reply)."""
    if "messages" in record:
        return record["messages"], record.get("tools")
    messages = [{"role": "user", "content": record["prompt"]},
                {"role": "assistant", "content": record["completion"]}]
    return messages, record.get("tools")


def has_chat_template(tokenizer: Any) -> bool:
    flag = getattr(tokenizer, "has_chat_template", None)  # mlx-lm's TokenizerWrapper
    if isinstance(flag, bool):
        return flag
    return getattr(tokenizer, "chat_template", None) is not None


def example_length(record: Record, tokenizer: Any = None) -> int:
    """Tokens as mlx-lm tokenizes the example for training, or characters without a tokenizer."""
    if tokenizer is None:
        return character_length(record)
    if "text" in record:
        return text_tokens(record["text"], tokenizer)
    messages, tools = chat_of(record)
    if has_chat_template(tokenizer):
        return len(tokenizer.apply_chat_template(messages, tools=tools, return_dict=False))
    return len(tokenizer.encode("\n".join(message.get("content") or "" for message in messages)))


def text_tokens(text: str, tokenizer: Any) -> int:
    """TextDataset's count: the encoded text, and an end-of-sequence token unless it ends in one."""
    tokens = tokenizer.encode(text)
    ends_in_eos = bool(tokens) and tokens[-1] == tokenizer.eos_token_id
    return len(tokens) + (0 if ends_in_eos else 1)


def character_length(record: Record) -> int:
    """The characters of the text the model sees: contents, and tool calls and tools as JSON."""
    if "text" in record:
        return len(record["text"])
    messages, tools = chat_of(record)
    length = sum(len(message.get("content") or "") for message in messages)
    length += sum(len(canonical(message["tool_calls"])) for message in messages if "tool_calls" in message)
    return length + (len(canonical(tools)) if tools else 0)


def check_writable(location: str, record: Record) -> None:
    """Refuse what cannot be written as JSON text in UTF-8, naming its row: a lone surrogate such
    as \\ud800, or NaN or Infinity in a tool schema or arguments (json reads them, JSON has none)."""
    try:
        json.dumps(record, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except UnicodeEncodeError as error:
        raise DataError(f"{location}: text that is not valid Unicode ({error.reason}, "
                        f"{error.object[error.start:error.end]!a}): fix or drop the row") from None
    except ValueError:
        raise DataError(f"{location}: a number that JSON cannot hold (NaN or Infinity): write it as a "
                        "string or drop it") from None
