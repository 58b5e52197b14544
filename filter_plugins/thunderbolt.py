"""Ansible filters of the thunderbolt role on Linux: what ip(8) changes on a node (its ports up, their
MTU and addresses, a port's stale addresses, the pool's addresses off the cables and the host routes
to add or remove in links mode), and the files that keep every port's address across reboots."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from typing import Any

NETWORKD_DIR = "/etc/systemd/network"
NM_DIR = "/etc/NetworkManager/system-connections"


def connection_name(port: Mapping[str, Any]) -> str:
    """The port's name in NetworkManager (and its networkd file): the bridge's one port keeps the
    name it always had, a cable's port is named after its interface."""
    return "mlx-thunderbolt" + (f"-{port['interface']}" if port.get("cable") else "")


def thunderbolt_stale_addresses(ports: Sequence[Mapping[str, Any]],
                                now: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each port's own address under another prefix (`now`: ip -j addr by interface)."""
    return [{"interface": port["interface"], "local": info["local"], "prefixlen": info["prefixlen"]}
            for port in ports for info in now.get(port["interface"], {}).get("addr_info", [])
            if info.get("family") == "inet" and info.get("local") == port["address"]
            and info.get("prefixlen") != port["prefix"]]


def thunderbolt_persist_files(ports: Sequence[Mapping[str, Any]], rendered: Mapping[str, str],
                              backend: str, existing: Sequence[str]) -> list[dict[str, Any]]:
    """managed_files' list: each port's file for `backend` (networkd or networkmanager) with its
    `rendered` content, and every other file of the role's (`existing`) removed: another
    manager's, a cable's that is gone, the bridge's after a move to links."""
    files: list[dict[str, Any]] = []
    for port in ports:
        name = connection_name(port)
        if backend == "networkd":
            files.append({"path": f"{NETWORKD_DIR}/50-{name}.network", "mode": "0644",
                          "content": rendered[port["interface"]]})
        else:
            files.append({"path": f"{NM_DIR}/{name}.nmconnection", "owner": "root", "group": "root",
                          "mode": "0600", "content": rendered[port["interface"]]})
    wanted = {f["path"] for f in files}
    return files + [{"path": path, "state": "absent"} for path in existing if path not in wanted]


def thunderbolt_ping_targets(ports: Sequence[Mapping[str, Any]], host: str,
                             in_play: Sequence[str]) -> list[dict[str, str]]:
    """What this node pings after configuring: each peer still in the play, across each port,
    with how a silence is named (the cable in links mode, the pair of nodes on a bridge)."""
    return [{"address": address,
             "label": port["cable"] or f"{host} -> {peer} ({address})"}
            for port in ports for peer, address in port["peers"].items() if peer in in_play]


def thunderbolt_stray_addresses(ports: Sequence[Mapping[str, Any]],
                                addresses: Sequence[Mapping[str, Any]],
                                keep: str | None = None) -> list[dict[str, Any]]:
    """Addresses inside the link pool (links mode) on interfaces that are not this node's cable
    ports: a bridge's from before a move to links, a port no longer cabled. The pool belongs to
    the cables, and Open MPI, pinned to it, would offer a peer such an address that no cable
    reaches. Loopback and `keep` (the address Ansible reaches the node at) stay."""
    pools = {ipaddress.IPv4Network(port["pool"]) for port in ports if port.get("pool")}
    mine = {port["interface"] for port in ports}
    return [{"interface": link["ifname"], "local": info["local"], "prefixlen": info["prefixlen"]}
            for link in addresses if link.get("ifname") not in mine and link.get("link_type") != "loopback"
            for info in link.get("addr_info", [])
            if info.get("family") == "inet" and info.get("local") != keep
            and any(ipaddress.IPv4Address(info["local"]) in pool for pool in pools)]


def _routes(ports: Sequence[Mapping[str, Any]]) -> set[tuple[str, str, str]]:
    return {(r["to"], r["via"], port["interface"]) for port in ports for r in port.get("routes", [])}


def _host_routes(now: Sequence[Mapping[str, Any]]) -> set[tuple[str, str, str]]:
    """`ip -j -4 route show`'s routes to one address through a gateway, as (to, via, dev)."""
    return {(r["dst"], r["gateway"], r["dev"]) for r in now
            if "gateway" in r and "/" not in r.get("dst", "/") and r.get("dst") != "default"}


def thunderbolt_missing_routes(ports: Sequence[Mapping[str, Any]],
                               now: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """The ports' host routes (links mode) the node does not have yet."""
    return [{"to": to, "via": via, "interface": dev}
            for to, via, dev in sorted(_routes(ports) - _host_routes(now))]


def thunderbolt_stale_routes(ports: Sequence[Mapping[str, Any]],
                             now: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Host routes through a gateway on one of the ports that no cable wants (a cable gone)."""
    mine = {port["interface"] for port in ports if port.get("cable")}
    return [{"to": to, "via": via, "interface": dev}
            for to, via, dev in sorted(_host_routes(now) - _routes(ports)) if dev in mine]


def thunderbolt_ip_commands(ports: Sequence[Mapping[str, Any]], addresses: Sequence[Mapping[str, Any]],
                            routes_now: Sequence[Mapping[str, Any]], mtu: int | str,
                            keep: str | None = None) -> list[dict[str, Any]]:
    """What ip(8) must change on this node for its ports, in the order it must be done (`addresses`:
    ip -j addr show, `routes_now`: ip -j -4 route show), each as {argv, label}; none on a node
    already configured. One list for one looped task: a converged node skips one task, not seven.

    In order: each port up; its MTU (not on loopback, the embedded single-machine inventory, whose
    MTU is its own); its own address under an outdated prefix removed, and the link pool's
    addresses off the cable ports (links mode); its address added; the host routes across each
    cable to a neighbour's other addresses put in place, and the ones no cable wants removed."""
    now = {link["ifname"]: link for link in addresses}

    def has_address(port: Mapping[str, Any]) -> bool:
        return any(info.get("family") == "inet" and info.get("local") == port["address"]
                   and info.get("prefixlen") == port["prefix"]
                   for info in now.get(port["interface"], {}).get("addr_info", []))

    commands: list[dict[str, Any]] = []
    for port in ports:
        if "UP" not in now.get(port["interface"], {}).get("flags", []):
            commands.append({"argv": ["ip", "link", "set", "dev", port["interface"], "up"],
                             "label": f"{port['interface']}: up"})
    for port in ports:
        link = now.get(port["interface"], {})
        if link.get("link_type") != "loopback" and int(link.get("mtu", 0)) != int(mtu):
            commands.append({"argv": ["ip", "link", "set", "dev", port["interface"], "mtu", str(mtu)],
                             "label": f"{port['interface']}: mtu {mtu}"})
    for gone in [*thunderbolt_stale_addresses(ports, now),
                 *thunderbolt_stray_addresses(ports, addresses, keep)]:
        address = f"{gone['local']}/{gone['prefixlen']}"
        commands.append({"argv": ["ip", "addr", "del", address, "dev", gone["interface"]],
                         "label": f"{gone['interface']}: remove {address}"})
    for port in ports:
        if not has_address(port):
            address = f"{port['address']}/{port['prefix']}"
            commands.append({"argv": ["ip", "addr", "add", address, "dev", port["interface"]],
                             "label": f"{port['interface']}: add {address}"})
    for verb, routes in (("replace", thunderbolt_missing_routes(ports, routes_now)),
                         ("del", thunderbolt_stale_routes(ports, routes_now))):
        for route in routes:
            commands.append({"argv": ["ip", "route", verb, f"{route['to']}/32", "via", route["via"],
                                      "dev", route["interface"]],
                             "label": f"{route['interface']}: route {verb} {route['to']} via {route['via']}"})
    return commands


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"thunderbolt_persist_files": thunderbolt_persist_files,
                "thunderbolt_connection_name": connection_name,
                "thunderbolt_ping_targets": thunderbolt_ping_targets,
                "thunderbolt_ip_commands": thunderbolt_ip_commands}
