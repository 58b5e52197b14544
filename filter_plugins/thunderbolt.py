"""Ansible filters of the thunderbolt role on Linux: a port's stale addresses and the files that
keep every port's address across reboots."""

from __future__ import annotations

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


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"thunderbolt_stale_addresses": thunderbolt_stale_addresses,
                "thunderbolt_persist_files": thunderbolt_persist_files,
                "thunderbolt_connection_name": connection_name,
                "thunderbolt_ping_targets": thunderbolt_ping_targets}
