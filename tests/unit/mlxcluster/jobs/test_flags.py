"""invoke's flag values (text, as invoke hands them over) read by mlxcluster/jobs/flags.py: a value that
cannot be read is refused in one line naming the flag and the value, never a traceback, and before
the task does anything."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from invoke.config import Config
from invoke.context import Context
from invoke.exceptions import Exit

from mlxcluster.errors import UserError
from mlxcluster.jobs import flags

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
import bench_tasks  # the bench.* tasks, beside tasks.py
import tasks  # the repository's tasks.py, as invoke loads it


def test_whole_numbers_numbers_choices_and_interfaces_are_read_or_refused_in_one_line():
    assert flags.whole_number("8", "--iters") == 8 and flags.whole_number(None, "--iters") is None
    for bad in ("many", "-1", "0", "1.5", "٣", "9" * 5000, " ", "1e3", True):
        with pytest.raises(UserError, match=r"--iters .*: give a whole number") as refused:
            flags.whole_number(bad, "--iters")
        assert "\n" not in str(refused.value)
    assert flags.whole_numbers("2,4,8", "--nodes", 1, 9) == [2, 4, 8]
    assert flags.whole_numbers("", "--nodes") is None
    for bad in ("2,,4", "2,10", "two", ",", "4,"):
        with pytest.raises(UserError, match=r"--nodes .*: give whole numbers from 1 to 9, separated by"):
            flags.whole_numbers(bad, "--nodes", 1, 9)
    assert flags.number("0.25", "--cpu", 0, 1) == 0.25
    for bad in ("nan", "inf", "-1", "2", "x"):
        with pytest.raises(UserError, match="give a number from 0 to 1"):
            flags.number(bad, "--cpu", 0, 1)
    assert flags.one_of("tensor", "--parallel", ("data", "tensor")) == "tensor"
    with pytest.raises(UserError, match="--parallel 'pipeline': give one of data, tensor"):
        flags.one_of("pipeline", "--parallel", ("data", "tensor"))
    assert flags.interface("bridge0") == "bridge0" and flags.interface("192.168.200.0/24,en2") is not None
    for bad in ("en0;reboot", "a b", "x" * 16, "$(id)"):
        with pytest.raises(UserError, match="give an interface name"):
            flags.interface(bad)
    with pytest.raises(UserError, match=r"is an address; give its network, e\.g\. 10\.0\.0\.1/24"):
        flags.interface("10.0.0.1")


@pytest.mark.parametrize(("task", "given", "says"), [
    (tasks.generate, {"prompt": "hi", "max_tokens": "many"}, "--max-tokens 'many'"),
    (tasks.data_prepare, {"valid_fraction": "lots"}, "--valid-fraction 'lots'"),
    (tasks.data_prepare, {"seed": "-1"}, "--seed '-1'"),
    (tasks.lab_status, {"id": "x"}, "--id 'x'"),
    (tasks.lab_up, {"nodes": "99"}, "--nodes '99': give a whole number from 1 to 9"),
    (bench_tasks.provision, {"nodes": "three"}, "--nodes 'three'"),
    (bench_tasks.provision, {"nodes": "2,4,99"}, "--nodes '2,4,99'"),
    (bench_tasks.provision, {"cables": "star"}, "--cables 'star': give one of ring, mesh"),
    (bench_tasks.train, {"rounds": "0"}, "--rounds '0'"),
    (tasks.lab_limit, {"node": "2", "cpu": "fast"}, "--cpu 'fast'"),
])
def test_every_tasks_number_flags_are_refused_in_one_line_before_it_acts(task, given, says):
    config = Config()
    config.load_collection(tasks.ns.configuration())  # the project's defaults, as invoke loads them
    with pytest.raises(Exit) as refused:
        task(Context(config), **given)
    assert says in str(refused.value.message) and "\n" not in str(refused.value.message)


def test_a_flag_not_given_is_its_default_and_a_given_zero_stays_zero():
    """bench.provision --id 0 is lab 0 (it was lab 8 when the default came after `or`)."""
    read = bench_tasks.provision.flags.read
    assert read({"nodes": None, "id": "0", "cables": None}) == {"nodes": [3], "id": 0, "cables": None}
    assert read({"id": None})["id"] == 8 and read({})["nodes"] == [3]
    assert tasks.ns["bench.faults"].flags.help["nodes"] == "Lab hosts (default 3)"
