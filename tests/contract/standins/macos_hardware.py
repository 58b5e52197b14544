"""The Mac the stand-ins pretend to be: its state when fresh, and the stand-ins of what its
hardware and OS report (macos_standin.py runs them): ``ifconfig``
(``-l`` and ``ifconfig <interface>``), ``system_profiler SPThunderboltDataType -json``,
``sw_vers``, and RDMA's ``rdma_ctl`` and ``ibv_devices``.

Each takes the tool's argv, the stand-in state and the contract root, and returns what the tool
prints; `Refused` ends the tool with a status and a message, as the real one would. Standard
library only: it runs on the lab node's /usr/bin/python3.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

State = dict[str, Any]


def fresh_state() -> State:
    services = [
        {"name": "Ethernet", "port": "Ethernet", "device": "en0", "enabled": True},
        {"name": "Wi-Fi", "port": "Wi-Fi", "device": "en1", "enabled": True},
        {"name": "Thunderbolt Bridge", "port": "Thunderbolt Bridge", "device": "bridge0",
         "enabled": True},
    ]
    for service in services:
        service["config"] = {"mode": "DHCP"}
    # Every hardware port, with a service or not: an Apple Silicon Mac's Thunderbolt ports are
    # members of the bridge and have no service of their own until one is created.
    ports = [{"port": s["port"], "device": s["device"]} for s in services]
    ports += [{"port": f"Thunderbolt {n}", "device": f"en{n + 1}"} for n in range(1, 5)]
    power = {"standby": "1", "Sleep On Power Button": "1", "hibernatefile": "/var/vm/sleepimage",
             "powernap": "1", "networkoversleep": "0", "disksleep": "10", "sleep": "1",
             "hibernatemode": "3", "ttyskeepawake": "1", "displaysleep": "10",
             "tcpkeepalive": "1", "lowpowermode": "0", "womp": "1"}
    return {
        "brew": {"installed": {}},
        "network": {"services": services, "hardware_ports": ports,
                    "mtu": {port["device"]: 1500 for port in ports}},
        # A MacBook Pro on its charger: two power sources, so `-a` matters.
        "pmset": {"system": {}, "in_use": "AC Power",
                  "sources": {"Battery Power": {**power, "displaysleep": "2"},
                              "AC Power": dict(power)}},
        "sysctl": {"iogpu.wired_limit_mb": 0, "iogpu.wired_lwm_mb": 0,
                   "iogpu.dynamic_lwm": 1},
    }


class Refused(Exception):
    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


# What `ifconfig -l` lists on an Apple Silicon Mac besides its hardware ports' devices.
OTHER_INTERFACES = ("lo0", "gif0", "stf0", "anpi0", "anpi1", "ap1", "awdl0", "llw0", "utun0")


def ifconfig(argv: list[str], state: State, root: Path) -> str:
    net = state["network"]
    devices = [p["device"] for p in net["hardware_ports"]]
    if argv == ["-l"]:
        return " ".join([*OTHER_INTERFACES[:5], *devices, *OTHER_INTERFACES[5:]])
    if len(argv) != 1 or argv[0] not in devices:
        raise Refused(f"ifconfig {' '.join(argv)}: the stand-in answers -l and `ifconfig <interface>` only")
    device = argv[0]
    service = next((s for s in net["services"] if s["device"] == device and s["enabled"]), None)
    lines = [f"{device}: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> "
             f"mtu {net['mtu'][device]}", f"\tether 36:a2:04:00:00:0{devices.index(device)}"]
    config = service["config"] if service else {"mode": "none"}
    if config["mode"] == "Manual":
        mask = "".join(f"{int(octet):02x}" for octet in config["mask"].split("."))
        lines.append(f"\tinet {config['ip']} netmask 0x{mask}")
    return "\n".join([*lines, "\tstatus: active"])


def _domain(end: str) -> str:
    """A Thunderbolt port's domain UUID, the same whichever node asks: from its cable end's name."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"mlx-contract:{end}")).upper()


def _thunderbolt_ports(state: State) -> list[dict[str, Any]]:
    return [p for p in state["network"]["hardware_ports"]
            if p["port"].startswith("Thunderbolt ") and p["device"].startswith("en")]


def system_profiler(argv: list[str], state: State, root: Path) -> str:
    """The Thunderbolt ports and what each is plugged into, as the lab cabled them: prepare.yml
    writes the lab's cables and the node's name to cabling.json (a Mac's controller knows its
    cables; a lab node learns them from the lab)."""
    if argv != ["SPThunderboltDataType", "-json"]:
        raise Refused(f"system_profiler {' '.join(argv)}: the stand-in answers "
                      "SPThunderboltDataType -json only")
    cabling = json.loads((root / "cabling.json").read_text())
    peer_of = {}
    for a, b in cabling["links"]:
        peer_of[a], peer_of[b] = b, a
    buses = []
    for port in _thunderbolt_ports(state):
        tag = port["port"].split()[-1]
        end = f"{cabling['self']}:{port['device']}"
        bus = {"_name": f"thunderboltusb4_bus_{int(tag) - 1}", "device_name_key": "Mac Studio",
               "domain_uuid_key": _domain(end), "vendor_name_key": "Apple Inc.",
               "receptacle_1_tag": {"receptacle_id_key": tag, "current_speed_key": "Up to 80 Gb/s",
                                    "receptacle_status_key": "receptacle_connected" if end in peer_of
                                    else "receptacle_no_devices_connected"}}
        if end in peer_of:
            bus["_items"] = [{"_name": "Mac Studio", "device_name_key": "Mac Studio",
                              "domain_uuid_key": _domain(peer_of[end]), "vendor_name_key": "Apple Inc.",
                              "mode_key": "thunderbolt_five"}]
        buses.append(bus)
    return json.dumps({"SPThunderboltDataType": buses}, indent=2)


def sw_vers(argv: list[str], state: State, root: Path) -> str:
    """macOS 26.2 unless the state says otherwise (a test updates one Mac)."""
    version = state.get("macos_version", "26.2")
    if argv == ["-productVersion"]:
        return version
    if not argv:
        return f"ProductName:\t\tmacOS\nProductVersion:\t\t{version}\nBuildVersion:\t\t25C56"
    raise Refused(f"sw_vers {' '.join(argv)}: the stand-in answers -productVersion only")


def rdma_ctl(argv: list[str], state: State, root: Path) -> str:
    """`rdma_ctl status` answers; `enable` and `disable` work in Recovery only, as on a Mac (a
    test stands in for Recovery with MLX_CONTRACT_RECOVERY=1)."""
    if argv == ["status"]:
        return "enabled" if state.get("rdma") else "disabled"
    if argv in (["enable"], ["disable"]):
        if os.environ.get("MLX_CONTRACT_RECOVERY") != "1":
            raise Refused("rdma_ctl: this operation is only permitted in the Recovery OS")
        state["rdma"] = argv == ["enable"]
        return ""
    raise Refused("usage: rdma_ctl [enable|disable|status]")


def ibv_devices(argv: list[str], state: State, root: Path) -> str:
    """The RDMA devices, one per Thunderbolt port once RDMA is enabled (none before), as
    Apple's TN3205 shows them."""
    lines = ["    device          \t   node GUID", "    ------          \t----------------"]
    if state.get("rdma"):
        lines += [f"    rdma_{port['device']:<12}\t{0x8096a9d9edbaac05 + (i << 56) & (2**64 - 1):016x}"
                  for i, port in enumerate(_thunderbolt_ports(state))]
    return "\n".join(lines)


READERS = {"ifconfig": ifconfig, "system_profiler": system_profiler, "sw_vers": sw_vers,
           "rdma_ctl": rdma_ctl, "ibv_devices": ibv_devices}
