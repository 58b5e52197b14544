"""Lab node limits (mlxcluster/lab/limits.py): the control group files written for a CPU quota and a
memory limit, in both cgroup layouts, and lifted again. (tests/cluster/test_train.py slows a real lab
node down with them.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxcluster.lab import limits


def v1(root: Path) -> Path:
    for controller in ("cpu", "memory"):
        (root / controller).mkdir(parents=True)
        (root / controller / "cgroup.procs").write_text("")
    return root


def test_v1_gets_a_cfs_quota_and_a_memory_limit_without_swap(tmp_path):
    root = v1(tmp_path)
    written = limits.limit(3, 2, "no-such-netns", cpu_percent=30, memory_bytes=2**30, root=root)
    cpu, memory = root / "cpu" / "mlx-lab3-node2", root / "memory" / "mlx-lab3-node2"
    assert written == [cpu, memory]
    assert (cpu / "cpu.cfs_quota_us").read_text() == "30000"
    assert (cpu / "cpu.cfs_period_us").read_text() == "100000"
    assert (memory / "memory.limit_in_bytes").read_text() == str(2**30)
    assert (memory / "memory.swappiness").read_text() == "0"


def test_v2_gets_cpu_max_and_memory_max_in_one_group(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    limits.limit(3, 2, "no-such-netns", cpu_percent=150, memory_bytes=2**29, root=tmp_path)
    group = tmp_path / "mlx-lab3-node2"
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu +memory"
    assert (group / "cpu.max").read_text() == "150000 100000"
    assert (group / "memory.max").read_text() == str(2**29)
    assert (group / "memory.swap.max").read_text() == "0"


def test_limits_are_lifted_and_bad_ones_refused(tmp_path):
    root = v1(tmp_path)
    limits.limit(3, 2, "no-such-netns", cpu_percent=30, root=root)
    # A real group is an empty folder to the kernel; here it holds the files written above.
    for f in (root / "cpu" / "mlx-lab3-node2").iterdir():
        f.unlink()
    limits.clear(3, 2, root=root)
    assert not (root / "cpu" / "mlx-lab3-node2").exists()
    with pytest.raises(limits.LimitError, match="a percent of one core"):
        limits.limit(3, 2, "no-such-netns", cpu_percent=0, root=root)
    with pytest.raises(limits.LimitError, match="no cgroup cpu and memory controllers"):
        limits.layout(tmp_path / "nothing")


@pytest.mark.parametrize(("text", "expected"), [("800M", 800 * 2**20), ("1.5GB", 3 * 2**29),
                                                ("2GiB", 2**31), ("1048576", 2**20)])
def test_memory_sizes_are_read_in_binary_units(text, expected):
    assert limits.parse_memory(text) == expected


def test_a_memory_size_that_is_not_one_says_how_to_write_it():
    with pytest.raises(limits.LimitError, match="give a size like 800MB"):
        limits.parse_memory("lots")


def test_a_v1_limit_raised_writes_memory_and_swap_first(tmp_path, monkeypatch):
    root = v1(tmp_path)
    folder = root / "memory" / "mlx-lab3-node2"
    folder.mkdir()
    for name in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"):
        (folder / name).write_text(str(2**29))
    order = []
    real_write = limits._write
    monkeypatch.setattr(limits, "_write",
                        lambda path, value: (order.append(path.name), real_write(path, value)))
    # The kernel refuses a memory limit above the memory + swap one.
    limits.limit(3, 2, "no-such-netns", memory_bytes=2**30, root=root)
    assert order[:2] == ["memory.memsw.limit_in_bytes", "memory.limit_in_bytes"]
    order.clear()
    limits.limit(3, 2, "no-such-netns", memory_bytes=2**28, root=root)  # lowered: memory first
    assert order[:2] == ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
