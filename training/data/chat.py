"""Chat rows checked: mlx-lm's chat format, with the tools and tool calls of its tools format.

A chat row is {"messages": [...]} with an optional "tools" list of function schemas beside it
(`training/data/tool_calls.py` checks those and the calls). It is written out as it came, less
any other keys of the row, once these hold:
- every message is an object with a role (system, user, assistant or tool) and only the keys
  mlx-lm's and Hugging Face's chat templates read: role, content, tool_calls, tool_call_id, name;
- content is a string, not blank except in a system message; an assistant message with
  tool_calls may have no content, null or blank content;
- tool_calls are on assistant messages only, tool_call_id on tool messages only, name is text;
- an optional system message comes first, then a user message; a user message is answered by an
  assistant; an assistant's tool calls are answered by tool messages (one or more), which an
  assistant message follows; an assistant message without calls is followed by a user one;
- a tool message's tool_call_id or name, when given, is one of the calls it answers;
- there is a user message, and the assistant speaks last.
"""

from __future__ import annotations

from typing import Any

from training.data.formats import DataError, Message, Row
from training.data.tool_calls import ToolCall, checked_tool_calls, checked_tool_names, non_empty_string

ROLES = ("system", "user", "assistant", "tool")
MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")
# Which message may carry each key, besides role and content.
KEY_ROLES = {"tool_calls": ("assistant",), "tool_call_id": ("tool",), "name": ROLES}
TURNS = ("a chat is an optional system message, then user and assistant messages in turn; an "
         "assistant's tool calls are answered by tool messages, then the assistant speaks")


def checked_chat(row: Row) -> dict[str, Any]:
    """The row as written out: its messages, and its tools when it has them."""
    if "messages" not in row.value:
        raise DataError(f"{row.location}: chat row has no 'messages'")
    messages = row.value["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{row.location}: chat row's 'messages' must be a non-empty list")
    tool_names = checked_tool_names(row.location, row.value["tools"]) if "tools" in row.value else None
    calls = [check_message(f"{row.location}: message {number}", message, tool_names)
             for number, message in enumerate(messages, 1)]
    if not any(message["role"] == "user" for message in messages):
        raise DataError(f"{row.location}: chat row has no user message")
    if messages[-1]["role"] != "assistant":
        last = messages[-1]["role"]
        raise DataError(f"{row.location}: chat row must end with an assistant message, not "
                        f"{with_article(last)} one")
    check_turns(row.location, messages, calls)
    if "tools" in row.value:
        return {"messages": messages, "tools": row.value["tools"]}
    return {"messages": messages}


def check_message(where: str, message: Any, tool_names: list[str] | None) -> list[ToolCall]:
    """One message's checks on its own; the calls it makes (none but for an assistant's)."""
    if not isinstance(message, dict):
        raise DataError(f"{where} is not a JSON object")
    if "role" not in message:
        raise DataError(f"{where} has no 'role'")
    role = message["role"]
    if role not in ROLES:
        raise DataError(f"{where} has role {role!r}: expected one of {', '.join(ROLES)}")
    if unknown := sorted(set(message) - set(MESSAGE_KEYS)):
        raise DataError(f"{where} has keys {unknown} besides {', '.join(MESSAGE_KEYS)}: the keys "
                        "chat templates read")
    for key, roles in KEY_ROLES.items():
        if key in message and role not in roles:
            raise DataError(f"{where}: {with_article(role)} message with '{key}': only "
                            f"{' or '.join(roles)} messages have it")
    for key in ("tool_call_id", "name"):
        if key in message and not non_empty_string(message[key]):
            raise DataError(f"{where}: '{key}' must be a non-empty string")
    calls = checked_tool_calls(where, message["tool_calls"], tool_names) if "tool_calls" in message else []
    check_content(where, message, bool(calls))
    return calls


def check_content(where: str, message: Message, makes_calls: bool) -> None:
    """Text to learn or to condition on: only a message that makes tool calls may say nothing."""
    if makes_calls and message.get("content") is None:
        return  # no content, or null: how OpenAI and mlx-lm write a message that only calls
    if "content" not in message:
        raise DataError(f"{where} has no 'content'")
    if message["content"] is None:
        raise DataError(f"{where}: 'content' is null, which only an assistant message with "
                        "tool_calls may be")
    if not isinstance(message["content"], str):
        raise DataError(f"{where}: 'content' is not a string")
    if message["role"] != "system" and not makes_calls and not message["content"].strip():
        raise DataError(f"{where}: an empty {message['role']} message: drop the row or fill it in")


def check_turns(location: str, messages: list[Message], calls: list[list[ToolCall]]) -> None:
    """The order of the roles (see the module docstring), and what each tool message answers."""
    turns = messages[1:] if messages[0]["role"] == "system" else messages
    offset = len(messages) - len(turns)
    expected: tuple[str, ...] = ("user",)
    answering: list[ToolCall] = []  # the calls of the last assistant message
    for index, message in enumerate(turns):
        number = index + offset + 1
        role = message["role"]
        if role not in expected:
            raise DataError(f"{location}: message {number} is {with_article(role)} message where "
                            f"{' or '.join(map(with_article, expected))} one must come: {TURNS}")
        if role == "tool":
            check_answer(f"{location}: message {number}", message, answering)
        if role == "assistant":
            answering = calls[number - 1]
        expected = next_roles(role, bool(answering))


def with_article(role: str) -> str:
    """"an assistant", "a user": of the roles (ROLES), only assistant takes "an"."""
    return f"an {role}" if role == "assistant" else f"a {role}"


def next_roles(role: str, calls_open: bool) -> tuple[str, ...]:
    if role == "user":
        return ("assistant",)
    if role == "tool":
        return ("tool", "assistant")
    return ("tool",) if calls_open else ("user",)


def check_answer(where: str, message: Message, answering: list[ToolCall]) -> None:
    """A tool message's tool_call_id and name, when given, name one of the calls it answers."""
    if "tool_call_id" in message and message["tool_call_id"] not in {call.id for call in answering}:
        ids = [call.id for call in answering if call.id is not None]
        raise DataError(f"{where} answers tool_call_id {message['tool_call_id']!r}, which the calls "
                        f"before it do not have ({', '.join(map(repr, ids)) or 'they have no ids'})")
    if "name" in message and message["name"] not in {call.name for call in answering}:
        names = ", ".join(repr(call.name) for call in answering)
        raise DataError(f"{where} answers {message['name']!r}, which the calls before it do not call "
                        f"(they call {names})")
