"""Ansible filters for writing only what differs: the `files` list of the managed_files module,
the current lines of a blockinfile block (to skip the module where the block is already right), and
a controller path's mode (to skip a module delegated to the controller where the mode is right)."""

from __future__ import annotations

import os
import posixpath
import stat
from collections.abc import Mapping
from typing import Any

from mlxcluster.describe.known_hosts import block_of


def files_in(contents: Mapping[str, str], directory: str, mode: str = "0644") -> list[dict[str, Any]]:
    """``{{ {'hostfile': text, ...} | files_in(dir, '0644') }}``: one entry per file, in order."""
    return [{"path": posixpath.join(directory, name), "content": text, "mode": mode}
            for name, text in contents.items()]


def managed_block(text: str | None, marker: str) -> list[str] | None:
    """``{{ text | managed_block(marker) }}``: the lines of the block that ansible's blockinfile
    wrote with `marker` ({mark} = BEGIN/END), or None when the text has no such block."""
    return block_of(text or "", marker.replace("{mark}", "BEGIN"), marker.replace("{mark}", "END"))


def local_mode(path: str) -> str | None:
    """``{{ path | local_mode }}``: the mode of `path` on the controller ('0700'), None when there is
    nothing there. Read in the task's own process: a file module run there costs a second."""
    try:
        return f"{stat.S_IMODE(os.stat(path).st_mode):04o}"
    except OSError:
        return None


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"files_in": files_in, "managed_block": managed_block, "local_mode": local_mode}
