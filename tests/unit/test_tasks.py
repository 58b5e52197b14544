"""tasks.py stays a table of thin wrappers: every help text written once (the options tasks share
come from SHARED_HELP), and one task per benchmark."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import tasks
from mlxcluster.jobs import flags

# The tasks, and the help of the flags they share (SHARED_HELP, beside the flags' readers).
SOURCE = Path(tasks.__file__).read_text() + "\n" + Path(flags.__file__).read_text()


def help_texts() -> list[str]:
    """Every help text in the tasks' decorators and in SHARED_HELP, as written in the source."""
    texts = []
    for node in ast.walk(ast.parse(SOURCE)):
        if isinstance(node, ast.Dict):
            texts += [v.value for v in node.values
                      if isinstance(v, ast.Constant) and isinstance(v.value, str)]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "helps":
            texts += [k.value.value for k in node.keywords if isinstance(k.value, ast.Constant)]
    return [t for t in texts if len(t) > 20]


def test_no_help_text_is_written_twice():
    assert [text for text, n in Counter(help_texts()).items() if n > 1] == []


def test_each_benchmark_is_a_task_of_its_own():
    bench = tasks.ns.collections["bench"]
    assert sorted(bench.tasks) == ["calibrate", "faults", "links", "overhead", "provision", "rehearsal",
                                   "scaling", "serve", "shares", "tensor", "train"]
    # bench.scaling's --parallel draws the same curve in each mode (issue 27's figures); a benchmark
    # of its own (shares' calibration, tensor's loss comparison) is not behind a flag.
    assert "shares" not in bench.tasks["scaling"].help
    for name in ("shares", "tensor"):
        assert not {"shares", "parallel"} & set(bench.tasks[name].help), name
