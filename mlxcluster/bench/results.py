"""Where benchmark results go, and how: one JSON file each under runs/bench/."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

from mlxcluster.errors import UserError
from mlxcluster.paths import BENCH_RESULTS


def stamp() -> str:
    """A benchmark's local start time, for file names and tags."""
    return dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def date() -> str:
    """Now in UTC, for the record."""
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


def write(name: str, result: dict[str, Any], output: str | Path | None = None,
          when: str | None = None) -> Path:
    """Write `result` to `output`, or runs/bench/<name>-<when>.json: the path written."""
    out = Path(output) if output else BENCH_RESULTS / f"{name}-{when or stamp()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return out


def held(name: str, result: dict[str, Any], output: str | Path | None, summary: str, failed: str) -> Path:
    """The end of a benchmark that holds its results to a verdict (result["wrong"]: what fell
    short): write them, print `summary` and each wrong line; a UserError saying `failed` when
    anything was wrong, after the file is written."""
    out = write(name, result, output)
    print(summary)
    for line in result["wrong"]:
        print(f"wrong: {line}")
    print(f"wrote {out}")
    if result["wrong"]:
        raise UserError(f"{failed}: see {out}")
    return out
