"""Fixtures for tests on a lab cluster: real Debian hosts in network namespaces."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mlxcluster import ansible, lab, local

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
# Tests use their own lab number, so a developer's lab 0 is never touched.
TEST_LAB_ID = int(os.environ.get("MLX_TEST_LAB_ID", "5"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if os.geteuid() != 0:
        skip = pytest.mark.skip(reason="lab-cluster tests need root (network namespaces)")
        for item in items:
            if "cluster" in item.keywords:
                item.add_marker(skip)


@dataclass
class PlaybookRun:
    returncode: int
    stdout: str
    stderr: str
    # host -> counters from the run's stats
    stats: dict[str, dict[str, int]] = field(default_factory=dict)
    # host -> names of the tasks that reported `changed`
    changed: dict[str, list[str]] = field(default_factory=dict)
    # host -> messages of failed/unreachable results
    failures: dict[str, list[str]] = field(default_factory=dict)


@dataclass
class LabCluster:
    lab: lab.Lab
    inventory: Path
    facts_dir: Path

    def env(self) -> dict[str, str]:
        return local.tool_env({**lab.ansible_env(self.facts_dir),
                               "ANSIBLE_STDOUT_CALLBACK": "ansible.posix.json"})

    def playbook(self, *args: str, inventory: Path | None = None,
                 check: bool = False) -> PlaybookRun:
        """Run site.yml (or args) and digest its JSON output."""
        cmd = ansible.provision(inventory or self.inventory, check=check)
        cmd += list(args)
        proc = subprocess.run(cmd, cwd=REPO, env=self.env(), capture_output=True, text=True)
        run = PlaybookRun(proc.returncode, proc.stdout, proc.stderr)
        try:
            report = json.loads(proc.stdout[proc.stdout.index("{"):])
        except ValueError:
            return run
        run.stats = report.get("stats", {})
        for play in report.get("plays", []):
            for task in play.get("tasks", []):
                for host, result in task.get("hosts", {}).items():
                    if result.get("changed"):
                        run.changed.setdefault(host, []).append(task["task"]["name"])
                    if result.get("failed") or result.get("unreachable"):
                        run.failures.setdefault(host, []).append(str(result.get("msg", "")))
        return run

    def ssh(self, node: int, command: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run a command on a lab node as root over its management link."""
        return subprocess.run(
            ["ssh", "-i", str(self.lab.key), "-o", f"UserKnownHostsFile={self.lab.known_hosts}",
             "-o", "BatchMode=yes", f"root@{self.lab.mgmt_ip(node)}", command],
            capture_output=True, text=True, timeout=timeout)


@contextmanager
def fresh_lab(tmp_path_factory: pytest.TempPathFactory, nodes: int) -> Iterator[LabCluster]:
    """A lab cluster of `nodes` fresh hosts with its own fact cache, torn down afterwards."""
    facts = tmp_path_factory.mktemp("facts")
    try:
        with lab.fresh(nodes, TEST_LAB_ID) as inventory:
            yield LabCluster(lab.Lab(TEST_LAB_ID), inventory, facts)
    finally:
        shutil.rmtree(facts, ignore_errors=True)


@pytest.fixture(scope="module")
def lab_cluster(tmp_path_factory: pytest.TempPathFactory):
    """A fresh 3-node lab cluster for the module; torn down afterwards."""
    with fresh_lab(tmp_path_factory, 3) as cluster:
        yield cluster
