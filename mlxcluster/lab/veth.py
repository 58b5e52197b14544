"""Point-to-point cables between lab hosts, as Thunderbolt cables join Macs: `links` mode's lab.

A cable is a veth pair straight between two hosts' namespaces, no bridge in between, each end
named like a Mac's Thunderbolt port (en2, en3, ... in the order the host's cables are made).
`invoke lab.up --nodes 3 --cables ring` cables node1-node2-node3-node1; `--cables mesh` every
two nodes. Unplugging a cable takes one end down: the other end loses its carrier, as on a Mac.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlxcluster.describe.topology import Port

KINDS = ("ring", "mesh")
FIRST_PORT = 2  # en0 and en1 are a Mac's Ethernet and Wi-Fi


def pairs(nodes: Sequence[int], kind: str) -> list[tuple[int, int]]:
    """Which nodes a `kind` cabling joins, in order (a ring of two is one cable)."""
    if kind not in KINDS:
        raise ValueError(f"--cables must be one of {', '.join(KINDS)}, not {kind!r}")
    if kind == "mesh":
        return [(a, b) for i, a in enumerate(nodes) for b in nodes[i + 1:]]
    if len(nodes) <= 2:
        return [(nodes[0], nodes[1])] if len(nodes) == 2 else []
    return [(a, nodes[(i + 1) % len(nodes)]) for i, a in enumerate(nodes)]


def cabling(nodes: Sequence[int], kind: str) -> list[tuple[Port, Port]]:
    """The cables' ports: each node's next free en<N> at each end."""
    used: dict[int, int] = {}
    cables = []
    for a, b in pairs(nodes, kind):
        ends = []
        for node in (a, b):
            used[node] = used.get(node, FIRST_PORT - 1) + 1
            ends.append(Port(f"node{node}", f"en{used[node]}"))
        cables.append((ends[0], ends[1]))
    return cables


def plug_commands(netns: dict[str, str], cables: Sequence[tuple[Port, Port]]) -> list[list[str]]:
    """The `ip` commands that make `cables` (netns: host -> its namespace): each veth end is
    created straight in its host's namespace, under its port's name, and brought up."""
    commands = []
    for a, b in cables:
        commands.append(["ip", "link", "add", a.interface, "netns", netns[a.host], "type", "veth",
                         "peer", "name", b.interface, "netns", netns[b.host]])
        commands += [["ip", "-n", netns[p.host], "link", "set", p.interface, "up"] for p in (a, b)]
    return commands


def inventory_links(cables: Sequence[tuple[Port, Port]]) -> list[list[str]]:
    """The cables as the inventory lists them (thunderbolt_links)."""
    return [[str(a), str(b)] for a, b in cables]
