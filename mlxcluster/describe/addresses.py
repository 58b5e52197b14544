"""Where each node is on the cluster link: the ports the thunderbolt role gives an address
(with their peers and host routes), the address a node is known by, where the launcher reaches it,
and the rank order and ring hostfile that follow from them.

Both modes: on a bridge a node has its one `thunderbolt_ip`; in links mode an address per cable
end (topology.cables()). The inventory filters, the recorded layout and the launch code take a
node's addresses from here, so that each sees the same ones.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from typing import Any

from mlxcluster.describe.topology import DEFAULT_POOL, Cable, listed_cables, mlx_hostfile, mode_of, ring_order


def ports_of(host: str, hosts: Sequence[str],
             hostvars: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The interfaces the thunderbolt role gives an address on `host`, with the peers that must
    answer across each: in bridge mode its one interface (every other node answers there); in
    links mode one per cable end it has, each with its /30 and the cable's other end."""
    hv = hostvars[host]
    if mode_of(hosts, hostvars) == "bridge":
        if hv.get("thunderbolt_ip") in (None, ""):
            return []
        return [{"interface": hv.get("thunderbolt_interface"), "address": str(hv["thunderbolt_ip"]),
                 "prefix": int(hv.get("thunderbolt_prefix") or 24), "cable": None,
                 "peers": {h: str(hostvars[h]["thunderbolt_ip"]) for h in hosts
                           if h != host and hostvars.get(h, {}).get("thunderbolt_ip") not in (None, "")}}]
    found = listed_cables(hosts, hostvars)
    pool = str(ipaddress.IPv4Network(str(hv.get("thunderbolt_link_pool") or DEFAULT_POOL)))
    return [{"interface": cable.port_of(host).interface, "address": cable.address_of(host),
             "prefix": cable.network.prefixlen, "cable": str(cable), "pool": pool,
             "peers": {cable.peer_of(host).host: cable.address_of(cable.peer_of(host).host)},
             "routes": peer_routes(host, cable, found)}
            for cable in found if host in (end.host for end in cable.ends)]


def peer_routes(host: str, cable: Cable, found: Sequence[Cable]) -> list[dict[str, str]]:
    """Host routes across `cable` to its far end's addresses on its other cables, through its
    address on this one: every neighbour is then reachable at each of its addresses, as Open
    MPI's TCP transport expects of a peer (it offers all of them). Only the first cable between
    two nodes carries them."""
    peer = cable.peer_of(host).host
    if next(c for c in found if c.joins(host, peer)) is not cable:
        return []
    return [{"to": other.address_of(peer), "via": cable.address_of(peer)}
            for other in found if peer in (e.host for e in other.ends) and not other.joins(host, peer)]


def contact_address(host: str, hosts: Sequence[str], launcher: str,
                    hostvars: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The address a node is known by on the cluster link (the hostfile's, /etc/hosts', the
    record's): its thunderbolt_ip on a bridge; in links mode its end of a cable to the launcher
    (the launcher: its end of its first cable), else of its first cable; None: not cabled."""
    hv = hostvars[host]
    if mode_of(hosts, hostvars) == "bridge":
        return str(hv["thunderbolt_ip"]) if hv.get("thunderbolt_ip") not in (None, "") else None
    found = listed_cables(hosts, hostvars)
    own = [cable for cable in found if host in (end.host for end in cable.ends)]
    to_launcher = [cable for cable in own if cable.joins(host, launcher)]
    chosen = (to_launcher or own)[:1]
    return chosen[0].address_of(host) if chosen else None


def addresses_of(host: str, hosts: Sequence[str], hostvars: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Every address of a node on the cluster link (known_hosts pins each)."""
    return [port["address"] for port in ports_of(host, hosts, hostvars)]


def _slots(hv: Mapping[str, Any]) -> int:
    try:
        return int(hv.get("mpi_slots", 1))
    except (TypeError, ValueError):
        return 0


def rank_order(hosts: Sequence[str], launcher: str, hostvars: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Every host in rank order, the launcher first: the inventory's order on a bridge; in links
    mode the nodes that train in ring order when the cables make a ring (so that each rank's
    neighbours are the ones its cables reach, for every backend alike), then the others."""
    ordered = [launcher, *(h for h in hosts if h != launcher)]
    if mode_of(hosts, hostvars) == "bridge":
        return ordered
    training = [h for h in ordered if _slots(hostvars[h]) > 0]
    found = listed_cables(hosts, hostvars)
    ring = ring_order(training, found) if training and training[0] == launcher else None
    first = ring or training
    return [*first, *(h for h in ordered if h not in first)]


def links_hostfile(hosts: Sequence[str], launcher: str, hostvars: Mapping[str, Mapping[str, Any]],
                   envs: Sequence[str] = ()) -> dict[str, Any]:
    """hosts.json in links mode: the ring backend's, the nodes that train in rank order, each
    reached by ssh at its end of a cable to the launcher, else at its management address."""
    order = [h for h in rank_order(hosts, launcher, hostvars) if _slots(hostvars[h]) > 0]
    found = listed_cables(hosts, hostvars)
    ssh = {host: reach_from_launcher(host, hosts, launcher, hostvars) for host in order}
    ssh[launcher] = contact_address(launcher, hosts, launcher, hostvars) or ssh[launcher]
    if len(order) == 1:  # one rank: no neighbour to talk to
        alone = order[0]
        return {"backend": "ring", "envs": list(envs), "hosts": [
            {"ssh": ssh[alone], "ips": [contact_address(alone, hosts, launcher, hostvars)], "rdma": []}]}
    return mlx_hostfile("ring", order, found, ssh, envs=envs)


def link_of(host: str, hosts: Sequence[str], launcher: str,
            hostvars: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The node's address on the cluster link as the launch code uses it (contact_address), with
    its interface and prefix length; in links mode also the pool, which MPI is pinned to."""
    address = contact_address(host, hosts, launcher, hostvars)
    hv = hostvars[host]
    if mode_of(hosts, hostvars) == "bridge":
        return {"thunderbolt_ip": address, "thunderbolt_interface": hv.get("thunderbolt_interface"),
                "thunderbolt_prefix": int(hv.get("thunderbolt_prefix") or 24)}
    port = next((p for p in ports_of(host, hosts, hostvars) if p["address"] == address), None)
    return {"thunderbolt_ip": address, "thunderbolt_interface": port["interface"] if port else None,
            "thunderbolt_prefix": 30, "thunderbolt_link_pool": str(hv.get("thunderbolt_link_pool")
                                                                   or DEFAULT_POOL)}


def reach_from_launcher(host: str, hosts: Sequence[str], launcher: str,
                        hostvars: Mapping[str, Mapping[str, Any]]) -> str:
    """Where the launcher reaches a node to copy to it: over the cluster link (thunderbolt_ip;
    in links mode its end of a cable to the launcher), or, when no cable joins them, at its
    management address."""
    if mode_of(hosts, hostvars) == "bridge":
        return str(hostvars[host]["thunderbolt_ip"])
    found = listed_cables(hosts, hostvars)
    direct = [c for c in found if c.joins(host, launcher)]
    return direct[0].address_of(host) if direct else str(hostvars[host].get("ansible_host") or host)
