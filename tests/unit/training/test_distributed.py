"""training.distributed: telling the launchers apart, the strict start, the world size check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.unit import rings
from training import distributed as td


class FakeGroup:
    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def test_world_size_check_names_both_numbers_and_the_likely_cause():
    assert td.world_size_problem(FakeGroup(0, 2), 2) is None
    assert td.world_size_problem(FakeGroup(0, 1), None) is None

    alone = td.world_size_problem(FakeGroup(0, 1), 3)
    assert alone is not None
    assert "rank 0: MLX joined 1 process(es) but 3 were expected" in alone
    assert "MLX_MPI_LIBNAME" in alone
    fewer = td.world_size_problem(FakeGroup(1, 2), 3)
    assert fewer is not None and "rank 1: MLX joined 2 process(es) but 3" in fewer and "hostfile" in fewer
    with pytest.raises(td.DistributedError, match="but 3 were expected"):
        td.check_world_size(FakeGroup(0, 2), 3)


def test_launchers_are_told_apart_by_the_environment_they_set(tmp_path: Path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(json.dumps([["10.0.0.1:5000"], ["10.0.0.2:5000"], ["10.0.0.3:5000"]]))
    single = tmp_path / "single"
    single.write_text("\n")

    assert td.detect_launch({}) is None
    assert td.detect_launch({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "0"}) == td.Launch("mpi", 4)
    assert td.detect_launch({"MLX_RANK": "1", "MLX_HOSTFILE": str(hostfile)}) == td.Launch("ring", 3)
    assert td.detect_launch({"MLX_RANK": "0", "MLX_HOSTFILE": str(single)}) == td.Launch("ring", 1)


class FakeInit:
    def __init__(self, group: FakeGroup | None = None, error: str | None = None):
        self.group, self.error, self.calls = group, error, []

    def __call__(self, **kwargs: Any) -> FakeGroup:
        self.calls.append(kwargs)
        if self.error:
            raise RuntimeError(self.error)
        assert self.group is not None
        return self.group


def test_init_is_strict_under_a_launcher_and_checks_the_size():
    mpi = {"OMPI_COMM_WORLD_SIZE": "2"}
    init = FakeInit(FakeGroup(1, 2))
    assert td.init_distributed(mpi, 2, init=init).size() == 2
    assert init.calls == [{"strict": True, "backend": "mpi"}]

    # The launcher's own count is expected when the launch code does not say.
    with pytest.raises(
        td.DistributedError, match=r"MLX joined 1 process.* but 2 were expected \(the ranks mpi started\)"
    ):
        td.init_distributed(mpi, None, init=FakeInit(FakeGroup(0, 1)))
    with pytest.raises(
        td.DistributedError, match=r"could not join the 2 ranks mpi started: Cannot init.*libmpi"
    ):
        td.init_distributed(mpi, 2, init=FakeInit(error="Cannot initialize MPI"))


def test_without_a_launcher_a_single_process_unless_more_are_expected():
    init = FakeInit(FakeGroup(0, 1))
    assert td.init_distributed({}, None, init=init).size() == 1
    assert td.init_distributed({}, 1, init=init).size() == 1
    assert init.calls == [{}, {}]
    with pytest.raises(td.DistributedError, match=r"1 process.* but 2 were expected.*not started by mpirun"):
        td.init_distributed({}, 2, init=init)


SPREAD = """
import json

import mlx.core as mx

from training.distributed import weight_spread_across_ranks

group = mx.distributed.init(strict=True)
r = group.rank()
same = {"a": mx.array([1.0, 2.0]), "b": mx.ones((2, 2))}
apart = {"a": mx.array([1.0, 2.0 + 0.25 * r]), "b": mx.ones((2, 2)) + 0.5 * r}
print(json.dumps({"rank": r, "same": weight_spread_across_ranks(same, group),
                  "apart": weight_spread_across_ranks(apart, group)}))
"""


def test_the_weight_check_across_two_real_ranks_finds_weights_that_differ(tmp_path: Path):
    """The figure summary.json reports as max_weight_difference_across_ranks, on two ranks of MLX's
    ring backend given equal weights and weights half a unit apart."""
    import sys

    from tests.unit.training.test_finetune import run_launcher

    script = tmp_path / "spread.py"
    script.write_text(SPREAD)
    launch = rings.launch(2)
    result = run_launcher([*launch, sys.executable, str(script)], timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    found = sorted((json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")),
                   key=lambda row: row["rank"])
    assert found == [{"rank": 0, "same": 0.0, "apart": 0.5}, {"rank": 1, "same": 0.0, "apart": 0.5}]
