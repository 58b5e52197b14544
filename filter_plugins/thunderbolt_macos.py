"""Ansible filter of the thunderbolt role on macOS in links mode: what networksetup must change so
that each cabled Thunderbolt port has a network service of its own with its cable's /30.

macOS puts every Thunderbolt port into the "Thunderbolt Bridge" (bridge0). In links mode that
service is turned off and each port is configured alone, through a network service on its hardware
port ("Thunderbolt 1" is en2, say): one the Mac already has, else one the role creates under its
own name (`prefix` + the port, "MLX Thunderbolt en2"). Services under that name whose port is no
longer cabled are removed, as the Linux branch removes a gone cable's file. networksetup keeps all
of it across reboots.

The inputs are what three networksetup queries print: -listallhardwareports (every hardware port
and its device, with a service or not), -listnetworkserviceorder (each service's hardware port and
device) and -listallnetworkservices (a leading '*' marks a disabled service).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence
from typing import Any

from mlxcluster.check.cabling import hardware_ports as port_devices

THUNDERBOLT_PORT = re.compile(r"Thunderbolt \d+")

_ORDER_ENTRY = re.compile(r"^\((?:\d+|\*)\)\s+(?P<name>.+)\n\(Hardware Port: (?P<port>[^,]*), "
                          r"Device: (?P<device>[^)]*)\)", re.MULTILINE)


def hardware_ports(text: str) -> dict[str, str]:
    """-listallhardwareports: device -> hardware port name ("en2" -> "Thunderbolt 1")."""
    return {device: port for port, device in port_devices(text).items()}


def services(order_text: str, list_text: str) -> list[dict[str, Any]]:
    """Every network service with its hardware port, device and whether it is enabled."""
    disabled = {line[1:] for line in list_text.splitlines()[1:] if line.startswith("*")}
    return [{"name": m["name"].strip(), "port": m["port"].strip(), "device": m["device"].strip(),
             "enabled": m["name"].strip() not in disabled} for m in _ORDER_ENTRY.finditer(order_text)]


def thunderbolt_macos_links(ports: Sequence[Mapping[str, Any]], hardware_text: str, order_text: str,
                            list_text: str, bridge_service: str, prefix: str) -> dict[str, Any]:
    """What links mode changes on this Mac (`ports`: the thunderbolt_ports filter's, one per
    cable end): the ports that are not a Thunderbolt hardware port here (`missing`, with what
    the Mac has instead), whether the bridge service is to be turned off, the stale services
    of the role's to remove, and each port's service (to create or enable, or there already)
    with the netmask networksetup wants."""
    devices = hardware_ports(hardware_text)
    known = services(order_text, list_text)
    # "Thunderbolt 1".."Thunderbolt N" only, the ports system_profiler's receptacles name (as MLX
    # reads them): not the bridge, nor a Thunderbolt Ethernet adapter ("Thunderbolt Ethernet Slot 1").
    thunderbolt = {dev: port for dev, port in devices.items()
                   if THUNDERBOLT_PORT.fullmatch(port) and port != bridge_service and dev != "bridge0"}
    missing = [p["interface"] for p in ports if p["interface"] not in thunderbolt]
    planned = []
    for port in ports:
        if port["interface"] not in thunderbolt:
            continue
        own = [s for s in known if s["device"] == port["interface"]]
        # The role's own service first; else the one the Mac has; else one to create.
        chosen = next((s for s in own if s["name"] == prefix + port["interface"]), own[0] if own else None)
        planned.append({**port, "hardware_port": thunderbolt[port["interface"]],
                        "service": chosen["name"] if chosen else prefix + port["interface"],
                        "create": chosen is None, "enable": bool(chosen) and not chosen["enabled"],
                        "netmask": str(ipaddress.ip_network(f"0.0.0.0/{port['prefix']}").netmask)})
    wanted = {p["service"] for p in planned}
    bridge = next((s for s in known if s["name"] == bridge_service), None)
    return {"missing": missing,
            "thunderbolt_ports": [f"{dev} ({port})" for dev, port in sorted(thunderbolt.items())],
            "bridge_on": bool(bridge and bridge["enabled"]),
            "remove": [s["name"] for s in known if s["name"].startswith(prefix) and s["name"] not in wanted],
            "ports": planned}


def thunderbolt_rdma_devices(ibv_devices: str) -> list[str]:
    """The RDMA devices `ibv_devices` lists (rdma_en2, ...: one per Thunderbolt port once RDMA is
    enabled), as MLX's configurator reads them; none when it lists none or is missing."""
    return sorted({word for word in (ibv_devices or "").split() if word.startswith("rdma_")})


_ROUTE = re.compile(r"(\d+\.\d+\.\d+\.\d+)\s+(\d+\.\d+\.\d+\.\d+)\s+(\d+\.\d+\.\d+\.\d+)")


def thunderbolt_macos_routes(text: str | Sequence[Mapping[str, str]]) -> list[str]:
    """A service's additional routes as "destination mask gateway", sorted: from what
    `networksetup -getadditionalroutes` prints, or from a port's routes (links mode)."""
    if isinstance(text, str):
        return sorted(" ".join(m) for m in _ROUTE.findall(text))
    return sorted(f"{r['to']} 255.255.255.255 {r['via']}" for r in text)


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"thunderbolt_macos_links": thunderbolt_macos_links,
                "thunderbolt_rdma_devices": thunderbolt_rdma_devices,
                "thunderbolt_macos_routes": thunderbolt_macos_routes}
