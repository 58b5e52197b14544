"""links mode on a Mac: what the thunderbolt role's networksetup plan (filter_plugins/
thunderbolt_macos.py) makes of the three queries' output, in the format macOS prints."""

from __future__ import annotations

import pytest

from filter_plugins.thunderbolt_macos import (
    hardware_ports,
    services,
    thunderbolt_macos_links,
    thunderbolt_rdma_devices,
)
from mlxcluster.describe import addresses

HARDWARE = """
Hardware Port: Ethernet
Device: en0
Ethernet Address: 36:a2:04:00:00:00

Hardware Port: Wi-Fi
Device: en1
Ethernet Address: 36:a2:04:00:00:01

Hardware Port: Thunderbolt Bridge
Device: bridge0
Ethernet Address: 36:a2:04:00:00:02

Hardware Port: Thunderbolt 1
Device: en2
Ethernet Address: 36:a2:04:00:00:03

Hardware Port: Thunderbolt 2
Device: en3
Ethernet Address: 36:a2:04:00:00:04

VLAN Configurations
===================
"""


def order(*entries: tuple[str, str, str, bool]) -> tuple[str, str]:
    """-listnetworkserviceorder and -listallnetworkservices for services (name, port, device,
    enabled)."""
    lines = ["An asterisk (*) denotes that a network service is disabled."]
    names = [lines[0]]
    for i, (name, port, device, enabled) in enumerate(entries, 1):
        lines += [f"({i if enabled else '*'}) {name}", f"(Hardware Port: {port}, Device: {device})", ""]
        names.append(("" if enabled else "*") + name)
    return "\n".join(lines), "\n".join(names)


BASE = [("Ethernet", "Ethernet", "en0", True), ("Wi-Fi", "Wi-Fi", "en1", True)]
BRIDGE_ON = ("Thunderbolt Bridge", "Thunderbolt Bridge", "bridge0", True)
LINKS = [["mac1:en2", "mac2:en2"], ["mac2:en3", "mac3:en2"], ["mac3:en3", "mac1:en3"]]
HOSTS = ["mac1", "mac2", "mac3"]


def ports(host: str) -> list[dict]:
    view = {h: {"thunderbolt_links": LINKS, "thunderbolt_link_pool": "192.168.200.0/24"} for h in HOSTS}
    return addresses.ports_of(host, HOSTS, view)


def plan(host: str, *entries, prefix: str = "MLX Thunderbolt ") -> dict:
    order_text, list_text = order(*entries)
    return thunderbolt_macos_links(ports(host), HARDWARE, order_text, list_text, "Thunderbolt Bridge", prefix)


def test_the_queries_are_read_as_macos_prints_them():
    assert hardware_ports(HARDWARE) == {"en0": "Ethernet", "en1": "Wi-Fi", "bridge0": "Thunderbolt Bridge",
                                        "en2": "Thunderbolt 1", "en3": "Thunderbolt 2"}
    order_text, list_text = order(*BASE, ("Thunderbolt Bridge", "Thunderbolt Bridge", "bridge0", False))
    assert services(order_text, list_text)[2] == {"name": "Thunderbolt Bridge", "port": "Thunderbolt Bridge",
                                                 "device": "bridge0", "enabled": False}


def test_a_fresh_mac_turns_the_bridge_off_and_gets_a_service_per_cabled_port():
    found = plan("mac2", *BASE, BRIDGE_ON)
    assert found["missing"] == [] and found["remove"] == []
    assert found["bridge_on"] is True
    assert [(p["interface"], p["service"], p["hardware_port"], p["create"], p["address"], p["netmask"])
            for p in found["ports"]] == [
        ("en2", "MLX Thunderbolt en2", "Thunderbolt 1", True, "192.168.200.2", "255.255.255.252"),
        ("en3", "MLX Thunderbolt en3", "Thunderbolt 2", True, "192.168.200.5", "255.255.255.252")]
    assert [p["cable"] for p in found["ports"]] == ["mac1:en2 <-> mac2:en2", "mac2:en3 <-> mac3:en2"]


def test_a_configured_mac_changes_nothing_and_keeps_a_service_the_user_made():
    found = plan("mac1", *BASE, ("Thunderbolt Bridge", "Thunderbolt Bridge", "bridge0", False),
                 ("MLX Thunderbolt en2", "Thunderbolt 1", "en2", True),
                 ("My TB 2", "Thunderbolt 2", "en3", True))
    assert found["bridge_on"] is False and found["remove"] == []
    assert [(p["service"], p["create"], p["enable"]) for p in found["ports"]] == [
        ("MLX Thunderbolt en2", False, False), ("My TB 2", False, False)]


def test_a_disabled_service_is_enabled_and_a_gone_cables_service_removed():
    found = plan("mac3", *BASE, BRIDGE_ON, ("MLX Thunderbolt en2", "Thunderbolt 1", "en2", False),
                 ("MLX Thunderbolt en4", "Thunderbolt 3", "en4", True),
                 ("Thunderbolt 4 by hand", "Thunderbolt 4", "en5", True))
    assert [(p["service"], p["create"], p["enable"]) for p in found["ports"]] == [
        ("MLX Thunderbolt en2", False, True), ("MLX Thunderbolt en3", True, False)]
    # Only the role's own services are ever removed.
    assert found["remove"] == ["MLX Thunderbolt en4"]


# An Ethernet adapter on a Thunderbolt port is listed as "Thunderbolt Ethernet Slot 1": a cable
# between Macs is never on it, any more than on the Mac's own Ethernet.
ADAPTER = HARDWARE + "\nHardware Port: Thunderbolt Ethernet Slot 1\nDevice: en9\nEthernet Address: x\n"


@pytest.mark.parametrize(("port", "hardware"), [("en0", HARDWARE), ("en9", ADAPTER)])
def test_a_port_that_is_not_a_thunderbolt_port_is_named_with_what_the_mac_has(port, hardware):
    links = [[f"mac1:{port}", "mac2:en2"]]
    view = {h: {"thunderbolt_links": links, "thunderbolt_link_pool": "192.168.200.0/24"} for h in HOSTS[:2]}
    order_text, list_text = order(*BASE, BRIDGE_ON)
    found = thunderbolt_macos_links(addresses.ports_of("mac1", HOSTS[:2], view), hardware, order_text,
                                    list_text, "Thunderbolt Bridge", "MLX Thunderbolt ")
    assert found["missing"] == [port]
    assert found["thunderbolt_ports"] == ["en2 (Thunderbolt 1)", "en3 (Thunderbolt 2)"]
    assert found["ports"] == []


def test_the_rdma_devices_are_read_from_ibv_devices_as_mlx_reads_them():
    # As MLX's jaccl README shows it, on a Mac with RDMA enabled.
    listed = ("    device          \t   node GUID\n    ------          \t----------------\n"
              "    rdma_en2        \t8096a9d9edbaac05\n    rdma_en3        \t8196a9d9edbaac05\n"
              "    rdma_en5        \t8396a9d9edbaac05\n")
    assert thunderbolt_rdma_devices(listed) == ["rdma_en2", "rdma_en3", "rdma_en5"]
    assert thunderbolt_rdma_devices("    device          \t   node GUID\n    ------\n") == []
    assert thunderbolt_rdma_devices("") == [] and thunderbolt_rdma_devices(None) == []


def test_a_services_additional_routes_compare_with_the_ports_whatever_their_order():
    from filter_plugins.thunderbolt_macos import thunderbolt_macos_routes

    printed = "10.0.0.9 255.255.255.255 10.0.0.2\n10.0.0.5 255.255.255.255 10.0.0.2\n"
    wanted = [{"to": "10.0.0.5", "via": "10.0.0.2"}, {"to": "10.0.0.9", "via": "10.0.0.2"}]
    assert thunderbolt_macos_routes(printed) == thunderbolt_macos_routes(wanted) == [
        "10.0.0.5 255.255.255.255 10.0.0.2", "10.0.0.9 255.255.255.255 10.0.0.2"]
    assert thunderbolt_macos_routes("There are no additional IPv4 routes on MLX Thunderbolt en2.") == []
