"""Every copy of a plan as rsync 2.6.9 (what macOS ships) makes it: remote paths go through the
remote shell unescaped, so a space or `$(...)` in one would split it or run.

Stand-ins, named as such: `ssh` below runs the remote command with `sh -c` on this machine, as
sshd runs it with the login shell, and RSYNC_OLD_ARGS=1 makes this rsync pass remote paths the
way 2.6.9 did (rsync's documented --old-args). The first test checks the stand-ins reproduce the
hazard the issue saw; the others run a real plan's copies through them.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from mlxcluster.describe.cluster import Cluster, Node
from mlxcluster.describe.inventory import cluster_root_error
from mlxcluster.jobs import train as training
from mlxcluster.jobs.request import Request
from mlxcluster.launch import remote
from training.model.manifest import write_manifest

SSH_STANDIN = """#!/bin/sh
# ssh stand-in: skip the options, drop the destination, run the rest as sshd would.
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-i|-p|-l|-F) shift 2 ;;
    -*) shift ;;
    *) shift; break ;;
  esac
done
exec sh -c "$*"
"""


@pytest.fixture
def old_rsync(tmp_path: Path) -> dict[str, str]:
    """The environment in which rsync and ssh behave as from a Mac to a node."""
    bin_dir = tmp_path / "standin-bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(SSH_STANDIN)
    (bin_dir / "ssh").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RSYNC_OLD_ARGS": "1"}


def files_under(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_standins_split_a_remote_path_with_a_space_as_old_rsync_did(tmp_path, old_rsync):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a").write_text("new")
    (tmp_path / "my").mkdir()
    (tmp_path / "my" / "keep").write_text("a sibling's file")
    subprocess.run(["rsync", "-a", "--delete", "-e", "ssh", f"{tmp_path / 'src'}/",
                    f"node:{tmp_path / 'my root'}/"], env=old_rsync, check=True, capture_output=True)
    # The path split at the space: the sibling folder `my` got the copy, and lost its own file.
    assert files_under(tmp_path / "my") == {"a": "new"}
    # Which is why such a cluster_root is refused before anything is copied.
    assert cluster_root_error("node", str(tmp_path / "my root"))
    assert cluster_root_error("node", f"{tmp_path}/$(touch pwned)")


def node_layout(root: Path) -> dict:
    return {"launcher": "node1", "nodes": [{
        "name": "node1", "thunderbolt_ip": "10.78.5.11", "slots": 1, "cluster_root": str(root),
        "venv": f"{root}/venv", "env_file": f"{root}/env.sh", "openmpi_prefix": "/usr",
        "connection": {"type": "ssh", "host": "node1.invalid", "user": "mlx"}}]}


def test_every_copy_of_a_plan_lands_where_planned_with_old_rsync(tmp_path, old_rsync, monkeypatch):
    root = tmp_path / "node" / "mlx-cluster"
    assert cluster_root_error("node1", str(root)) is None
    inputs = tmp_path / "controller"
    for name, content in (("pirate/train.jsonl", "rows"), ("pirate/valid.jsonl", "rows"),
                          ("tiny-model/config.json", "{}"), ("tiny-model/model.safetensors", "w"),
                          ("tiny-model/tokenizer.json", "{}"), ("my.yaml", "iters: 5\n"),
                          ("runs/r1/checkpoints/0000010/state.json", "{}")):
        (inputs / name).parent.mkdir(parents=True, exist_ok=True)
        (inputs / name).write_text(content)
    write_manifest(inputs / "tiny-model", source="tiny")
    monkeypatch.setattr(training, "RUNS", inputs / "runs")
    request = Request(inputs / "pirate", inputs / "tiny-model", inputs / "my.yaml",
                      interactive=False)
    the_plan = training.plan(Cluster.from_json(node_layout(root)), request, run_id="r1", resume=True)
    copies = [cmd for label, cmd in the_plan.steps if not label.startswith("verify") and cmd]
    assert len(copies) == 5  # code, data, config, the model, the checkpoints
    for cmd in copies:
        subprocess.run(cmd, env=old_rsync, check=True, capture_output=True)
    landed = files_under(root)
    assert landed["work/data/pirate/train.jsonl"] == "rows"
    assert landed["models/tiny-model/config.json"] == "{}"
    assert landed["work/config/my.yaml"] == "iters: 5\n"
    assert landed["runs/r1/checkpoints/0000010/state.json"] == "{}"
    assert "work/training/finetune.py" in landed
    # Nothing landed beside the node's root, and the launch names the paths the copies made.
    assert sorted(p.name for p in (tmp_path / "node").iterdir()) == ["mlx-cluster"]
    for path in (f"{root}/models/tiny-model", f"{root}/work/data/pirate", f"{root}/work/config/my.yaml"):
        assert path in the_plan.launch[-1]

    # The results come back the same way.
    (root / "runs" / "r1" / "adapters.safetensors").write_text("weights")
    subprocess.run(the_plan.pull, env=old_rsync, check=True, capture_output=True)
    assert (inputs / "runs" / "r1" / "adapters.safetensors").read_text() == "weights"


def a_node(tmp_path: Path) -> Node:
    return Cluster.from_json(node_layout(tmp_path / "node")).node("node1")


def copy_to(node: Node, src: Path, dest: str, env: dict[str, str], cwd: Path) -> None:
    subprocess.run(["rsync", "-a", "-e", "ssh", f"{src}/", remote.remote_path(node, dest)],
                   env=env, cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def source(tmp_path: Path) -> Path:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a").write_text("new")
    return tmp_path / "src"


def test_old_rsync_gets_remote_paths_quoted_and_they_land_whole(tmp_path, source, old_rsync,
                                                                monkeypatch):
    monkeypatch.setenv("RSYNC_OLD_ARGS", "1")
    assert remote.rsync_passes_old_args()
    node = a_node(tmp_path)
    copy_to(node, source, f"{tmp_path}/my root/", old_rsync, cwd=tmp_path)
    assert files_under(tmp_path / "my root") == {"a": "new"}
    assert not (tmp_path / "my").exists()

    copy_to(node, source, f"{tmp_path}/$(touch pwned)/", old_rsync, cwd=tmp_path)
    assert files_under(tmp_path / "$(touch pwned)") == {"a": "new"}
    assert not list(tmp_path.rglob("pwned"))


def test_new_rsync_gets_remote_paths_as_they_are_and_they_land_whole(tmp_path, source, old_rsync,
                                                                     monkeypatch):
    monkeypatch.delenv("RSYNC_OLD_ARGS", raising=False)
    new_rsync = {k: v for k, v in old_rsync.items() if k != "RSYNC_OLD_ARGS"}
    node = a_node(tmp_path)
    copy_to(node, source, f"{tmp_path}/my root/", new_rsync, cwd=tmp_path)
    # Escaped once, by rsync: no folder named with quotes, nothing split off.
    assert files_under(tmp_path / "my root") == {"a": "new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my root", "src", "standin-bin"]


@pytest.mark.parametrize(("output", "version"), [
    ("rsync  version 2.6.9  protocol version 29\nCopyright (C) 1996-2006", (2, 6, 9)),
    ("rsync  version 3.2.7  protocol version 31\nCopyright (C) 1996-2022", (3, 2, 7)),
    ("rsync  version v3.2.3  protocol version 31\n", (3, 2, 3)),
    ("openrsync: protocol version 29\nrsync version 2.6.9 compatible\n", (2, 6, 9)),
    ("usage: rsync [OPTION]...", None),
])
def test_rsync_version_is_read_from_its_version_output(output, version):
    assert remote.rsync_version(output) == version


@pytest.mark.parametrize(("version", "old_args", "quoted"), [
    ((2, 6, 9), None, True),
    ((3, 2, 3), None, True),
    ((3, 2, 4), None, False),
    ((3, 2, 7), "1", True),
    ((3, 2, 7), "0", False),  # rsync reads the variable as a number
    (None, None, False),  # no rsync here: taken as new
])
def test_remote_paths_are_quoted_exactly_when_the_local_rsync_passes_old_args(
        tmp_path, monkeypatch, version, old_args, quoted):
    monkeypatch.setattr(remote, "local_rsync_version", lambda: version)
    if old_args is None:
        monkeypatch.delenv("RSYNC_OLD_ARGS", raising=False)
    else:
        monkeypatch.setenv("RSYNC_OLD_ARGS", old_args)
    node = a_node(tmp_path)
    assert remote.remote_path(node, "/srv/my root/") == (
        "mlx@node1.invalid:'/srv/my root/'" if quoted else "mlx@node1.invalid:/srv/my root/")
    # A plain path reads the same either way.
    assert remote.remote_path(node, "/srv/mlx-cluster/") == "mlx@node1.invalid:/srv/mlx-cluster/"


def test_no_rsync_installed_is_taken_as_a_new_one(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert remote.local_rsync_version.__wrapped__() is None
