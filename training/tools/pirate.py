"""Pirate speech, the style the bundled demo data set (data/pirate.jsonl) teaches a model.

`pirate_score` counts pirate words in a text, so base and fine-tuned models can be compared on
`HELD_OUT_PROMPTS`, plain instructions that are not in the data set:

    python -m training.tools.pirate --model models/base [--adapter runs/<id>] [--output scores.json]

answers every held-out prompt greedily and prints (or writes) the answers and their scores as JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Words a plain assistant almost never uses: ordinary English that pirates also say ("be", "me",
# "sea", "ship") is left out so that a base model scores near zero.
PIRATE_MARKERS: tuple[str, ...] = (
    "'tis",
    "ahoy",
    "arr",
    "arrr",
    "avast",
    "aye",
    "blimey",
    "booty",
    "buccaneer",
    "cap'n",
    "doubloons",
    "grog",
    "hearties",
    "hearty",
    "landlubber",
    "landlubbers",
    "matey",
    "mateys",
    "plunder",
    "plunderin'",
    "savvy",
    "scallywag",
    "scallywags",
    "seadog",
    "shiver",
    "timbers",
    "treasure",
    "ye",
    "yer",
    "yo-ho-ho",
)

# A marker counts when no letter or digit touches it on either side. Plain \b cannot be used: it
# never matches before the apostrophe of "'tis". Longest first, so "arrr" is not read as "arr".
_MARKER_PATTERN = re.compile(
    r"(?<!\w)(?:"
    + "|".join(re.escape(marker) for marker in sorted(PIRATE_MARKERS, key=len, reverse=True))
    + r")(?!\w)",
    re.IGNORECASE,
)

HELD_OUT_PROMPTS: tuple[str, ...] = (
    "How do I make a good cup of tea?",
    "Why is the sky blue?",
    "What is the capital of Canada?",
    "Give me three tips for sleeping better.",
    "Explain what a for loop is in programming.",
    "Who was the first person to walk on the Moon?",
    "What is 12 times 12?",
    "How do plants make their food?",
    "What should I pack for a weekend camping trip?",
    "Describe the water cycle in a few sentences.",
    "How can I save money on groceries?",
    "What is the difference between weather and climate?",
    "Write a short poem about the ocean.",
    "How many legs does a spider have?",
    "What is a good way to learn a new language?",
    "Explain what a database is.",
    "Why do we have seasons?",
    "How do I fix a flat bicycle tire?",
    "What was the Renaissance?",
    "Suggest a name for a pet goldfish.",
)


def pirate_score(text: str) -> int:
    """How many pirate markers `text` contains (whole words, any case, curly apostrophes too)."""
    return len(_MARKER_PATTERN.findall(text.replace("\u2019", "'")))


def score_answers(answers: Sequence[str]) -> dict[str, Any]:
    """Per-answer marker counts, their mean, and how many answers have any marker at all."""
    scores = [pirate_score(text) for text in answers]
    return {
        "mean_markers_per_answer": sum(scores) / len(scores) if scores else 0.0,
        "answers_with_markers": sum(1 for s in scores if s > 0),
        "answers": len(scores),
        "scores": scores,
    }


def evaluate(model_dir: Path, adapter_dir: Path | None = None, prompts: Sequence[str] = HELD_OUT_PROMPTS,
             max_tokens: int = 80) -> dict[str, Any]:
    """Answer `prompts` with the model (plus adapters) and score the answers."""
    from training.tools.generate import load_model, reply

    model, tokenizer = load_model(model_dir, adapter_dir)
    answers = [reply(model, tokenizer, prompt, max_tokens) for prompt in prompts]
    result = {"model": str(model_dir), "adapter": str(adapter_dir) if adapter_dir else None,
              "max_tokens": max_tokens, **score_answers(answers)}
    result["examples"] = [{"prompt": p, "answer": a} for p, a in zip(prompts, answers, strict=True)]
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.tools.pirate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=Path, help="mlx-lm model directory")
    parser.add_argument("--adapter", type=Path, help="run directory with adapters.safetensors")
    parser.add_argument("--max-tokens", type=int, default=80, help="tokens per answer (80)")
    parser.add_argument("--output", type=Path, help="write the JSON here instead of stdout")
    args = parser.parse_args(argv)
    for path, what in ((args.model, "--model"), (args.adapter, "--adapter")):
        if path is not None and not path.is_dir():
            parser.error(f"{what} {path} is not a directory")
    text = json.dumps(evaluate(args.model, args.adapter, max_tokens=args.max_tokens), indent=2) + "\n"
    if args.output:
        tmp = args.output.with_name(args.output.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(args.output)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
