"""The tools of a chat row and the tool calls of its assistant messages, checked.

mlx-lm's chat data may carry a `tools` list beside the messages (function schemas, which
ChatDataset hands to the chat template) and assistant messages with `tool_calls`, in the shape
OpenAI and Hugging Face chat templates use:

    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "...",
               "parameters": {"type": "object", "properties": {...}}}}]
    {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}}]}

`arguments` may be a JSON string (OpenAI, Mistral) or an object (Hugging Face templates): both are
kept as written, since which one a template renders depends on the model. What a template cannot
render, or renders as nonsense, is refused here with a `DataError` naming the row and the entry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from training.data.formats import DataError, json_type

TOOL_SHAPE = '{"type": "function", "function": {"name": ..., "parameters": {...}}}'
CALL_SHAPE = '{"type": "function", "function": {"name": ..., "arguments": {...}}}'
PLURALS = {"null": "nulls", "true/false": "true/false values", "number": "numbers", "string": "strings",
           "list": "lists", "dict": "objects"}


@dataclass(frozen=True)
class ToolCall:
    """What a tool message answering the call may name it by."""

    id: str | None
    name: str


def checked_tool_names(location: str, tools: Any) -> list[str]:
    """The function names of a row's `tools`, each a distinct name, or a DataError."""
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise DataError(f"{location}: 'tools' must be a list of objects (function schemas such as "
                        f"{TOOL_SHAPE}), not {describe(tools)}")
    names = [tool_name(f"{location}: tool {number}", tool) for number, tool in enumerate(tools, 1)]
    # Two schemas under one name leave the template (and the model) to guess which one a call means.
    if repeated := sorted({name for name in names if names.count(name) > 1}):
        raise DataError(f"{location}: 'tools' names {', '.join(map(repr, repeated))} more than once")
    return names


def tool_name(where: str, tool: dict[str, Any]) -> str:
    if tool.get("type", "function") != "function":
        raise DataError(f"{where} has type {tool['type']!r}: only function tools are rendered ({TOOL_SHAPE})")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise DataError(f"{where} has no 'function' object: a tool is {TOOL_SHAPE}")
    name = function_name(where, function)
    if "parameters" in function and not isinstance(function["parameters"], dict):
        raise DataError(f"{where}: the parameters of {name!r} must be an object (a JSON schema), not "
                        f"{describe(function['parameters'])}")
    if "description" in function and not isinstance(function["description"], str):
        raise DataError(f"{where}: the description of {name!r} is not a string")
    return name


def checked_tool_calls(where: str, tool_calls: Any, tool_names: list[str] | None) -> list[ToolCall]:
    """The calls of one assistant message; each names a function of the row's tools, if it has any."""
    if not isinstance(tool_calls, list) or not tool_calls:
        raise DataError(f"{where}: 'tool_calls' must be a non-empty list of calls such as {CALL_SHAPE}")
    return [checked_call(f"{where}: tool call {number}", call, tool_names)
            for number, call in enumerate(tool_calls, 1)]


def checked_call(where: str, call: Any, tool_names: list[str] | None) -> ToolCall:
    if not isinstance(call, dict):
        raise DataError(f"{where} is not an object: a call is {CALL_SHAPE}")
    if call.get("type", "function") != "function":
        raise DataError(f"{where} has type {call['type']!r}: only function calls are rendered")
    if "id" in call and not non_empty_string(call["id"]):
        raise DataError(f"{where}: 'id' must be a non-empty string")
    function = call.get("function")
    if not isinstance(function, dict):
        raise DataError(f"{where} has no 'function' object: a call is {CALL_SHAPE}")
    name = function_name(where, function)
    if tool_names is not None and name not in tool_names:
        raise DataError(f"{where} calls {name!r}, which is not among the row's tools "
                        f"({', '.join(map(repr, tool_names)) or 'none'})")
    check_arguments(where, name, function)
    return ToolCall(call.get("id"), name)


def function_name(where: str, function: dict[str, Any]) -> str:
    name = function.get("name")
    if not non_empty_string(name):
        raise DataError(f"{where}: the function has no name (a non-empty string in 'name')")
    return name


def check_arguments(where: str, name: str, function: dict[str, Any]) -> None:
    """Arguments are an object, or a string holding one as JSON (OpenAI's way)."""
    if "arguments" not in function:
        raise DataError(f"{where}: the call of {name!r} has no 'arguments' (give {{}} for none)")
    arguments = function["arguments"]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        # RecursionError: a string of deeply nested brackets; ValueError covers bad JSON too.
        except (ValueError, RecursionError):
            raise DataError(f"{where}: the arguments of {name!r} are a string that is not JSON: "
                            "write them as an object or as a JSON string of one") from None
    if not isinstance(arguments, dict):
        raise DataError(f"{where}: the arguments of {name!r} must be an object (or a JSON string of "
                        f"one), not {describe(arguments)}")


def non_empty_string(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


def describe(value: Any) -> str:
    """A value's JSON type, with a list's element types: "a list of strings" says what went wrong."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        kinds = sorted({PLURALS.get(json_type(item), json_type(item)) for item in value})
        return f"a list of {' and '.join(kinds)}" if kinds else "an empty list"
    return {"number": "a number", "string": "a string"}.get(json_type(value), json_type(value))
