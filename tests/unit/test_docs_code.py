"""The docs held to the code: what they name exists, and what they say of it is so.

- docs/house.md names every module of `mlxcluster/` and `training/` in the row of its room, and
  every module a row names is in that room;
- every repository path a doc (README.md, docs/*.md) names in backticks exists: a path from the
  repository's top (`training/loop/resume.py`), from the top of mlxcluster/ or training/
  (`launch/sync.py`), or a module's bare name (`relay.py`), which must be a module of the repository
  (test_docs.py checks the links);
- the defaults a doc states for a flag or a setting are the code's (DEFAULTS_SAID).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import bench_tasks
import tasks
from mlxcluster.bench import overhead
from mlxcluster.jobs import restarts

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
HOUSE = REPO / "docs" / "house.md"
PACKAGES = ("mlxcluster", "training")
# Made while the project runs, or by the user: no doc's path there is the repository's.
NOT_THE_REPOSITORYS = {"build", "runs", "models", ".venv", ".git"}
# Paths the docs name that a user makes (the README's "copy inventory/example/ to inventory/studio/").
USERS = ("inventory/studio",)
# Modules of other projects the docs name by their file.
OTHER_PROJECTS = {"convert_hf_to_gguf.py"}  # llama.cpp's, which `invoke fuse --gguf` stands in for


def modules() -> list[Path]:
    """Every module of mlxcluster/ and training/ (a package's __init__.py is the package, named by
    its room)."""
    return sorted(p.relative_to(REPO) for package in PACKAGES for p in (REPO / package).rglob("*.py")
                  if p.name != "__init__.py")


def repository_files() -> Iterator[Path]:
    for top in REPO.iterdir():
        if top.name in NOT_THE_REPOSITORYS or top.name.startswith((".pytest", ".ruff", ".hypothesis")):
            continue
        yield top
        if top.is_dir():
            yield from (p for p in top.rglob("*") if "__pycache__" not in p.parts)


# --- docs/house.md's rooms ----------------------------------------------------------------------

def house_rows(text: str | None = None) -> list[tuple[list[str], list[str]]]:
    """The rows of house.md's table of rooms: (the rooms, as `mlxcluster/launch/`; the files named in
    its second column, as `sync.py`)."""
    text = HOUSE.read_text() if text is None else text
    section = text.split("## The house: a room per job", 1)[1]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if line.startswith("| ") and len(cells) == 2 and cells[0] != "room" and not cells[0].startswith("-"):
            rooms = re.findall(r"`([\w/]+/)`", cells[0])
            rows.append((rooms, re.findall(r"`([\w.]+\.(?:py|yaml|jsonl))`", cells[1])))
    return rows


def unnamed_in_house(text: str | None = None) -> list[str]:
    """The modules whose room's row in house.md does not name them."""
    named: dict[str, set[str]] = {}
    for rooms, files in house_rows(text):
        for room in rooms:
            named.setdefault(room, set()).update(files)
    return [str(m) for m in modules() if m.name not in named.get(f"{m.parent}/", set())]


def named_but_missing(text: str | None = None) -> list[str]:
    """The files a row of house.md names that are in none of its rooms."""
    return [f"{', '.join(rooms)}: {name}" for rooms, files in house_rows(text) for name in files
            if not any((REPO / room / name).is_file() for room in rooms)]


def test_house_md_has_a_row_per_room():
    rooms = {room for row, _ in house_rows() for room in row}
    packages = {f"{d.relative_to(REPO)}/" for package in PACKAGES
                for d in [REPO / package, *(REPO / package).iterdir()]
                if (d / "__init__.py").is_file() or d.name == "configs"}
    assert packages - rooms == set()


def test_house_md_names_every_module_in_its_rooms_row():
    assert unnamed_in_house() == []


def test_every_module_house_md_names_is_in_its_room():
    assert named_but_missing() == []


def test_a_module_left_out_of_house_md_or_misplaced_in_it_is_found():
    text = HOUSE.read_text()
    assert "`relay.py`" in text and "`watchdog.py`" in text
    unnamed, missing = set(unnamed_in_house(text)), set(named_but_missing(text))
    renamed = text.replace("`relay.py`", "`relays.py`")
    assert set(unnamed_in_house(renamed)) - unnamed == {"mlxcluster/launch/relay.py"}
    assert set(named_but_missing(renamed)) - missing == {"mlxcluster/launch/: relays.py"}
    # watchdog.py named in the row of training/ (top) instead of training/loop/'s
    moved = text.replace("`watchdog.py`, ", "").replace("`loading.py` (", "`watchdog.py`, `loading.py` (")
    assert set(unnamed_in_house(moved)) - unnamed == {"training/loop/watchdog.py"}
    assert set(named_but_missing(moved)) - missing == {"training/: watchdog.py"}


# --- the paths the docs name --------------------------------------------------------------------

TOKEN = re.compile(r"`([^`\s]+)`")


def named_paths(text: str) -> Iterator[tuple[int, str]]:
    """(line, path) for every backticked word of `text` that names a repository path or module."""
    top = {p.name for p in REPO.iterdir()} - NOT_THE_REPOSITORYS
    rooms = {d.name for package in PACKAGES for d in (REPO / package).iterdir()
             if (d / "__init__.py").is_file()}
    for number, line in enumerate(text.splitlines(), 1):
        for word in TOKEN.findall(line):
            path = word.split("::")[0].rstrip(".,:;")  # a pytest id names its file
            if re.search(r"[<>*$=~]|\.\.\.|^/|^\w+:", path) or path.startswith(USERS):
                continue  # a placeholder, a pattern, an absolute path, an assignment, an address
            first = path.split("/")[0]
            if ("/" in path and first in top | rooms) or first in top - {"inventory"} or \
                    re.fullmatch(r"\w+\.py", path):
                yield number, path


def missing_paths(text: str) -> list[str]:
    modules_by_name = {p.name for p in repository_files() if p.suffix == ".py"}
    missing = []
    for number, path in named_paths(text):
        if "/" not in path and path.endswith(".py"):
            found = path in modules_by_name or path in OTHER_PROJECTS
        else:
            found = (REPO / path).exists() or any((REPO / package / path).exists() for package in PACKAGES)
        if not found:
            missing.append(f"line {number}: {path}")
    return missing


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_path_a_doc_names_exists(page: Path):
    assert missing_paths(page.read_text()) == [], page.name


def test_the_paths_a_doc_names_are_found_and_a_wrong_one_is_caught():
    training = (REPO / "docs" / "training.md").read_text()
    found = {path for _, path in named_paths(training)}
    assert {"training/loop/progress.py", "training/loop/checkpoint.py", "training/configs/lora.yaml"} <= found
    assert len([p for page in DOCS for _, p in named_paths(page.read_text())]) > 200
    wrong = ("The parts: `training/progress.py`, `launch/relays.py`, `watchdogs.py`, and "
             "`runs/<id>/`, `build/local/`, `inventory/studio/hosts.yml`, `/etc/hosts`, `tests/unit/`.\n")
    assert missing_paths(wrong) == ["line 1: training/progress.py", "line 1: launch/relays.py",
                                    "line 1: watchdogs.py"]


# --- the defaults the docs state ----------------------------------------------------------------

LORA = yaml.safe_load((REPO / "training" / "configs" / "lora.yaml").read_text())


def flag_default(task: str, flag: str) -> Any:
    return tasks.ns[task].flags.flags[flag].default


def sci(number: float) -> str:
    """A number as the docs write a small one: 1e-4."""
    mantissa, exponent = f"{number:e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


# (doc, what it says, with {} where the value goes, the value as the code has it)
DEFAULTS_SAID: list[tuple[str, str, Callable[[], Any]]] = [
    ("README.md", "training the demo's {} steps", lambda: LORA["iters"]),
    ("docs/training.md", "{} steps of a global batch of", lambda: LORA["iters"]),
    ("docs/training.md", "steps of a global batch of {} at", lambda: LORA["batch_size"]),
    ("docs/training.md", "at a learning rate of {}", lambda: sci(LORA["learning_rate"])),
    ("docs/training.md", "a checkpoint every {} steps", lambda: LORA["save_every"]),
    ("docs/training.md", "the default is {} restarts", lambda: restarts.DEFAULT_MAX_RESTARTS),
    ("docs/training.md", "restarts, down to {} node", lambda: flag_default("train", "min_nodes")),
    ("docs/troubleshooting.md", "{} times by default", lambda: restarts.DEFAULT_MAX_RESTARTS),
    ("docs/benchmarks.md", "{} s by default", lambda: LORA["stall_timeout"]),
    ("docs/benchmarks.md", "lora.yaml's batch {}", lambda: LORA["batch_size"]),
    ("docs/benchmarks.md", "batch {batch_size}, {num_layers} layers, LoRA rank {lora_parameters[rank]} and "
     "scale {lora_parameters[scale]:g}, learning rate {learning_rate}, seed {seed}, a report every "
     "{steps_per_report} steps", lambda: overhead.SETTINGS | {"learning_rate": sci(overhead.SETTINGS[
         "learning_rate"])}),
    ("docs/benchmarks.md", "`--max-size` (default {})", lambda: flag_default("bench.links", "max_size")
     .replace("MB", " MB")),
    ("docs/serving.md", "(`--max-file-mb`, {} by default)", lambda: flag_default("fuse", "max_file_mb")),
    ("docs/serving.md", "`--max-tokens` {} by default", lambda: flag_default("generate", "max_tokens")),
    ("bench_tasks.py", "(default: the config's, {};", lambda: LORA["iters"]),
]


def said(template: str, value: Any) -> str:
    return template.format(**value) if isinstance(value, dict) else template.format(value)


@pytest.mark.parametrize(("doc", "template", "value"), DEFAULTS_SAID, ids=[f"{d}: {t[:40]}" for d, t, _ in
                                                                           DEFAULTS_SAID])
def test_a_default_a_doc_states_is_the_codes(doc: str, template: str, value: Callable[[], Any]):
    text = " ".join((REPO / doc).read_text().split())  # a sentence wrapped over lines is one
    assert said(template, value()) in text, f"{doc} does not say: {said(template, value())}"


def test_the_overhead_benchmarks_settings_are_the_demos():
    """bench.overhead's config is lora.yaml's fine-tune (docs/benchmarks.md says it); only its
    validation is its own."""
    ours = {k: v for k, v in overhead.SETTINGS.items() if k != "val_batches"}
    assert ours == {k: LORA[k] for k in ours}


def test_bench_train_batch_is_lora_yamls():
    assert bench_tasks.train.flags.flags["batch_size"].default == LORA["batch_size"]


def test_a_doc_stating_another_default_is_caught():
    template, value = "the default is {} restarts", restarts.DEFAULT_MAX_RESTARTS
    assert said(template, value + 1) not in " ".join((REPO / "docs" / "training.md").read_text().split())
