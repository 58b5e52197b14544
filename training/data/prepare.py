"""Turn training data into the folder `mlx_lm.lora --data DIR` reads, split into train / valid (/ test).

    python -m training.data.prepare --input data.jsonl --output DIR [--valid-fraction 0.2]
        [--test-fraction 0] [--seed 0] [--max-tokens N --model PATH] [--system-prompt TEXT]

writes DIR/train.jsonl, DIR/valid.jsonl, DIR/test.jsonl (only with a test fraction) and
DIR/summary.json, one example per line in one of the formats mlx-lm trains on (LORA.md, "Data").

Input is a regular UTF-8 file (a leading byte order mark is dropped) of JSON Lines, or a .json file
holding a list of rows, in one of five formats, told apart by the first row's keys; every row must
then be of that format, and a row with another format's keys is refused (`training/data/formats.py`
reads them, `training/data/examples.py` makes each the line written out):
- dolly:  {"instruction", "context", "response", "category"}: becomes a chat, the user saying the
  instruction followed by the context after a blank line when there is one, the assistant the
  response; stripped of surrounding blank space.
- alpaca: {"instruction", "input", "output"}: likewise with input and output.
- chat:   {"messages": [...], "tools": [...]}: mlx-lm's chat and tools formats, kept as they are
  once checked (`training/data/chat.py`: roles system / user / assistant / tool, the keys chat
  templates read, the turns in order, at least one user message, the assistant speaks last; the
  optional tools and the assistants' tool_calls as `training/data/tool_calls.py` says).
- completions: {"prompt", "completion"} (and "tools"): kept as written, in this format.
- text:   {"text"}: kept as written, in this format.
Other keys of a row are dropped. `system_prompt`, when given, opens every chat (dolly and alpaca
rows included) that has no system message of its own; completions and text have no place for one,
so it is refused for them.

The split is by hash, not by shuffle: each example goes to test, valid or train according to where
sha256(seed, the example less its system messages) falls in [0, 1) (test below test_fraction, valid
below test_fraction + valid_fraction). The same seed always gives the same split, appending rows
never moves an example already there, and changing the system prompt moves nothing; in exchange the
fractions are expected, not exact. When a split that must not be empty (train, valid, test when
asked for) comes out empty, the example whose hash lies nearest to that split's range is moved into
it, so tiny data sets still work (at least 2 examples, 3 with a test split).

Exact duplicates (the same line written out) are dropped, and so are examples longer than
`max_tokens` as counted by the model's tokenizer the way mlx-lm tokenizes them for training (the
chat template, with the tools, for chat and completions; the text and an end token for text):
never truncated, since a cut-off answer teaches the model to stop mid-sentence. Bad input stops
with the file, line and what is wrong, and writes nothing; outputs replace the old ones only once
all of them are written.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from training.data.examples import (
    SYSTEM_PROMPT_FORMATS,
    Record,
    canonical,
    check_writable,
    example_length,
    split_position,
    to_record,
)
from training.data.formats import DataError, Row, check_same_format, detect_format, read_rows

SPLITS = ("train", "valid", "test")
OUTPUT_FILES = ("train.jsonl", "valid.jsonl", "test.jsonl", "summary.json")


@dataclass(frozen=True)
class Example:
    record: Record  # the line written out
    position: float  # where the example's hash falls in [0, 1)
    length: int  # tokens with a tokenizer, else characters


@dataclass
class Summary:
    input: str
    output: str
    format: str
    rows_read: int
    kept: int
    dropped_too_long: int
    dropped_duplicates: int
    train: int
    valid: int
    test: int
    seed: int
    valid_fraction: float
    test_fraction: float
    max_tokens: int | None
    length_unit: str  # "tokens" when a tokenizer counted, else "characters"
    length_min: int
    length_mean: float
    length_max: int


def required_splits(test_fraction: float) -> tuple[str, ...]:
    return ("train", "valid", "test") if test_fraction > 0 else ("train", "valid")


def too_few_message(count: int, test_fraction: float) -> str:
    if test_fraction > 0:
        need = "3 (one each for train, valid and test)"
    else:
        need = "2 (one for train, one for valid)"
    return f"only {count} example{'' if count == 1 else 's'} after filtering: need at least {need}"


def assign_splits(positions: Sequence[float], valid_fraction: float, test_fraction: float) -> list[str]:
    """The split of each example, from its hash position; no required split is left empty."""
    ranges = {
        "test": (0.0, test_fraction),
        "valid": (test_fraction, test_fraction + valid_fraction),
        "train": (test_fraction + valid_fraction, 1.0),
    }
    splits = [next(name for name, (_, high) in ranges.items() if position < high) for position in positions]
    required = required_splits(test_fraction)
    if len(splits) < len(required):
        raise DataError(too_few_message(len(splits), test_fraction))
    for name in ("test", "valid", "train"):
        if name not in required or name in splits:
            continue
        # With at least one example per required split, an empty split means another holds two or more.
        counts = Counter(splits)
        donor = max(required, key=lambda split: (counts[split], split == "train"))
        if counts[donor] < 2:
            raise DataError(f"the split leaves {name} empty")
        low, high = ranges[name]

        def distance(index: int, low: float = low, high: float = high) -> tuple[float, float]:
            position = positions[index]
            return (max(low - position, position - high, 0.0), position)

        moved = min((index for index, split in enumerate(splits) if split == donor), key=distance)
        splits[moved] = name
    return splits


def load_tokenizer(model: Path) -> Any:
    """The tokenizer of a local mlx-lm model directory, loaded as mlx-lm loads it for training."""
    if not model.is_dir():
        raise DataError(f"--model {model}: not a directory (a local mlx-lm model directory is needed)")
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    try:
        return mlx_load_tokenizer(model)
    except (OSError, ValueError) as error:
        raise DataError(f"--model {model}: cannot load its tokenizer: {error}") from None


def check_fractions(valid_fraction: float, test_fraction: float) -> None:
    if not 0 < valid_fraction < 1:
        raise DataError(f"the valid fraction must be between 0 and 1, not {valid_fraction}")
    if not 0 <= test_fraction < 1:
        raise DataError(f"the test fraction must be at least 0 and below 1, not {test_fraction}")
    if valid_fraction + test_fraction >= 1:
        raise DataError(
            f"the valid + test fractions ({valid_fraction} + {test_fraction}) leave nothing to train on"
        )


def check_output_spares_input(input: Path, output: Path) -> None:
    """Refuse an output folder whose files (written, or removed as stale) include the input."""
    # os.path.realpath, not Path.resolve: on a symlink loop that raises RuntimeError, and the loop is
    # for reading or writing to name.
    if os.path.realpath(input) in {os.path.realpath(output / name) for name in OUTPUT_FILES}:
        raise DataError(f"--output {output} would replace the input {input} (it writes "
                        f"{', '.join(OUTPUT_FILES)} there): choose another output folder")


def write_atomically(output: Path, files: dict[str, str]) -> None:
    """Write every file into a fresh directory next to `output`, then move them into place together."""
    try:
        replace_outputs(output, files)
    except OSError as error:
        raise DataError(f"--output {output}: cannot write there ({error.strerror or error}): "
                        "choose a folder you can write to") from None


def replace_outputs(output: Path, files: dict[str, str]) -> None:
    if output.exists() and not output.is_dir():
        raise DataError(f"--output {output}: exists and is not a folder: choose a folder (new or existing)")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise DataError(f"--output {output}: a path above it is not a folder (a file or a broken "
                        "link): choose an output folder whose parents are folders") from None
    staging = output.parent / f".{output.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        for name, text in files.items():
            (staging / name).write_text(text, encoding="utf-8")
        if not output.exists():
            staging.rename(output)
            return
        for name in files:
            os.replace(staging / name, output / name)
        # A test.jsonl left from an earlier run would overlap this run's train split.
        for name in set(OUTPUT_FILES) - files.keys():
            (output / name).unlink(missing_ok=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@dataclass(frozen=True)
class Kept:
    """The examples that pass the filters, and how many each filter dropped."""

    examples: list[Example]
    dropped_duplicates: int
    dropped_too_long: int


def check_options(
    valid_fraction: float, test_fraction: float, max_tokens: int | None, tokenizer: Any
) -> None:
    check_fractions(valid_fraction, test_fraction)
    if max_tokens is not None and tokenizer is None:
        raise DataError("max_tokens needs a tokenizer to count tokens with")
    if max_tokens is not None and max_tokens < 1:
        raise DataError(f"max_tokens must be positive, not {max_tokens}")


def keep_examples(
    records: Sequence[Record], seed: int, tokenizer: Any = None, max_tokens: int | None = None
) -> Kept:
    """The records as examples, without exact duplicates and those longer than max_tokens."""
    seen: set[str] = set()
    examples: list[Example] = []
    dropped_duplicates = dropped_too_long = 0
    for record in records:
        key = canonical(record)
        if key in seen:
            dropped_duplicates += 1
            continue
        seen.add(key)
        length = example_length(record, tokenizer)
        if max_tokens is not None and length > max_tokens:
            dropped_too_long += 1
            continue
        examples.append(Example(record, split_position(seed, record), length))
    return Kept(examples, dropped_duplicates, dropped_too_long)


def check_system_prompt(input: Path, data_format: str, system_prompt: str | None) -> None:
    """Refuse a system prompt the format has no place for, rather than drop it unsaid."""
    if system_prompt and data_format not in SYSTEM_PROMPT_FORMATS:
        raise DataError(f"{input}: --system-prompt given for {data_format} rows, which have no system "
                        f"message (mlx-lm trains on them as written): drop it, or use chat rows")


def to_records(rows: Sequence[Row], data_format: str, system_prompt: str | None) -> list[Record]:
    """Every row as the record written out; the first bad row stops it (see `to_record`)."""
    records = []
    for row in rows:
        check_same_format(row, data_format)
        record = to_record(row, data_format, system_prompt)
        check_writable(row.location, record)
        records.append(record)
    return records


def split_lines(
    examples: Sequence[Example], valid_fraction: float, test_fraction: float
) -> dict[str, list[str]]:
    """The JSON lines of each split (see `assign_splits`), in the order of the examples."""
    splits = assign_splits([example.position for example in examples], valid_fraction, test_fraction)
    lines: dict[str, list[str]] = {name: [] for name in SPLITS}
    for example, split in zip(examples, splits, strict=True):
        lines[split].append(json.dumps(example.record, ensure_ascii=False) + "\n")
    return lines


def prepare(
    input: Path,
    output: Path,
    valid_fraction: float = 0.2,
    test_fraction: float = 0.0,
    seed: int = 0,
    max_tokens: int | None = None,
    tokenizer: Any = None,
    system_prompt: str | None = None,
    console: Console | None = None,
) -> Summary:
    """Convert, filter and split `input` into `output` (see the module docstring); print a summary."""
    input, output = Path(input), Path(output)
    check_options(valid_fraction, test_fraction, max_tokens, tokenizer)
    check_output_spares_input(input, output)
    rows = read_rows(input)
    if not rows:
        raise DataError(f"{input}: no rows: the input is empty")
    data_format = detect_format(rows[0])
    check_system_prompt(input, data_format, system_prompt)
    kept = keep_examples(to_records(rows, data_format, system_prompt), seed, tokenizer, max_tokens)
    if len(kept.examples) < len(required_splits(test_fraction)):
        details = [f"{len(rows)} read", f"{kept.dropped_duplicates} duplicates"]
        if max_tokens is not None:
            details.append(f"{kept.dropped_too_long} longer than {max_tokens} tokens")
        too_few = too_few_message(len(kept.examples), test_fraction)
        raise DataError(f"{input}: {too_few} ({', '.join(details)})")

    lines = split_lines(kept.examples, valid_fraction, test_fraction)
    lengths = [example.length for example in kept.examples]
    summary = Summary(
        input=str(input),
        output=str(output),
        format=data_format,
        rows_read=len(rows),
        kept=len(kept.examples),
        dropped_too_long=kept.dropped_too_long,
        dropped_duplicates=kept.dropped_duplicates,
        train=len(lines["train"]),
        valid=len(lines["valid"]),
        test=len(lines["test"]),
        seed=seed,
        valid_fraction=valid_fraction,
        test_fraction=test_fraction,
        max_tokens=max_tokens,
        length_unit="tokens" if tokenizer is not None else "characters",
        length_min=min(lengths),
        length_mean=round(sum(lengths) / len(lengths), 1),
        length_max=max(lengths),
    )
    files = {f"{name}.jsonl": "".join(lines[name]) for name in required_splits(test_fraction)}
    files["summary.json"] = json.dumps(asdict(summary), indent=2) + "\n"
    write_atomically(output, files)
    print_summary(summary, console or Console())
    return summary


def print_summary(summary: Summary, console: Console) -> None:
    table = Table(title=f"Prepared {summary.input} ({summary.format}) -> {summary.output}")
    table.add_column("", style="bold")
    table.add_column("count", justify="right")
    if summary.max_tokens is None:
        too_long_label = "dropped: too long (no limit)"
    else:
        too_long_label = f"dropped: longer than {summary.max_tokens} tokens"
    rows = [
        ("rows read", summary.rows_read),
        ("kept", summary.kept),
        (too_long_label, summary.dropped_too_long),
        ("dropped: duplicates", summary.dropped_duplicates),
        ("train", summary.train),
        ("valid", summary.valid),
    ]
    if summary.test_fraction > 0:
        rows.append(("test", summary.test))
    rows.append(
        (
            f"{summary.length_unit} min / mean / max",
            f"{summary.length_min} / {summary.length_mean} / {summary.length_max}",
        )
    )
    for label, value in rows:
        table.add_row(label, str(value))
    console.print(table)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m training.data.prepare",
        description="Turn dolly, alpaca, chat (with tools), completions or text rows into mlx-lm data "
        "split into train/valid(/test). The split hashes each example, so it is stable for a seed and "
        "when rows are appended; the fractions are expected, not exact.",
    )
    parser.add_argument("--input", type=Path, required=True, help="a .jsonl file (or a .json list of rows)")
    parser.add_argument("--output", type=Path, required=True, help="the directory to write the splits to")
    parser.add_argument("--valid-fraction", type=float, default=0.2, help="expected share of valid (0.2)")
    parser.add_argument("--test-fraction", type=float, default=0.0, help="expected share of test (0: none)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split hash (0)")
    parser.add_argument("--max-tokens", type=int, help="drop examples longer than this; needs --model")
    parser.add_argument("--model", type=Path, help="local mlx-lm model directory: its tokenizer counts")
    parser.add_argument("--system-prompt", help="system message for chats that have none (dolly, alpaca "
                        "and chat rows; completions and text have no place for one)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_tokens is not None and args.model is None:
        parser.error("--max-tokens needs --model: the model's tokenizer counts the tokens")
    try:
        tokenizer = load_tokenizer(args.model) if args.model is not None else None
        prepare(
            args.input,
            args.output,
            valid_fraction=args.valid_fraction,
            test_fraction=args.test_fraction,
            seed=args.seed,
            max_tokens=args.max_tokens,
            tokenizer=tokenizer,
            system_prompt=args.system_prompt,
        )
    except DataError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
