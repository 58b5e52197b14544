"""The ansible-playbook command lines, and what a run's recap says.

Built by plain functions so tests can assert on them. `provision` renders the controller's copy
of the hostfiles and the recorded layout into the inventory's build folder (mlxcluster/paths.py).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from mlxcluster import local
from mlxcluster.errors import UserError
from mlxcluster.paths import REPO, build_dir_for


def ansible_playbook(playbook: str, inventory: str | Path, *,
                     extra_vars: Mapping[str, str] | None = None,
                     check: bool = False, diff: bool = False,
                     tags: str | None = None, limit: str | None = None,
                     verbose: int = 0) -> list[str]:
    """The ansible-playbook command line for ``playbook`` on ``inventory``."""
    cmd = ["ansible-playbook", "-i", str(inventory), str(playbook)]
    for key, value in (extra_vars or {}).items():
        cmd += ["-e", f"{key}={value}"]
    if check:
        cmd.append("--check")
    if diff:
        cmd.append("--diff")
    if tags:
        cmd += ["--tags", tags]
    if limit:
        cmd += ["--limit", limit]
    if verbose:
        cmd.append("-" + "v" * verbose)
    return cmd


def provision(inventory: str | Path, **kwargs: object) -> list[str]:
    """``site.yml`` on the inventory, rendering the controller files into its build folder."""
    extra = {"hostfile_build_dir": str(build_dir_for(inventory))}
    return ansible_playbook(str(REPO / "site.yml"), inventory, extra_vars=extra,
                            **kwargs)  # type: ignore[arg-type]


def render_hostfiles(inventory: str | Path, output: str | Path, *,
                     plan: str | Path | None = None) -> list[str]:
    """Render the MPI hostfile and MLX hosts.json into ``output``, touching no host; with
    ``plan``, also the layout the inventory alone gives (mlxcluster/provision/preview.py) into that file."""
    extra = {"hostfile_build_dir": str(Path(output).resolve())}
    if plan:
        extra["hostfile_plan_path"] = str(Path(plan).resolve())
    return ansible_playbook(str(REPO / "playbooks" / "render.yml"), inventory, extra_vars=extra)


# ansible.posix.json: the whole run as one JSON document (each task's hosts' results and its
# start and end, the stats per host). The one way this project reads what a run did: the tests,
# the benches and the preview alike.
JSON_OUTPUT = {"ANSIBLE_STDOUT_CALLBACK": "ansible.posix.json"}


class UnreadableRecap(UserError):
    """A run whose JSON document cannot be read: it has no changes, stats or failures to offer (an
    idempotence check that read such a run as "changed 0" would pass whatever the run did)."""


def json_document(stdout: str) -> dict[str, Any] | None:
    """The document ansible.posix.json printed (anything before it skipped); None when there is
    none to read."""
    try:
        document = json.loads(stdout[stdout.index("{"):])
    except ValueError:
        return None
    return document if isinstance(document, dict) else None


def task_results(document: Mapping[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(host, task name, result) of every task of every play in a JSON document, in run order."""
    for play in document.get("plays", []):
        for task in play.get("tasks", []):
            for host, result in task.get("hosts", {}).items():
                yield host, task["task"]["name"], result


def _seconds(duration: Mapping[str, str]) -> float:
    """A task's time from the callback's start and end ("2026-11-27T20:05:48.123456Z")."""
    if "end" not in duration:
        return 0.0  # a task with no result yet (the run stopped in it)
    start, end = (datetime.fromisoformat(duration[k].rstrip("Z")) for k in ("start", "end"))
    return (end - start).total_seconds()


@dataclass(frozen=True)
class Recap:
    """What one ansible-playbook run did, read from its JSON document (JSON_OUTPUT)."""

    document: Mapping[str, Any]

    @classmethod
    def read(cls, stdout: str, stderr: str = "") -> Recap:
        """The run's recap, or an UnreadableRecap that shows the output's tail."""
        document = json_document(stdout)
        if document is None or not isinstance(document.get("stats"), dict):
            raise UnreadableRecap("ansible-playbook's JSON recap could not be read (was it run with "
                                  f"ansible.JSON_OUTPUT?):\n{stdout[-1500:]}\n{stderr[-1500:]}")
        return cls(document)

    @property
    def stats(self) -> dict[str, dict[str, int]]:
        """host -> its counters as Ansible keeps them (ok, changed, unreachable, failures, skipped,
        rescued, ignored)."""
        return {host: dict(counters) for host, counters in self.document["stats"].items()}

    def results(self) -> Iterator[tuple[str, str, dict[str, Any]]]:
        return task_results(self.document)

    def changed(self) -> int:
        """Changes summed over the hosts."""
        return sum(c["changed"] for c in self.stats.values())

    def tasks_per_host(self) -> dict[str, int]:
        """Tasks each host went through (run or skipped)."""
        return {host: c["ok"] + c["failures"] + c["skipped"] for host, c in self.stats.items()}

    @property
    def changed_tasks(self) -> dict[str, list[str]]:
        """host -> names of the tasks that reported `changed`."""
        found: dict[str, list[str]] = {}
        for host, name, result in self.results():
            if result.get("changed"):
                found.setdefault(host, []).append(name)
        return found

    @property
    def failures(self) -> dict[str, list[str]]:
        """host -> messages of failed/unreachable results."""
        found: dict[str, list[str]] = {}
        for host, _, result in self.results():
            if result.get("failed") or result.get("unreachable"):
                found.setdefault(host, []).append(str(result.get("msg", "")))
        return found

    @property
    def profile(self) -> list[tuple[str, float]]:
        """(task, seconds) of the run, slowest first; a role's task is named "role : Task"."""
        spent: dict[str, float] = {}
        for play in self.document.get("plays", []):
            for task in play.get("tasks", []):
                name = task["task"]["name"]
                spent[name] = spent.get(name, 0.0) + _seconds(task["task"].get("duration", {}))
        return sorted(((name, round(seconds, 3)) for name, seconds in spent.items()), key=lambda row: -row[1])


@dataclass(frozen=True)
class TimedRun:
    seconds: float
    recap: Recap


def refusal(stdout: str) -> str | None:
    """What the failed tasks of a run said (ansible.posix.json's output), one message per line
    with no Ansible around it: validate.yml's list of an inventory's problems, say. None when
    the output cannot be read or no task failed."""
    said: list[str] = []
    for _, _, result in task_results(json_document(stdout) or {}):
        if result.get("failed") or result.get("unreachable"):
            msg: Any = result.get("msg", "")
            for line in msg if isinstance(msg, list) else [msg]:
                if str(line) not in said:
                    said.append(str(line))
    return "\n".join(said) or None


def timed_run(cmd: list[str], env: Mapping[str, str] | None = None) -> TimedRun:
    """Run a playbook quietly: how long it took and its recap; a UserError with what failed if it
    fails, an UnreadableRecap if what it did cannot be read."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=local.tool_env({**(env or {}), **JSON_OUTPUT}),
                          capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        # A refusal (validate.yml's) is said alone; else the output's tail.
        raise UserError(refusal(proc.stdout)
                        or f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}")
    return TimedRun(elapsed, Recap.read(proc.stdout, proc.stderr))
