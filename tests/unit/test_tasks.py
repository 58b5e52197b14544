"""tasks.py (and bench_tasks.py beside it) stays a table of thin wrappers: every help text written
once (the options tasks share come from SHARED), a flag's default said once (its `Flag`, whose help
says it), one task per benchmark, and within its lines."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import bench_tasks
import tasks
from mlxcluster.jobs import flags
from training.data.formats import FORMAT_KEYS

REPO = Path(__file__).resolve().parents[2]
# The tasks, and the help of the flags they share (SHARED, beside the flags' readers).
FILES = [Path(tasks.__file__), Path(bench_tasks.__file__), Path(flags.__file__)]
SOURCE = "\n".join(file.read_text() for file in FILES)
# What makes a Flag, its help first.
FLAG_MAKERS = {"Flag", "whole", "wholes", "real", "choice", "several"}
# The most lines each file of tasks may have: past it, a group of tasks goes to a file of its own.
MAX_LINES = {"tasks.py": 350, "bench_tasks.py": 250}


def help_texts(source: str = SOURCE) -> list[str]:
    """Every help text in the tasks' decorators, their Flags and SHARED, as written in the source."""
    texts = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            texts += [v.value for v in node.values
                      if isinstance(v, ast.Constant) and isinstance(v.value, str)]
        elif isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if name in ("helps", "Flags"):
                texts += [k.value.value for k in node.keywords if isinstance(k.value, ast.Constant)]
            elif name in FLAG_MAKERS and node.args and isinstance(node.args[0], ast.Constant):
                texts.append(node.args[0].value)
    return [t for t in texts if isinstance(t, str) and len(t) > 20]


def every_task() -> list[tuple[str, flags.Task]]:
    def walk(collection, prefix=""):
        for name, task in collection.tasks.items():
            yield prefix + name, task
        for name, sub in collection.collections.items():
            yield from walk(sub, f"{prefix}{name}.")
    return sorted(walk(tasks.ns))


def test_the_help_texts_are_found_where_they_are_written():
    """A change of how tasks say their help that hid it from help_texts would pass the test below."""
    found = help_texts()
    assert "Steps between checkpoints (default {default})" in found  # a Flag's, in bench_tasks.py
    assert any(t.startswith("GLOBAL batch size") for t in found)  # a Flag's, in tasks.py
    assert SOURCE.count("Lab number (default {default})") == 1 and "Lab number (default {default})" in found
    assert len(found) > 80


def test_no_help_text_is_written_twice():
    assert [text for text, n in Counter(help_texts()).items() if n > 1] == []


def test_a_repeated_help_text_is_found():
    twice = 'Flags(a=whole("Steps of each run, said twice here"), b="Steps of each run, said twice here")'
    assert Counter(help_texts(twice))["Steps of each run, said twice here"] == 2


def test_each_benchmark_is_a_task_of_its_own():
    bench = tasks.ns.collections["bench"]
    assert sorted(bench.tasks) == ["calibrate", "faults", "links", "overhead", "pipeline", "plan",
                                   "provision", "rehearsal", "scaling", "serve", "shares", "tensor", "train"]
    # bench.scaling's --parallel draws the same curve in each mode (issue 27's figures); a benchmark
    # of its own (shares' calibration, tensor's loss comparison) is not behind a flag.
    assert "shares" not in bench.tasks["scaling"].flags.flags
    for name in ("shares", "tensor"):
        assert not {"shares", "parallel"} & set(bench.tasks[name].flags.flags), name


@pytest.mark.parametrize("name", sorted(MAX_LINES))
def test_each_file_of_tasks_stays_within_its_lines(name: str):
    lines = len((REPO / name).read_text().splitlines())
    assert lines <= MAX_LINES[name], f"{name}: {lines} lines, more than {MAX_LINES[name]}"


@pytest.mark.parametrize(("name", "task"), every_task(), ids=[name for name, _ in every_task()])
def test_a_flags_default_is_said_once_in_its_flag_and_its_help_says_it(name: str, task: flags.Task):
    """A flag its Flag reads or gives a default to is None in the task's signature (else invoke
    would hand over its own default, or cast the value with a traceback), and the help of a flag with
    a default shows it from the Flag itself ({default}), so the two cannot disagree."""
    signature = inspect.signature(task.body).parameters
    for flag_name, flag in task.flags.flags.items():
        if flag.read is not None or flag.default is not None:
            assert signature[flag_name].default in (None, inspect.Parameter.empty), (name, flag_name)
        if flag.default not in (None, ()) and not isinstance(flag.default, tuple):
            assert "{default}" in flag.help, (name, flag_name, flag.help)


def test_data_prepare_names_every_input_format_it_reads():
    said = tasks.ns["data.prepare"].flags.help["input"]  # (invoke's task.help empties as it parses)
    assert [f for f in FORMAT_KEYS if f not in said] == [], said
    assert len(FORMAT_KEYS) == 5  # chat, completions, alpaca, dolly, text: training/data/formats.py


@pytest.mark.parametrize(("name", "task"), every_task(), ids=[name for name, _ in every_task()])
def test_every_short_flag_is_a_letter_or_none(name: str, task: flags.Task):
    """invoke gives a flag whose letters are all taken the dash in its name (`--=STRING, --min-nodes`
    in the help): a Task keeps letters only."""
    for argument in task.get_arguments():
        assert all(len(n) > 1 or n.isalnum() for n in argument.names), (name, argument.names)


def test_the_tasks_load_without_mlx_lm_transformers_or_the_trackers():
    """Every invoke command imports tasks.py: mlx-lm, transformers, wandb and swanlab took 5 s of
    each one's start (doctor, a dry run, run), for rules only a tensor-parallel plan needs."""
    probe = ("import sys, tasks; print(' '.join(sorted({m.split('.')[0] for m in sys.modules} "
             "& {'mlx_lm', 'transformers', 'wandb', 'swanlab', 'torch'})))")
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                            check=True)
    assert loaded.stdout.split() == []
