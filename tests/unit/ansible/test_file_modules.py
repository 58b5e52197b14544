"""The repo's own Ansible modules for small files (library/): managed_files writes several in one
round trip, read_files reads several. Run as Ansible runs them: a Python process given its args."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from filter_plugins.managed_files import files_in, local_mode, managed_block

LIBRARY = Path(__file__).resolve().parents[3] / "library"


def run_module(name: str, tmp_path: Path, check: bool = False, diff: bool = False,
               **args: Any) -> dict[str, Any]:
    params = dict(args, _ansible_check_mode=check, _ansible_diff=diff)
    args_file = tmp_path / f"{name}-args.json"
    args_file.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": params}))
    proc = subprocess.run([sys.executable, str(LIBRARY / f"{name}.py"), str(args_file)],
                          capture_output=True, text=True, check=False)
    result = json.loads(proc.stdout)
    assert proc.returncode == 0 or result.get("failed"), proc.stderr
    return result


def mode_of(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_managed_files_writes_every_file_and_its_directories_then_changes_nothing(tmp_path):
    files = [{"path": str(tmp_path / "a" / "b" / "hostfile"), "content": "10.0.0.1 slots=1\n",
              "mode": "0644"},
             {"path": str(tmp_path / "a" / "env.sh"), "content": "export X=1\n", "mode": "0600"}]
    first = run_module("managed_files", tmp_path, files=files)
    assert first["changed"] and first["changed_paths"] == [f["path"] for f in files]
    assert (tmp_path / "a" / "b" / "hostfile").read_text() == "10.0.0.1 slots=1\n"
    assert mode_of(tmp_path / "a" / "b" / "hostfile") == 0o644
    assert mode_of(tmp_path / "a" / "env.sh") == 0o600
    assert mode_of(tmp_path / "a" / "b") == 0o755
    again = run_module("managed_files", tmp_path, files=files)
    assert not again["changed"] and again["changed_paths"] == []


def test_managed_files_rewrites_only_what_differs_by_replacing_the_file(tmp_path):
    same, other = tmp_path / "same", tmp_path / "other"
    same.write_text("kept\n")
    other.write_text("old\n")
    same.chmod(0o644)
    other.chmod(0o644)
    inodes = same.stat().st_ino, other.stat().st_ino
    result = run_module("managed_files", tmp_path, files=[
        {"path": str(same), "content": "kept\n", "mode": "0644"},
        {"path": str(other), "content": "new\n", "mode": "0644"}])
    assert result["changed_paths"] == [str(other)]
    assert same.stat().st_ino == inodes[0]
    assert other.read_text() == "new\n" and other.stat().st_ino != inodes[1]  # renamed over
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".json")) == ["other", "same"]


def test_managed_files_fixes_a_mode_and_removes_absent_files(tmp_path):
    kept, gone = tmp_path / "kept", tmp_path / "gone"
    kept.write_text("x")
    kept.chmod(0o666)
    gone.write_text("y")
    result = run_module("managed_files", tmp_path, files=[
        {"path": str(kept), "content": "x", "mode": "0644"},
        {"path": str(gone), "state": "absent"},
        {"path": str(tmp_path / "never"), "state": "absent"}])
    assert result["changed_paths"] == [str(kept), str(gone)]
    assert mode_of(kept) == 0o644 and kept.read_text() == "x"
    assert not gone.exists()


def test_managed_files_under_check_reports_and_changes_nothing(tmp_path):
    old = tmp_path / "old"
    old.write_text("before\n")
    result = run_module("managed_files", tmp_path, check=True, diff=True, files=[
        {"path": str(old), "content": "after\n", "mode": "0644"},
        {"path": str(tmp_path / "new" / "file"), "content": "x", "mode": "0644"}])
    assert result["changed"] and len(result["changed_paths"]) == 2
    assert old.read_text() == "before\n" and not (tmp_path / "new").exists()
    assert {"before": "before\n", "after": "after\n"}.items() <= result["diff"][0].items()


def test_managed_files_says_which_file_has_no_content(tmp_path):
    result = run_module("managed_files", tmp_path, files=[{"path": str(tmp_path / "x"), "mode": "0644"}])
    assert result["failed"] and str(tmp_path / "x") in result["msg"] and "content" in result["msg"]


def test_read_files_reads_text_and_state_and_keeps_private_files_private(tmp_path):
    public, private = tmp_path / "id.pub", tmp_path / "id"
    public.write_text("ssh-ed25519 AAAA me\n")
    private.write_text("SECRET")
    private.chmod(0o600)
    user = pwd.getpwuid(os.getuid()).pw_name
    result = run_module("read_files", tmp_path, check=True, without_content=[str(private)],
                        paths=[str(public), str(private), str(tmp_path / "missing"), str(tmp_path),
                               f"~{user}"])
    pub, priv, missing, folder, home = result["files"]
    assert not result["changed"]
    assert pub["content"] == "ssh-ed25519 AAAA me\n" and pub["kind"] == "file"
    assert priv["exists"] and priv["mode"] == "0600" and priv["content"] is None
    assert "SECRET" not in json.dumps(result)
    assert missing["exists"] is False and missing["content"] is None
    assert folder["kind"] == "directory" and folder["content"] is None
    assert home["expanded"] == pwd.getpwnam(user).pw_dir and home["path"] == f"~{user}"


def test_read_files_leaves_an_unknown_account_unexpanded(tmp_path):
    result = run_module("read_files", tmp_path, paths=["~no-such-user-here/.ssh"])
    assert result["files"][0]["expanded"] == "~no-such-user-here/.ssh"
    assert result["files"][0]["exists"] is False


def test_files_in_lists_the_named_contents_under_one_directory():
    assert files_in({"hostfile": "a", "hosts.json": "{}"}, "/opt/c") == [
        {"path": "/opt/c/hostfile", "content": "a", "mode": "0644"},
        {"path": "/opt/c/hosts.json", "content": "{}", "mode": "0644"}]


@pytest.mark.parametrize(("text", "lines"), [
    ("x\n# BEGIN m\n1.2.3.4 node1\n# END m\ny\n", ["1.2.3.4 node1"]),
    ("# BEGIN m\n# END m\n", []),
    ("x\n", None),
    (None, None),
    ("# BEGIN m\n1.2.3.4 node1\n", None),  # no end marker: not a block blockinfile wrote
])
def test_managed_block_reads_the_block_blockinfile_wrote(text, lines):
    assert managed_block(text, "# {mark} m") == lines


def test_local_mode_says_a_controller_path_s_mode_or_none_where_there_is_nothing(tmp_path):
    """What skips base.yml's fact cache task where the folder is private already."""
    folder = tmp_path / "facts"
    assert local_mode(str(folder)) is None
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    assert local_mode(str(folder)) == "0755"
    folder.chmod(0o700)
    assert local_mode(str(folder)) == "0700"
