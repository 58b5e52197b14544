"""Rows of every input format for the prepare tests, and a tokenizer whose chat template renders
tools, tool calls and tool results the way Hugging Face templates do (so dropping any of them
shows in the tokens)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlx_lm.tuner.datasets import ChatDataset, CompletionsDataset, TextDataset

from training.model import stand_in

# Renders the tools (name: schema), each message's role and content, an assistant's calls
# (arguments as written: a JSON string, or an object as JSON) and what a tool message answers.
# Hugging Face compiles templates with trim_blocks: a newline right after a tag is dropped.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>tools\n"
    "{% for tool in tools %}{{ tool['function']['name'] }}: {{ tool['function'] | tojson }}{{ '\\n' }}"
    "{% endfor %}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}{{ '\\n' }}"
    "{% if m['role'] == 'tool' %}(answers {{ m['tool_call_id'] if m['tool_call_id'] is defined "
    "else m['name'] }}) {% endif %}"
    "{% if m['content'] is defined and m['content'] is not none %}{{ m['content'] }}{% endif %}"
    "{% if m['tool_calls'] is defined %}{% for call in m['tool_calls'] %}"
    "<call>{{ call['function']['name'] }} {% if call['function']['arguments'] is string %}"
    "{{ call['function']['arguments'] }}{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}"
    "</call>{% endfor %}{% endif %}<|im_end|>{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}{% endif %}"
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}


def save_tools_tokenizer(directory: Path) -> Path:
    """The stand-in model's byte-level tokenizer (every byte a token, so decoding gives the text
    back) with TOOLS_TEMPLATE, saved as a model folder's tokenizer files."""
    made = stand_in.tokenizer()
    made.chat_template = TOOLS_TEMPLATE
    made.save_pretrained(str(directory))
    return directory


def chat_row(index: int) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": f"Question {index}?"},
                         {"role": "assistant", "content": f"Answer {index}."},
                         {"role": "user", "content": f"And {index} more?"},
                         {"role": "assistant", "content": f"More {index}."}]}


def tool_chat_row(index: int) -> dict[str, Any]:
    """Two calls in parallel (arguments a JSON string, and an object), their results, the reply."""
    weather = {"id": f"call_{index}a", "type": "function",
               "function": {"name": "get_weather", "arguments": json.dumps({"city": f"city {index}"})}}
    time = {"id": f"call_{index}b", "type": "function",
            "function": {"name": "get_time", "arguments": {"zone": f"zone {index}"}}}
    return {"messages": [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": f"Weather and time in city {index}?"},
        {"role": "assistant", "content": None, "tool_calls": [weather, time]},
        {"role": "tool", "tool_call_id": f"call_{index}a", "name": "get_weather",
         "content": f"{index} degrees"},
        {"role": "tool", "tool_call_id": f"call_{index}b", "content": f"{index} o'clock"},
        {"role": "assistant", "content": f"It is {index} degrees at {index} o'clock."},
    ], "tools": [WEATHER, TIME]}


def call_only_row(index: int) -> dict[str, Any]:
    """LORA.md's "tools" example: the assistant's last word is a call, with no content at all."""
    call = {"id": "call_id", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": f"town {index}"})}}
    return {"messages": [{"role": "user", "content": f"What is the weather in town {index}?"},
                         {"role": "assistant", "tool_calls": [call]}], "tools": [WEATHER]}


def completions_row(index: int) -> dict[str, Any]:
    # The leading space and the trailing newline are the data's: they must come out as written.
    return {"prompt": f"Capital of land {index}?", "completion": f" City {index}.\n"}


def completions_tools_row(index: int) -> dict[str, Any]:
    return completions_row(index) | {"tools": [WEATHER]}


def text_row(index: int) -> dict[str, Any]:
    return {"text": f"  Line {index} of a story,\nwith its own spacing. "}


def dolly_row(index: int) -> dict[str, Any]:
    return {"instruction": f"Question {index}?", "context": "", "response": f"Answer {index}.",
            "category": "open_qa"}


def alpaca_row(index: int) -> dict[str, Any]:
    return {"instruction": f"Question {index}?", "input": "", "output": f"Answer {index}.",
            "text": "an alpaca export's pre-formatted prompt, which the instruction keys outrank"}


def instruction_shows(index: int) -> list[str]:
    """A dolly or alpaca row made chat: the instruction said by the user, the answer by the assistant."""
    return [f"<|im_start|>user\nQuestion {index}?<|im_end|>",
            f"<|im_start|>assistant\nAnswer {index}.<|im_end|>"]


@dataclass(frozen=True)
class Kind:
    """One kind of input, what prepare makes of it and what mlx-lm must render of each example."""

    format: str  # what summary.json says
    row: Callable[[int], dict[str, Any]]
    dataset: type  # the mlx-lm dataset class that reads the output
    shows: Callable[[int], list[str]]  # pieces of the rendered example `index`, found in no other
    as_written: bool  # whether the output rows are the input rows, unchanged


KINDS = {
    "chat": Kind("chat", chat_row, ChatDataset, lambda i: [
        "<|im_start|>system\nBe brief.<|im_end|>", f"Question {i}?<", f"Answer {i}.<", f"More {i}."], True),
    "tool-chat": Kind("chat", tool_chat_row, ChatDataset, lambda i: [
        'get_weather: {"name": "get_weather"', 'get_time: {"name": "get_time"',
        f'<call>get_weather {{"city": "city {i}"}}</call><call>get_time {{"zone": "zone {i}"}}</call>',
        f"(answers call_{i}a) {i} degrees<", f"(answers call_{i}b) {i} o'clock<",
        f"It is {i} degrees at {i} o'clock."], True),
    "call-only": Kind("chat", call_only_row, ChatDataset, lambda i: [
        "get_weather: {", f'<|im_start|>assistant\n<call>get_weather {{"city": "town {i}"}}</call>'], True),
    "completions": Kind("completions", completions_row, CompletionsDataset, lambda i: [
        f"<|im_start|>user\nCapital of land {i}?<|im_end|>",
        f"<|im_start|>assistant\n City {i}.\n<|im_end|>"], True),
    "completions-tools": Kind("completions", completions_tools_row, CompletionsDataset, lambda i: [
        "get_weather: {", f"land {i}?<", f" City {i}.\n<"], True),
    "text": Kind("text", text_row, TextDataset, lambda i: [
        f"  Line {i} of a story,\nwith its own spacing. <|im_end|>"], True),
    "dolly": Kind("dolly", dolly_row, ChatDataset, instruction_shows, False),
    "alpaca": Kind("alpaca", alpaca_row, ChatDataset, instruction_shows, False),
}
