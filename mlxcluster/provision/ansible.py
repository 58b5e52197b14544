"""The ansible-playbook command lines, and what a run's recap says.

Built by plain functions so tests can assert on them. `provision` renders the controller's copy
of the hostfiles and the recorded layout into the inventory's build folder (mlxcluster/paths.py).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
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


_RECAP = re.compile(
    r"^(?P<host>\S+)\s+:\s+ok=(?P<ok>\d+)\s+changed=(?P<changed>\d+)\s+"
    r"unreachable=(?P<unreachable>\d+)\s+failed=(?P<failed>\d+)(?:\s+skipped=(?P<skipped>\d+))?",
    re.M)
# A line of the profile_tasks callback's summary: "role : Task name ------- 21.71s".
_PROFILE_LINE = re.compile(r"^(?P<task>\S.*?) -{2,} (?P<seconds>\d+(?:\.\d+)?)s$", re.M)
# Enables that summary (ansible.posix.profile_tasks) for every task of the run.
PROFILE_ENV = {"ANSIBLE_CALLBACKS_ENABLED": "ansible.posix.profile_tasks",
               "PROFILE_TASKS_TASK_OUTPUT_LIMIT": "all"}


@dataclass(frozen=True)
class TimedRun:
    seconds: float
    recap: dict[str, dict[str, int]]
    # (task, seconds), slowest first: the profile_tasks summary when PROFILE_ENV was set
    profile: list[tuple[str, float]]

    def tasks_per_host(self) -> dict[str, int]:
        """Tasks each host went through (run or skipped)."""
        return {host: c["ok"] + c["failed"] + c["skipped"] for host, c in self.recap.items()}

    def changed(self) -> int:
        return sum(c["changed"] for c in self.recap.values())


def parse_recap(output: str) -> dict[str, dict[str, int]]:
    """Per-host counters from the PLAY RECAP of an ansible-playbook run."""
    return {m["host"]: {k: int(m[k] or 0)
                        for k in ("ok", "changed", "unreachable", "failed", "skipped")}
            for m in _RECAP.finditer(output)}


def parse_profile(output: str) -> list[tuple[str, float]]:
    """The profile_tasks summary of a run: (task, seconds), slowest first (none without it)."""
    _, found, summary = output.partition("TASKS RECAP")
    if not found:
        return []
    rows = [(m["task"], float(m["seconds"])) for m in _PROFILE_LINE.finditer(summary)]
    return sorted(rows, key=lambda row: -row[1])


JSON_OUTPUT = {"ANSIBLE_STDOUT_CALLBACK": "ansible.posix.json"}


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
    """Run a playbook quietly: how long it took, its recap and profile; a UserError with its
    output's tail if it fails."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=local.tool_env(env), capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        # Run with JSON_OUTPUT, a refusal (validate.yml's) is said alone; else the output's tail.
        raise UserError(refusal(proc.stdout)
                        or f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}")
    return TimedRun(elapsed, parse_recap(proc.stdout), parse_profile(proc.stdout))
