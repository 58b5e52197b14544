"""The Thunderbolt cabling in `links` mode: a network per cable, and what runs over it.

With `thunderbolt_topology: links` the inventory lists the cables, each as its two ports:

    thunderbolt_links:
      - [mac1:en2, mac2:en2]
      - [mac2:en3, mac3:en2]
    thunderbolt_link_pool: 192.168.200.0/24

Each cable gets the next /30 of the pool, in list order: the first port listed is address .1 of
it, the second .2 (as MLX's own `mlx.distributed_config` gives every cable a /30). Nothing here
reaches a host: the inventory check, the role that configures the ports, the hostfiles and the
launch code all take their cables from `cables()`.

The MLX hostfiles follow MLX's format (mlx/_distributed_utils/common.py's `Hostfile`):
- ring: the nodes in ring order, each with its own addresses on the cable(s) to its left
  neighbour; a rank listens there and connects to its right neighbour's;
- jaccl (a full mesh): per node one RDMA device per peer (`rdma_<its port to that peer>`, none
  for itself) and the coordinator address;
- jaccl-ring: the same, with devices only towards the two ring neighbours.
"""

from __future__ import annotations

import ipaddress
import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Interface names as Linux allows them at most (15 characters), in plain characters.
INTERFACE_NAME = re.compile(r"[A-Za-z0-9_.:@-]{1,15}")
DEFAULT_POOL = "192.168.200.0/24"
# Backends that need which cabling: ring and jaccl-ring a cycle through every node, jaccl a cable
# between every two nodes, mpi a path between every two (a full mesh: we do not route).
BACKENDS = ("ring", "jaccl", "jaccl-ring", "mpi")
_PORT = re.compile(r"(?P<host>[^:\s]+):(?P<interface>\S+)")


@dataclass(frozen=True, order=True)
class Port:
    host: str
    interface: str

    def __str__(self) -> str:
        return f"{self.host}:{self.interface}"


@dataclass(frozen=True)
class Cable:
    """One cable: its ports as listed, and its own /30."""

    index: int  # in the inventory's list, from 0
    ends: tuple[Port, Port]
    network: ipaddress.IPv4Network

    def __str__(self) -> str:
        return f"{self.ends[0]} <-> {self.ends[1]}"

    @property
    def addresses(self) -> tuple[str, str]:
        """The two ends' addresses, in the order the ports are listed."""
        first = self.network.network_address
        return str(first + 1), str(first + 2)

    def end_of(self, host: str) -> int:
        return 0 if self.ends[0].host == host else 1

    def port_of(self, host: str) -> Port:
        return self.ends[self.end_of(host)]

    def address_of(self, host: str) -> str:
        return self.addresses[self.end_of(host)]

    def peer_of(self, host: str) -> Port:
        return self.ends[1 - self.end_of(host)]

    def joins(self, a: str, b: str) -> bool:
        return {self.ends[0].host, self.ends[1].host} == {a, b}


def _port(text: Any, cable: int, errors: list[str], hosts: Sequence[str]) -> Port | None:
    where = f"thunderbolt_links[{cable}]"
    match = _PORT.fullmatch(str(text)) if isinstance(text, str) else None
    if not match:
        errors.append(f"{where}: {text!r} is not a port: write it as host:interface, like mac1:en2")
        return None
    port = Port(match["host"], match["interface"])
    if port.host not in hosts:
        errors.append(f"{where}: {port.host} (in {port}) is not a host of the cluster: use its "
                      "inventory name")
        return None
    if not INTERFACE_NAME.fullmatch(port.interface):
        errors.append(f"{where}: {port.interface!r} (in {port}) is not an interface name (at most 15 "
                      "letters, digits and . _ - : @, like en2)")
        return None
    return port


def _pool(raw: Any) -> tuple[ipaddress.IPv4Network | None, str | None]:
    try:
        pool = ipaddress.IPv4Network(str(raw))
    except ValueError:
        return None, (f"thunderbolt_link_pool {raw!r} is not an IPv4 network written with its prefix "
                      f"(like {DEFAULT_POOL}, and with its host bits zero)")
    if pool.is_multicast or pool.is_loopback or pool.is_unspecified or pool.is_reserved:
        return None, (f"thunderbolt_link_pool {pool} is a multicast, loopback or reserved network: "
                      f"use a private one such as {DEFAULT_POOL}")
    if not pool.is_private:
        # Cable /30s out of a public network would shadow real hosts' addresses for the nodes.
        return None, (f"thunderbolt_link_pool {pool} is not a private network: use one of "
                      f"10.0.0.0/8, 172.16.0.0/12 or 192.168.0.0/16, such as {DEFAULT_POOL}")
    if pool.prefixlen > 30:
        return None, f"thunderbolt_link_pool {pool} holds no /30: give it a prefix of 30 or less"
    return pool, None


def pool_size(pool: ipaddress.IPv4Network) -> int:
    """How many cables (a /30 each) a pool has room for."""
    return 2 ** (30 - pool.prefixlen)


def cable_subnet(pool: ipaddress.IPv4Network, index: int) -> ipaddress.IPv4Network:
    """The /30 of the index-th cable: counted, never listed (a /8 holds four million)."""
    return ipaddress.IPv4Network((int(pool.network_address) + 4 * index, 30))


def cables(links: Any, pool: Any, hosts: Sequence[str]) -> tuple[list[Cable], list[str]]:
    """The cables `links` lists, each with its /30 of `pool`, and what is wrong (each message
    names the cable: its place in the list and its ports)."""
    errors: list[str] = []
    network, problem = _pool(pool if pool is not None else DEFAULT_POOL)
    if problem:
        errors.append(problem)
    if not isinstance(links, list) or not links:
        errors.append("thunderbolt_links must list the cables, one [host:port, host:port] pair each, "
                      "like - [mac1:en2, mac2:en2]")
        return [], errors
    found: list[Cable] = []
    used: dict[Port, int] = {}
    for index, link in enumerate(links):
        if not isinstance(link, list | tuple) or len(link) != 2:
            errors.append(f"thunderbolt_links[{index}]: {link!r} is not a cable: list its two ends, "
                          "like [mac1:en2, mac2:en2]")
            continue
        ends = [_port(end, index, errors, hosts) for end in link]
        if None in ends:
            continue
        a, b = ends[0], ends[1]
        assert a is not None and b is not None
        where = f"thunderbolt_links[{index}] ({a} <-> {b})"
        if a.host == b.host:
            errors.append(f"{where}: both ends are on {a.host}: a cable joins two machines")
            continue
        twice = [f"{port} (also in thunderbolt_links[{used[port]}])" for port in (a, b) if port in used]
        if twice:
            errors.append(f"{where}: a port holds one cable, but {' and '.join(twice)} is used twice")
            continue
        used |= {a: index, b: index}
        if network and index >= pool_size(network):
            errors.append(f"{where}: thunderbolt_link_pool {network} has room for {pool_size(network)} "
                          f"cables (a /30 each), not {len(links)}: give it a shorter prefix")
            continue
        if network:
            found.append(Cable(index, (a, b), cable_subnet(network, index)))
    return found, errors


def neighbours(hosts: Sequence[str], links: Sequence[Cable]) -> dict[str, dict[str, list[Cable]]]:
    """host -> peer -> the cables between them (in list order); cables to others left out."""
    joined: dict[str, dict[str, list[Cable]]] = {h: {} for h in hosts}
    for cable in links:
        a, b = (end.host for end in cable.ends)
        if a not in joined or b not in joined:
            continue
        joined[a].setdefault(b, []).append(cable)
        joined[b].setdefault(a, []).append(cable)
    return joined


def is_full_mesh(hosts: Sequence[str], links: Sequence[Cable]) -> bool:
    joined = neighbours(hosts, links)
    return all(peer in joined[h] for h in hosts for peer in hosts if peer != h)


def ring_order(hosts: Sequence[str], links: Sequence[Cable]) -> list[str] | None:
    """A cycle through every host, starting at hosts[0] (the launcher: rank 0) and, of the cycles
    there are, the first in the order the hosts are listed; None: the cabling has none. Two hosts
    joined by a cable are a ring of two."""
    joined = neighbours(hosts, links)
    if len(hosts) == 1:
        return list(hosts)
    rank = {h: i for i, h in enumerate(hosts)}

    def extend(path: list[str]) -> list[str] | None:
        if len(path) == len(hosts):
            return path if hosts[0] in joined[path[-1]] else None
        for peer in sorted(joined[path[-1]], key=rank.__getitem__):
            if peer not in path and (found := extend([*path, peer])):
                return found
        return None

    return extend([hosts[0]])


def ring_over_gaps(hosts: Sequence[str], links: Sequence[Cable]) -> list[str] | None:
    """When the cables make no ring through the hosts (a ring of Macs that lost some): the hosts in
    the order of a ring from hosts[0] with the fewest pairs of neighbours no cable joins, each
    such gap to be closed over the management network (of the rings with as few, the first in
    the order the hosts are listed). None when no cable joins any two of them, or they make a
    ring (ring_order). Eight hosts are 5,040 orders: tried one by one."""
    if len(hosts) < 3 or ring_order(hosts, links) is not None or not any(neighbours(hosts, links).values()):
        return None
    orders = ([hosts[0], *rest] for rest in itertools.permutations(hosts[1:]))
    return min(orders, key=lambda order: len(gaps_of(order, links)))  # the first of the fewest


def gaps_of(order: Sequence[str], links: Sequence[Cable]) -> list[tuple[str, str]]:
    """The pairs of ring neighbours in `order` that no cable joins."""
    joined = neighbours(order, links)
    return [(a, b) for a, b in zip(order, [*order[1:], order[0]], strict=True) if b not in joined[a]]


def backend_problem(backend: str, hosts: Sequence[str], links: Sequence[Cable]) -> str | None:
    """Why `backend` cannot run on this cabling (None: it can)."""
    if backend in ("ring", "jaccl-ring") and ring_order(hosts, links) is None:
        return (f"the {backend} backend needs the cables to make a ring through every node "
                f"({', '.join(hosts)}), and they do not: add the missing cable")
    if backend in ("jaccl", "mpi") and not is_full_mesh(hosts, links):
        joined = neighbours(hosts, links)
        missing = [f"{a} <-> {b}" for i, a in enumerate(hosts) for b in hosts[i + 1:]
                   if b not in joined[a]]
        why = ("JACCL's mesh needs a cable between every two nodes" if backend == "jaccl" else
               "MPI needs every two nodes to reach each other, and a per-cable network does not "
               "route through a third (MPI runs over a full mesh of cables)")
        return (f"the {backend} backend cannot run on this cabling: {why}; no cable joins "
                f"{', '.join(missing)} (use --backend ring, or add those cables)")
    return None


def mlx_hostfile(backend: str, hosts: Sequence[str], links: Sequence[Cable],
                 ssh: Mapping[str, str], coordinator: Mapping[str, str] | None = None,
                 envs: Sequence[str] = (), management: Mapping[str, str] | None = None) -> dict[str, Any]:
    """MLX's hosts file for `backend` ("ring", "jaccl", "jaccl-ring"), which mlx-cluster-launch reads
    (and mlx.launch, run by hand), one node per rank: `ssh` is how the launcher reaches each host,
    `coordinator` each host's address that JACCL's ranks meet at (the management network's). Given
    each host's `management` address, a ring's neighbours without a cable may talk over the
    management network (ring_over_gaps: the nodes a ring of cables has left after a fault); a rank
    whose left neighbour is one listens there."""
    order = ring_over_gaps(hosts, links) if backend == "ring" and management else None
    if order is None and (problem := backend_problem(backend, hosts, links)):
        raise ValueError(problem)
    joined = neighbours(hosts, links)
    order = order or (list(hosts) if backend == "jaccl" else ring_order(hosts, links) or [])
    # Pairs that talk, and as MLX does, as many cables for each as the least cabled pair has.
    talking = ([(a, b) for a in order for b in order if a != b] if backend == "jaccl" else
               [(a, order[(i + 1) % len(order)]) for i, a in enumerate(order)])
    count = min(len(joined[a][b]) for a, b in talking if b in joined[a])
    entries = []
    for i, host in enumerate(order):
        left, right = order[i - 1], order[(i + 1) % len(order)]
        if backend == "ring":
            # MLX's ring wants as many connections on every side: the management address as
            # often as the cables are (the launcher gives each its own port).
            ips = ([cable.address_of(host) for cable in joined[host][left][:count]] if left in joined[host]
                   else [management[host]] * count if management else [])
            entries.append({"ssh": ssh[host], "ips": ips, "rdma": []})
            continue
        rdma: list[Any] = []
        for peer in order:
            wanted = peer != host and (backend == "jaccl" or peer in (left, right))
            devices = [f"rdma_{cable.port_of(host).interface}" for cable in joined[host].get(peer, [])]
            rdma.append((devices[0] if count == 1 else devices[:count]) if wanted else None)
        ips = [coordinator[host]] if coordinator and host in coordinator else []
        entries.append({"ssh": ssh[host], "ips": ips, "rdma": rdma})
    return {"backend": backend, "envs": list(envs), "hosts": entries}


# --- the inventory's choice -----------------------------------------------------------------------

TOPOLOGIES = ("bridge", "links")
INVENTORY_BACKENDS = ("auto", *BACKENDS)


def cluster_setting(key: str, hosts: Sequence[str], hostvars: Mapping[str, Mapping[str, Any]],
                    default: Any = None) -> tuple[Any, str | None]:
    """A cluster-wide setting as every host resolves it; an error when they disagree (set in
    the group of some hosts only)."""
    values = {h: hostvars.get(h, {}).get(key, default) for h in hosts}
    distinct = {repr(v) for v in values.values()}
    if len(distinct) > 1:
        detail = "; ".join(f"{h}: {v!r}" for h, v in values.items())
        return None, (f"{key} differs between the hosts ({detail}): set it once for the whole "
                      "cluster (cluster: vars:)")
    return next(iter(values.values()), default), None


def mode_of(hosts: Sequence[str], hostvars: Mapping[str, Mapping[str, Any]]) -> str:
    """bridge, or links: what thunderbolt_topology says, else links when cables are listed."""
    mode, _ = cluster_setting("thunderbolt_topology", hosts, hostvars)
    if mode in TOPOLOGIES:
        return str(mode)
    listed, _ = cluster_setting("thunderbolt_links", hosts, hostvars)
    return "links" if listed else "bridge"


def topology_errors(hosts: Sequence[str], hostvars: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """A thunderbolt_topology that is neither bridge nor links (a misspelling would otherwise be
    taken as links when cables are listed, as bridge when not, without a word)."""
    mode, problem = cluster_setting("thunderbolt_topology", hosts, hostvars)
    if problem:
        return [problem]
    if mode is not None and mode not in TOPOLOGIES:
        return [f"thunderbolt_topology {mode!r} is not one of {', '.join(TOPOLOGIES)}: bridge (one "
                "network through a Thunderbolt bridge) or links (a network per cable)"]
    return []


def management_overlap(pool: ipaddress.IPv4Network, hosts: Sequence[str],
                       hostvars: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Nodes whose management address (ansible_host, when it is an address) lies in the link
    pool: a cable's /30 over it would cut the node off from Ansible and ssh."""
    inside = []
    for host in hosts:
        try:
            address = ipaddress.IPv4Address(str(hostvars.get(host, {}).get("ansible_host", "")))
        except ValueError:
            continue  # a name, not an address: nothing to compare here
        if address in pool:
            inside.append(f"{host} ({address})")
    if not inside:
        return []
    return [f"thunderbolt_link_pool {pool} holds the management address of {', '.join(inside)}: "
            "the cables' /30s would take it over; choose a pool outside the network Ansible reaches "
            f"the nodes on (the default is {DEFAULT_POOL})"]


def links_errors(hosts: Sequence[str], training: Sequence[str],
                 hostvars: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """What is wrong with a `links` inventory: its cables, and whether the backend it asks for
    (cluster_backend) can run on them. `training`: the hosts with slots, in rank order."""
    errors = topology_errors(hosts, hostvars)
    settings = {}
    for key, default in (("thunderbolt_links", None), ("thunderbolt_link_pool", DEFAULT_POOL),
                         ("cluster_backend", "auto")):
        settings[key], problem = cluster_setting(key, hosts, hostvars, default)
        errors += [problem] if problem else []
    if errors:
        return errors
    network, _ = _pool(settings["thunderbolt_link_pool"])
    if network:
        errors += management_overlap(network, hosts, hostvars)
    for host in hosts:
        if hostvars.get(host, {}).get("thunderbolt_ip") not in (None, ""):
            errors.append(f"{host}: thunderbolt_ip is for thunderbolt_topology: bridge; with links "
                          "each cable's addresses come from thunderbolt_link_pool: remove it")
    found, cable_errors = cables(settings["thunderbolt_links"], settings["thunderbolt_link_pool"], hosts)
    errors += cable_errors
    backend = settings["cluster_backend"]
    if backend not in INVENTORY_BACKENDS:
        return [*errors, f"cluster_backend {backend!r} is not one of {', '.join(INVENTORY_BACKENDS)}"]
    if cable_errors:
        return errors
    joined = neighbours(hosts, found)
    errors += [f"{host}: no cable in thunderbolt_links reaches it, but it trains (mpi_slots): cable "
               "it, or set its mpi_slots: 0" for host in training if not joined[host]]
    if backend == "auto":
        if len(training) > 1 and not ring_order(training, found):
            errors.append(f"the cables make no ring through the nodes that train "
                          f"({', '.join(training)}): add the missing cable")
    elif len(training) > 1 and (problem := backend_problem(backend, training, found)):
        errors.append(problem)
    errors += [f"{host}: mpi_slots {hostvars[host].get('mpi_slots')} over per-cable networks: one "
               "rank per machine (mpi_slots: 1; the ring's neighbours are machines)"
               for host in training if str(hostvars[host].get("mpi_slots", 1)) not in ("0", "1")]
    return errors


def listed_cables(hosts: Sequence[str], hostvars: Mapping[str, Mapping[str, Any]]) -> list[Cable]:
    """The cables the inventory lists (validation has made the setting one for the cluster, and
    refused what is wrong: here the well-formed ones are all there is)."""
    hv = hostvars[hosts[0]] if hosts else {}
    return cables(hv.get("thunderbolt_links"), hv.get("thunderbolt_link_pool", DEFAULT_POOL), hosts)[0]
