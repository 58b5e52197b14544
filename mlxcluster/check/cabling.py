"""`invoke topology`: the Thunderbolt cabling as the Macs themselves see it, as the inventory's
`thunderbolt_links` block to paste, and drawn.

Each Mac's `system_profiler SPThunderboltDataType -json` lists its Thunderbolt ports (receptacle
n is the hardware port "Thunderbolt n", whose device `networksetup -listallhardwareports`
names, en2 say) with the domain UUID of each port and of what is plugged into it. A cable is two
ports that name each other's domain, as MLX's `mlx.distributed_config` reads them. Unlike it, this
needs no sudo and changes nothing: it only reads, and the inventory declares the result.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcluster.describe.cluster import Cluster, Node
from mlxcluster.errors import UserError, reason
from mlxcluster.launch import remote

PROFILER = "/usr/sbin/system_profiler SPThunderboltDataType -json"
HARDWARE_PORTS = "/usr/sbin/networksetup -listallhardwareports"
_SPLIT = "@@mlx-cabling@@"


@dataclass(frozen=True)
class SeenPort:
    host: str
    interface: str
    uuid: str
    peer_uuid: str | None  # the domain plugged into it, if any


def hardware_ports(text: str) -> dict[str, str]:
    """-listallhardwareports: hardware port name -> device ("Thunderbolt 1" -> "en2")."""
    found, port = {}, None
    for line in text.splitlines():
        if line.startswith("Hardware Port:"):
            port = line.split(":", 1)[1].strip()
        elif line.startswith("Device:") and port is not None:
            found[port] = line.split(":", 1)[1].strip()
            port = None
    return found


def ports_seen(host: str, profiler: Mapping[str, Any], hardware: str) -> list[SeenPort]:
    """A Mac's Thunderbolt ports with their domain and their peer's, by interface name."""
    devices = hardware_ports(hardware)
    seen = []
    for bus in profiler.get("SPThunderboltDataType", []):
        uuid = bus.get("domain_uuid_key")
        tag = (bus.get("receptacle_1_tag") or {}).get("receptacle_id_key")
        if uuid is None or tag is None:
            continue
        interface = devices.get(f"Thunderbolt {tag}")
        if interface is None:
            raise UserError(f"{host}: Thunderbolt port {tag} has no network device in "
                            "`networksetup -listallhardwareports` (is Thunderbolt networking on?)")
        plugged = [item["domain_uuid_key"] for item in bus.get("_items", []) if "domain_uuid_key" in item]
        seen.append(SeenPort(host, interface, uuid, plugged[0] if plugged else None))
    return sorted(seen, key=lambda p: p.interface)


def cables_seen(ports: Sequence[SeenPort], hosts: Sequence[str]) -> tuple[list[list[str]], list[str]]:
    """The cables between the Macs read, in the inventory's host order then port order, and a
    note for each port plugged into something that is not one of them."""
    by_uuid = {p.uuid: p for p in ports}
    rank = {h: i for i, h in enumerate(hosts)}
    links, notes, done = [], [], set()
    for port in sorted(ports, key=lambda p: (rank[p.host], p.interface)):
        if port.peer_uuid is None or port.uuid in done:
            continue
        peer = by_uuid.get(port.peer_uuid)
        if peer is None:
            notes.append(f"{port.host}:{port.interface} is plugged into a machine not in the "
                         f"inventory (Thunderbolt domain {port.peer_uuid})")
            continue
        done |= {port.uuid, peer.uuid}
        links.append([f"{port.host}:{port.interface}", f"{peer.host}:{peer.interface}"])
    return links, notes


def links_block(links: Sequence[Sequence[str]], pool: str) -> str:
    """The inventory lines to paste under `cluster: vars:`."""
    lines = ["thunderbolt_topology: links", f"thunderbolt_link_pool: {pool}  # one /30 per cable",
             "thunderbolt_links:"]
    return "\n".join(lines + [f"  - [{a}, {b}]" for a, b in links]) + "\n"


Point = tuple[float, float]


def _bend(a: Point, b: Point, offset: float) -> Callable[[float], Point]:
    """The cable from a to b as a curve bowed sideways by `offset` (a quadratic Bezier), so
    that two cables between the same Macs are drawn apart; 0 is the straight line."""
    (xa, ya), (xb, yb) = a, b
    length = math.hypot(xb - xa, yb - ya) or 1.0
    cx = (xa + xb) / 2 - (yb - ya) / length * offset * 2
    cy = (ya + yb) / 2 + (xb - xa) / length * offset * 2
    return lambda t: ((1 - t) ** 2 * xa + 2 * (1 - t) * t * cx + t ** 2 * xb,
                      (1 - t) ** 2 * ya + 2 * (1 - t) * t * cy + t ** 2 * yb)


def draw(hosts: Sequence[str], links: Sequence[Sequence[str]], path: Path) -> None:
    """The cabling as a picture: the Macs on a circle, each cable a line labelled with its ports
    (cables between the same two Macs bowed apart)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 6))
    ax = figure.add_subplot()
    where = {h: (math.cos(math.pi / 2 - 2 * math.pi * i / len(hosts)),
                 math.sin(math.pi / 2 - 2 * math.pi * i / len(hosts))) for i, h in enumerate(hosts)}
    pairs = Counter(frozenset(end.split(":")[0] for end in link) for link in links)
    drawn: Counter[frozenset[str]] = Counter()
    for a, b in links:
        (ha, pa), (hb, pb) = a.split(":"), b.split(":")
        pair = frozenset((ha, hb))
        # The same sideways direction for every cable of a pair, whichever end is listed first.
        sign = 1 if ha < hb else -1
        curve = _bend(where[ha], where[hb], sign * 0.35 * (drawn[pair] - (pairs[pair] - 1) / 2))
        drawn[pair] += 1
        xs, ys = zip(*(curve(i / 20) for i in range(21)), strict=True)
        ax.plot(xs, ys, color="tab:blue", linewidth=2, zorder=1)
        for t, label in ((0.25, pa), (0.75, pb)):
            ax.annotate(label, curve(t), ha="center", va="center", fontsize=8,
                        bbox={"boxstyle": "round", "fc": "white", "ec": "tab:blue"})
    for host, (x, y) in where.items():
        ax.annotate(host, (x, y), ha="center", va="center", fontsize=11, zorder=2,
                    bbox={"boxstyle": "round,pad=0.6", "fc": "tab:orange", "ec": "black"})
    ax.set_xlim(-1.4, 1.4)
    ax.set_ylim(-1.4, 1.4)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"Thunderbolt cabling: {len(hosts)} Macs, {len(links)} cables")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def read_mac(node: Node) -> list[SeenPort]:
    """What one Mac says about its Thunderbolt ports (two read-only commands, one ssh)."""
    text = remote.output(node, remote.ssh_command(node, f"{PROFILER} && echo {_SPLIT} && {HARDWARE_PORTS}",
                                                  connect_timeout=10), timeout=60)
    profiler, _, hardware = text.partition(_SPLIT)
    try:
        return ports_seen(node.name, json.loads(profiler), hardware)
    except ValueError as exc:
        raise UserError(f"{node.name}: system_profiler's JSON could not be read ({reason(exc)})") from None


@dataclass(frozen=True)
class Found:
    links: list[list[str]]
    notes: list[str]
    block: str


def discover(cluster: Cluster, pool: str, picture: Path) -> Found:
    """Read every Mac of `cluster`, and draw what was found into `picture`."""
    not_macs = [n.name for n in cluster.nodes if n.os_family != "Darwin"]
    if not_macs:
        raise UserError(f"invoke topology reads the cabling from macOS, and {', '.join(not_macs)} "
                        "is not a Mac (the linux group): list the cables in thunderbolt_links by hand")
    ports = [port for node in cluster.nodes for port in read_mac(node)]
    hosts = [n.name for n in cluster.nodes]
    links, notes = cables_seen(ports, hosts)
    draw(hosts, links, picture)
    return Found(links, notes, links_block(links, pool))


def run(inventory: str, output: str | None = None) -> Found:
    """invoke topology: read the inventory's Macs, print the block to paste and where the
    picture is."""
    from mlxcluster.describe.topology import DEFAULT_POOL
    from mlxcluster.paths import build_dir_for
    from mlxcluster.provision import preview

    cluster = preview.from_inventory(inventory)
    pool = next((n.thunderbolt_link_pool for n in cluster.nodes if n.thunderbolt_link_pool), DEFAULT_POOL)
    picture = Path(output) if output else build_dir_for(inventory) / "topology.png"
    found = discover(cluster, pool, picture)
    for note in found.notes:
        print(f"note: {note}")
    print(f"{len(found.links)} cable{'s' if len(found.links) != 1 else ''} between "
          f"{len(cluster.nodes)} Macs; paste under `cluster: vars:` in {inventory}:\n")
    print(found.block)
    print(f"drawn in {picture}")
    return found
