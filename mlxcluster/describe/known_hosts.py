"""The ssh_mesh role's managed known_hosts block: every node's host key under each of its names,
and which of the nodes' keys an authorized_keys file still lacks.

One block written in one task replaces a known_hosts task per name and node (12 on three nodes,
the slowest part of an idempotent re-run). A node that is not in this run (down, or outside
--limit) keeps the lines the last run pinned for it, so that it is trusted again as soon as it is
back, and so that the block does not change when a node is merely away.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

# The key types OpenSSH accepts in authorized_keys (ssh-ed25519, ecdsa-sha2-nistp256,
# sk-ssh-ed25519@openssh.com, ssh-rsa...): what follows options and precedes the base64 blob.
KEY_TYPE = re.compile(r"^(ssh-[a-z0-9-]+|ecdsa-sha2-[a-z0-9-]+|sk-[a-z0-9@.-]+)$")


def block_of(text: str, begin: str, end: str) -> list[str] | None:
    """The lines between the markers of a block blockinfile wrote in a file's text; None when the
    text has no such block (an empty block is [])."""
    lines = text.splitlines()
    if begin not in lines or end not in lines[lines.index(begin):]:
        return None
    start = lines.index(begin) + 1
    return lines[start:start + lines[start:].index(end)]


def block_lines(text: str, begin: str, end: str) -> list[str]:
    """The lines between the markers of the managed block of a file's text (none if absent)."""
    return block_of(text, begin, end) or []


def _kept_for(names: Iterable[str], previous: Sequence[str], claimed: set[str]) -> list[str]:
    """The previous lines of a node known only by `names`: those that name it, and those with
    the host key they pin (its other names), minus names a node in this run claims now."""
    names = {name.lower() for name in names}
    keys = {tuple(line.split()[1:3]) for line in previous if line.split()[0] in names}
    return [line for line in previous
            if (line.split()[0] in names or tuple(line.split()[1:3]) in keys)
            and line.split()[0] not in claimed]


def pinned(hosts: Sequence[str], fresh: Mapping[str, Sequence[str]],
           away: Mapping[str, Iterable[str]], previous: Sequence[str]) -> list[str]:
    """The block's lines in inventory order: `fresh[host]` (sorted) for the nodes of this run,
    and for a node `away` (its inventory names) the lines the previous block had for it."""
    previous = [line for line in previous if len(line.split()) >= 3]
    claimed = {line.split()[0] for lines in fresh.values() for line in lines}
    out: list[str] = []
    for host in hosts:
        if host in fresh:
            out += sorted(fresh[host])  # the names come from sets: a fixed order
        elif host in away:
            out += [line for line in _kept_for(away[host], previous, claimed) if line not in out]
    return out


def key_identity(line: str) -> tuple[str, str] | None:
    """(type, base64) of an authorized_keys or public key line, past any options; None if none."""
    words = line.split()
    for i, word in enumerate(words[:-1]):
        if KEY_TYPE.match(word):
            return word, words[i + 1]
    return None


def missing_keys(keys: Iterable[str], authorized: str) -> list[str]:
    """The public keys (`type base64 comment`) that the authorized_keys text does not hold yet,
    whatever options or comments its lines carry: the ones ansible's authorized_key would add."""
    held = {key_identity(line) for line in authorized.splitlines()
            if line.strip() and not line.lstrip().startswith("#")}
    return [key for key in keys if key_identity(key) not in held]
