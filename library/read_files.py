#!/usr/bin/python
"""Ansible module: what several paths hold, in one round trip. Changes nothing.

A role that must read five small files before deciding what to change would pay five `slurp`
or `stat` runs on every node at every run; it reads them all with this module instead, and its
writing tasks run only where what it read is not yet what it wants.
"""

from __future__ import annotations

import os
import pwd
import stat
from typing import Any

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: read_files
short_description: Read the state and the text of several paths in one module run
description:
  - For each path of I(paths) (C(~user) at its start is that account's home, from the account
    database), returns whether it exists, its kind, mode and owner, and the text of a regular
    file up to I(max_bytes). Changes nothing; runs under check mode too.
options:
  paths:
    description: The paths to read.
    type: list
    elements: str
    required: true
  without_content:
    description: Paths of I(paths) whose text is never returned (a private key), only their state.
    type: list
    elements: str
    default: []
  max_bytes:
    description: Larger files are reported without their text.
    type: int
    default: 1048576
"""

RETURN = r"""
files:
  description: One entry per path, in order, with C(path) as given and C(expanded), C(exists),
    C(kind) (C(file), C(directory), C(link), C(other)), C(mode) (e.g. C(0644)), C(owner) and
    C(content) (None for what is not a regular file, or is too large).
  type: list
  elements: dict
  returned: always
"""


def kind_of(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "directory"
    return "link" if stat.S_ISLNK(mode) else "other"


def owner_of(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def read(path: str, max_bytes: int, with_content: bool = True) -> dict[str, Any]:
    expanded = os.path.expanduser(path)
    entry: dict[str, Any] = {"path": path, "expanded": expanded, "exists": False, "kind": None,
                             "mode": None, "owner": None, "content": None}
    try:
        info = os.stat(expanded)
    except OSError:  # missing, or not ours to see: either way nothing to read
        return entry
    entry.update(exists=True, kind=kind_of(info.st_mode), mode=f"{stat.S_IMODE(info.st_mode):04o}",
                 owner=owner_of(info.st_uid))
    if with_content and entry["kind"] == "file" and info.st_size <= max_bytes:
        try:
            with open(expanded, encoding="utf-8", errors="replace") as handle:
                entry["content"] = handle.read()
        except OSError:
            pass
    return entry


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "paths": {"type": "list", "elements": "str", "required": True},
            "without_content": {"type": "list", "elements": "str", "default": []},
            "max_bytes": {"type": "int", "default": 1048576},
        },
        supports_check_mode=True,
    )
    params = module.params
    files = [read(path, params["max_bytes"], path not in params["without_content"])
             for path in params["paths"]]
    module.exit_json(changed=False, files=files)


if __name__ == "__main__":
    main()
