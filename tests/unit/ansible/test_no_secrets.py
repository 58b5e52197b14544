"""Provisioning keeps no secret of the controller's environment: over a local connection (the
embedded default inventory) Ansible's `env` facts are this machine's own environment, HF_TOKEN
and all, and the fact cache (ansible.cfg) would keep them in plain text. Every play gathers
without them; the canary run proves that nothing a run writes holds them."""

from __future__ import annotations

import secrets
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from mlxcluster import paths
from mlxcluster.provision import ansible

REPO = Path(__file__).resolve().parents[3]
IMPORTS = ("import_playbook", "ansible.builtin.import_playbook")
SETUP = ("setup", "ansible.builtin.setup", "ansible.legacy.setup",
         "gather_facts", "ansible.builtin.gather_facts")
FALSE = (False, "false", "False", "no", "No", "0", 0)


def plays_of(playbook: Path, seen: set[Path] | None = None) -> Iterator[tuple[str, dict]]:
    """Every play of a playbook, through its imports, with where it comes from."""
    seen = set() if seen is None else seen
    if playbook in seen:
        return
    seen.add(playbook)
    for entry in yaml.safe_load(playbook.read_text()) or []:
        imported = next((entry[key] for key in IMPORTS if key in entry), None)
        if imported is not None:
            yield from plays_of((playbook.parent / imported).resolve(), seen)
        else:
            yield f"{playbook.relative_to(REPO)}: {entry.get('name', entry.get('hosts'))}", entry


def subset_of(value: str | list[str] | None) -> list[str]:
    """A gather_subset keyword as a list (Ansible also takes a comma-separated string)."""
    if value is None:
        return ["all"]  # Ansible's default, which includes env
    items = value.split(",") if isinstance(value, str) else value
    return [str(item).strip() for item in items]


def gathers_environment(subset: list[str]) -> bool:
    """Whether facts gathered with this subset hold `env` (the `min` subset has it)."""
    return "!env" not in subset or "env" in subset


ALL_PLAYS = dict(plays_of(REPO / "site.yml"))
for _playbook in sorted((REPO / "playbooks").glob("*.yml")):
    ALL_PLAYS.update(plays_of(_playbook.resolve()))


def test_the_plays_are_found():
    assert len(ALL_PLAYS) >= 10 and all("hosts" in play for play in ALL_PLAYS.values())


@pytest.mark.parametrize("where", sorted(ALL_PLAYS))
def test_no_play_gathers_the_environment(where):
    play = ALL_PLAYS[where]
    if play.get("gather_facts", True) in FALSE:  # Ansible gathers unless told not to
        return
    subset = subset_of(play.get("gather_subset"))
    assert not gathers_environment(subset), (
        f"{where} gathers facts with the `env` subset: add gather_subset: [all, \"!env\"]")
    # Exclusions alone gather only the `min` subset: facts the roles read would be missing.
    assert subset[0] == "all", f"{where}: gather_subset must start with `all`, e.g. [all, \"!env\"]"


def tasks_in(node: object) -> Iterator[dict]:
    """Every mapping in a list of tasks, those in blocks included."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from tasks_in(value)
    elif isinstance(node, list):
        for item in node:
            yield from tasks_in(item)


def test_no_task_gathers_the_environment():
    sections = [play.get(key) for play in ALL_PLAYS.values()
                for key in ("pre_tasks", "tasks", "post_tasks", "handlers")]
    for path in (*REPO.glob("roles/*/tasks/*.yml"), *REPO.glob("roles/*/handlers/*.yml")):
        sections.append(yaml.safe_load(path.read_text()))
    found = []
    for task in tasks_in(sections):
        for key in SETUP:
            args = task.get(key) if isinstance(task.get(key), dict) else task.get("args") or {}
            if key in task and gathers_environment(subset_of(args.get("gather_subset"))):
                found.append(task.get("name", key))
    assert not found, f"tasks that gather the `env` facts: {found}"


# --- the canary: a real provisioning run on this machine ----------------------------------------


@pytest.fixture
def local_inventory(tmp_path: Path) -> Iterator[Path]:
    """The embedded default inventory (this machine, ansible_connection: local) with its
    cluster_root under tmp_path, in a folder of a unique name: the run's build folder is
    build/<that name>, removed afterwards."""
    inventory = yaml.safe_load((REPO / "inventory" / "local" / "hosts.yml").read_text())
    inventory["cluster"]["vars"] = {"cluster_root": str(tmp_path / "root")}
    path = tmp_path / f"nosecrets-{secrets.token_hex(4)}" / "hosts.yml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(inventory))
    build = paths.build_dir_for(path)
    assert not build.exists()
    yield path
    shutil.rmtree(build, ignore_errors=True)


def test_a_provisioning_run_on_a_local_connection_writes_no_secret_of_the_environment(
        local_inventory, tmp_path, tool_env):
    canaries = {"HF_TOKEN": f"hf_canary_{secrets.token_hex(12)}",
                "MY_SECRET_CANARY": f"canary_{secrets.token_hex(12)}"}
    facts = tmp_path / "facts"
    # ansible.cfg's fact cache (jsonfile), in a folder of the test's own.
    env = {key: value for key, value in tool_env.items()
           if key != "ANSIBLE_CONFIG" and not key.startswith("ANSIBLE_CACHE_PLUGIN")}
    env |= {**canaries, "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(facts)}
    # `invoke provision --tags hostfile`: validate, base (gathers facts), the hostfiles, the record.
    proc = subprocess.run(ansible.provision(local_inventory, tags="hostfile"), cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]

    build = paths.build_dir_for(local_inventory)
    cached = [path for path in facts.rglob("*") if path.is_file()]
    # Not vacuous: facts were gathered and cached, the files were written.
    assert cached and all(b"ansible_os_family" in path.read_bytes() for path in cached)
    assert (build / "cluster.json").is_file() and (tmp_path / "root" / "hostfile").is_file()
    written = [path for folder in (facts, tmp_path / "root", build)
               for path in folder.rglob("*") if path.is_file()]
    leaks = [f"{path} holds {name}" for path in written for name, value in canaries.items()
             if value.encode() in path.read_bytes()]
    assert not leaks, leaks
    mode = stat.S_IMODE(facts.stat().st_mode)
    assert mode == 0o700, f"the fact cache folder is open to others: mode {mode:o}"
