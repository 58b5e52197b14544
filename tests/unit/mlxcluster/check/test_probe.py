"""The probe's memory: a control group's limit over the process (a container, a systemd slice, a
lab node) is what its node has, whatever /proc/meminfo says; v1 and v2 layouts, nested limits; on a
Mac, at most what Metal lets the GPU hold."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from mlxcluster.check import probe, room

GIB = 2**30


def group(folder: Path, **files: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text + "\n")


def test_a_v1_memory_limit_and_the_one_above_it_are_read_without_the_file_cache(tmp_path):
    (tmp_path / "cgroup").write_text("5:devices:/\n4:memory:/lab/node1\n1:cpu,cpuacct:/lab/node1\n0::/\n")
    memory = tmp_path / "fs" / "memory"
    group(memory / "lab", memory_limit_in_bytes=str(4 * GIB), memory_usage_in_bytes=str(GIB))
    group(memory / "lab" / "node1", memory_limit_in_bytes=str(900 * 2**20),
          memory_usage_in_bytes=str(300 * 2**20), memory_stat=f"cache 1\ntotal_inactive_file {200 * 2**20}")
    found = probe.cgroup_memory(str(tmp_path / "cgroup"), str(tmp_path / "fs"))
    assert found == [(900 * 2**20, 800 * 2**20), (4 * GIB, 3 * GIB)]


def test_v2_reads_memory_max_and_no_limit_is_none(tmp_path):
    (tmp_path / "cgroup").write_text("0::/system.slice/job.service\n")
    group(tmp_path / "fs" / "system.slice", memory_max="max", memory_current="5")
    group(tmp_path / "fs" / "system.slice" / "job.service", memory_max=str(2 * GIB), memory_current=str(GIB),
          memory_stat="anon 1\ninactive_file 0")
    assert probe.cgroup_memory(str(tmp_path / "cgroup"), str(tmp_path / "fs")) == [(2 * GIB, GIB)]
    (tmp_path / "none").write_text("0::/\n")
    assert probe.cgroup_memory(str(tmp_path / "none"), str(tmp_path / "fs")) == []
    assert probe.cgroup_memory(str(tmp_path / "missing"), str(tmp_path / "fs")) == []


def test_the_probe_as_sent_to_a_node_reports_at_most_its_limit():
    # As `invoke doctor` runs it: the file alone on a node's python3, standard library only.
    said = subprocess.run(["python3", "-c", Path(probe.__file__).read_text().split("\ndef probe(")[0]
                           + "\nprint(memory_bytes())"], capture_output=True, text=True, check=True)
    memory = ast.literal_eval(said.stdout)
    assert 0 < memory["available"] <= memory["total"]


def test_the_venv_says_what_metal_lets_the_gpu_hold_and_none_without_metal():
    # This venv's MLX, as a node's runs it: no Metal on Linux, so no limit beside the memory's.
    found = probe.venv_versions(str(Path(sys.executable).parent.parent))
    assert "error" not in found and found["gpu_limit"] is None


def test_a_mac_gives_a_run_at_most_what_its_gpu_may_hold():
    assert room.free_memory({"available": 60 * GIB, "gpu_limit": 48 * GIB}) == 48 * GIB
    assert room.free_memory({"available": 20 * GIB, "gpu_limit": 48 * GIB}) == 20 * GIB
    assert room.free_memory({"available": 20 * GIB, "gpu_limit": None}) == 20 * GIB
    assert room.free_memory({"available": None, "gpu_limit": 48 * GIB}) is None
