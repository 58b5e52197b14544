"""`invoke topology` (mlxcluster/check/cabling.py): the cables read from what the Macs' system_profiler
and networksetup print, the block to paste, and the picture."""

from __future__ import annotations

import pytest
import yaml

from mlxcluster.check import cabling
from mlxcluster.describe import topology
from mlxcluster.errors import UserError
from tests.unit.ansible.test_thunderbolt_macos import HARDWARE as TWO_PORTS

# The Mac of the networksetup plan's tests, with a third Thunderbolt port.
HARDWARE = TWO_PORTS + "\nHardware Port: Thunderbolt 3\nDevice: en4\nEthernet Address: 36:a2:04:00:00:05\n"


def profiler(*ports: tuple[str, str, str | None]) -> dict:
    """system_profiler SPThunderboltDataType -json with ports (receptacle, domain, plugged-in domain)."""
    # The first bus has no port of its own (no domain): it is passed over.
    buses = [{"_name": "thunderboltusb4_bus_0", "device_name_key": "Mac Studio"}]
    for tag, domain, peer in ports:
        bus = {"_name": f"thunderboltusb4_bus_{tag}", "device_name_key": "Mac Studio",
               "domain_uuid_key": domain, "receptacle_1_tag": {"receptacle_id_key": tag}}
        if peer:
            bus["_items"] = [{"_name": "Mac Studio", "domain_uuid_key": peer}]
        buses.append(bus)
    return {"SPThunderboltDataType": buses}


# Three Macs in a ring, and mac3's third port plugged into a Mac outside the inventory.
MACS = {"mac1": profiler(("1", "A1", "B1"), ("2", "A2", "C2")),
        "mac2": profiler(("1", "B1", "A1"), ("2", "B2", "C1")),
        "mac3": profiler(("1", "C1", "B2"), ("2", "C2", "A2"), ("3", "C3", "ZZ"))}


def seen() -> list[cabling.SeenPort]:
    return [port for host, data in MACS.items() for port in cabling.ports_seen(host, data, HARDWARE)]


def test_each_mac_says_which_domain_each_port_is_plugged_into():
    assert cabling.ports_seen("mac3", MACS["mac3"], HARDWARE) == [
        cabling.SeenPort("mac3", "en2", "C1", "B2"), cabling.SeenPort("mac3", "en3", "C2", "A2"),
        cabling.SeenPort("mac3", "en4", "C3", "ZZ")]


def test_the_cables_are_read_once_each_in_inventory_order_and_strangers_noted():
    links, notes = cabling.cables_seen(seen(), ["mac1", "mac2", "mac3"])
    assert links == [["mac1:en2", "mac2:en2"], ["mac1:en3", "mac3:en3"], ["mac2:en3", "mac3:en2"]]
    assert notes == ["mac3:en4 is plugged into a machine not in the inventory (Thunderbolt domain ZZ)"]


def test_the_block_pastes_into_an_inventory_that_validation_accepts_as_a_ring():
    links, _ = cabling.cables_seen(seen(), ["mac1", "mac2", "mac3"])
    pasted = yaml.safe_load(cabling.links_block(links, "192.168.200.0/24"))
    assert pasted == {"thunderbolt_topology": "links", "thunderbolt_link_pool": "192.168.200.0/24",
                      "thunderbolt_links": links}
    found, errors = topology.cables(pasted["thunderbolt_links"], pasted["thunderbolt_link_pool"],
                                    ["mac1", "mac2", "mac3"])
    assert errors == [] and topology.ring_order(["mac1", "mac2", "mac3"], found) is not None


def test_a_thunderbolt_port_without_a_network_device_is_named():
    with pytest.raises(UserError, match="mac1: Thunderbolt port 4 has no network device"):
        cabling.ports_seen("mac1", profiler(("4", "A4", None)), HARDWARE)


def test_the_picture_is_drawn(tmp_path):
    links, _ = cabling.cables_seen(seen(), ["mac1", "mac2", "mac3"])
    cabling.draw(["mac1", "mac2", "mac3"], links, tmp_path / "topology.png")
    assert (tmp_path / "topology.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_two_cables_between_the_same_macs_are_drawn_apart(tmp_path):
    a, b = (0.0, 1.0), (0.0, -1.0)
    straight = cabling._bend(a, b, 0.0)
    assert straight(0.5) == (0.0, 0.0) and straight(0.0) == a and straight(1.0) == b
    # Two cables of one pair: bowed to either side by as much, whichever end was listed first.
    left, right = cabling._bend(a, b, -0.06), cabling._bend(a, b, 0.06)
    assert left(0.5)[0] == -right(0.5)[0] != 0 and left(1.0) == right(1.0) == b
    assert cabling._bend(b, a, -0.06)(0.5) == right(0.5)
    cabling.draw(["mac1", "mac2", "mac3"], [["mac1:en2", "mac2:en2"], ["mac2:en3", "mac1:en3"],
                                            ["mac3:en2", "mac1:en4"]], tmp_path / "twice.png")
    assert (tmp_path / "twice.png").stat().st_size > 0
