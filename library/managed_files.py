#!/usr/bin/python
"""Ansible module: several small files in their wanted state, in one round trip.

`template` and `copy` cost two module runs per file even when nothing changes (a remote stat,
then `file` for the attributes), and a directory for the file is one more task. A converged
cluster re-runs every one of them, so the roles write their small generated files (hostfiles,
env.sh, network configuration) with this module instead: one run compares all of them and
writes only what differs, atomically, with Ansible's own helpers for the move and the attributes.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: managed_files
short_description: Put several small files in their wanted state in one module run
description:
  - Each entry of I(files) is a file with its whole I(content) and I(mode), or (I(state=absent))
    a file that must not exist. A file is rewritten only when its content differs, by writing a
    temporary file next to it and renaming it over the old one; its mode, owner and group are set
    only when they differ. Missing parent directories are made with I(directory_mode).
  - Supports check mode and diff mode, so C(--check --diff) shows every change without making it.
options:
  files:
    description: The files, each a dict with C(path), C(content), C(mode), and optionally
      C(owner), C(group) and C(state) (C(present), the default, or C(absent)).
    type: list
    elements: dict
    required: true
  directory_mode:
    description: Mode of the parent directories the module makes.
    type: str
    default: "0755"
"""

RETURN = r"""
changed_paths:
  description: The paths written, re-moded or removed (or that would be, under check mode).
  type: list
  elements: str
  returned: always
"""

FILE_SPEC = {
    "path": {"type": "path", "required": True},
    "content": {"type": "str"},
    "mode": {"type": "raw"},
    "owner": {"type": "str"},
    "group": {"type": "str"},
    "state": {"type": "str", "choices": ["present", "absent"], "default": "present"},
}


def current_text(path: str) -> str | None:
    """The file's text, or None when there is no file."""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as handle:
            return handle.read()
    except FileNotFoundError:
        return None


def make_parents(module: AnsibleModule, path: str) -> None:
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        os.makedirs(parent, mode=int(module.params["directory_mode"], 8), exist_ok=True)


def write_atomically(module: AnsibleModule, path: str, content: str) -> None:
    make_parents(module, path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f".{os.path.basename(path)}.")
    with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as handle:
        handle.write(content)
    # atomic_move keeps the old file's attributes (and SELinux context) when there is one.
    module.atomic_move(tmp, path, unsafe_writes=False)


def apply(module: AnsibleModule, entry: dict[str, Any], diffs: list[dict[str, str]]) -> bool:
    """Bring one file to its wanted state; True when it changed (or would, under check mode)."""
    path = entry["path"]
    before = current_text(path)
    if entry["state"] == "absent":
        if before is None:
            return False
        diffs.append({"before_header": path, "after_header": path, "before": before, "after": ""})
        if not module.check_mode:
            os.remove(path)
        return True
    if entry["content"] is None:
        module.fail_json(msg=f"managed_files: {path} has no content (give content, or state: absent)")
    changed = before != entry["content"]
    if changed:
        diffs.append({"before_header": path, "after_header": path, "before": before or "",
                      "after": entry["content"]})
        if not module.check_mode:
            write_atomically(module, path, entry["content"])
    if before is None and module.check_mode:
        return True  # no file to compare attributes with
    attributes = module.load_file_common_arguments(
        {"mode": entry["mode"], "owner": entry["owner"], "group": entry["group"]}, path=path)
    return module.set_fs_attributes_if_different(attributes, changed)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "files": {"type": "list", "elements": "dict", "required": True, "options": FILE_SPEC},
            "directory_mode": {"type": "str", "default": "0755"},
        },
        supports_check_mode=True,
    )
    diffs: list[dict[str, str]] = []
    changed_paths = [entry["path"] for entry in module.params["files"] if apply(module, entry, diffs)]
    module.exit_json(changed=bool(changed_paths), changed_paths=changed_paths, diff=diffs)


if __name__ == "__main__":
    main()
