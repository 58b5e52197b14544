"""Pirate speech, the style the bundled demo data set (data/pirate.jsonl) teaches a model.

`pirate_score` counts pirate words in a text, so base and fine-tuned models can be compared on
`HELD_OUT_PROMPTS`, plain instructions that are not in the data set.
"""

from __future__ import annotations

import re

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
