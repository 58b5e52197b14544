"""Base model vs fine-tuned model on the same prompt, side by side (`invoke generate`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def load_model(model_dir: Path, adapter_dir: Path | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) of an mlx-lm model directory, with the LoRA adapters of a run if given."""
    from mlx_lm import load

    return load(str(model_dir), adapter_path=str(adapter_dir) if adapter_dir else None)


def reply(model: Any, tokenizer: Any, prompt: str, max_tokens: int) -> str:
    """The model's greedy answer to one user message."""
    from mlx_lm import generate

    messages = [{"role": "user", "content": prompt}]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        text = prompt
    return generate(model, tokenizer, prompt=text, max_tokens=max_tokens, verbose=False).strip()


def answer(model_dir: Path, prompt: str, max_tokens: int, adapter_dir: Path | None = None) -> str:
    """Greedy answer of the model (with the LoRA adapters of ``adapter_dir`` when given)."""
    return reply(*load_model(model_dir, adapter_dir), prompt, max_tokens)


def side_by_side(model_dir: Path, adapter_dir: Path, prompt: str, max_tokens: int = 120,
                 console: Console | None = None) -> tuple[str, str]:
    base = answer(model_dir, prompt, max_tokens)
    tuned = answer(model_dir, prompt, max_tokens, adapter_dir)
    table = Table(title=prompt, show_lines=True)
    table.add_column(f"base: {model_dir.name}", ratio=1)
    table.add_column(f"fine-tuned: {adapter_dir.name}", ratio=1)
    table.add_row(base, tuned)
    (console or Console()).print(table)
    return base, tuned
