"""Which backend a cluster trains with, and why: `choose`, the meaning of `--backend auto`.

Like MLX's own configurator (mlx.distributed_config), best first: JACCL (RDMA over Thunderbolt 5)
when a cable joins every two nodes and every node has an RDMA device on each of its cabled
ports; jaccl-ring when the cables make a ring instead; MLX's ring backend (TCP) on a ring without
RDMA; MPI on the Thunderbolt Bridge, where one network joins every node and the inventory lists
no cables, so neither RDMA ports nor a ring are known. What the nodes have is what provisioning
recorded (`rdma_devices`: `ibv_devices` on a Mac in links mode; none on Linux, whose Thunderbolt
networking has no RDMA).

A backend asked for by name (--backend, or cluster_backend in the inventory) is taken as it is
(Cluster.backend_choice, record.record); the inventory check has refused the ones the cabling
cannot carry.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mlxcluster.describe.topology import Cable, gaps_of, is_full_mesh, ring_order, ring_over_gaps

RDMA_HOWTO = ("enable RDMA once per Mac: in macOS Recovery, Terminal, `rdma_ctl enable`, then "
              "restart (macOS 26.2 or later, Thunderbolt 5)")


@dataclass(frozen=True)
class Choice:
    backend: str
    why: str

    def as_record(self) -> dict[str, str]:
        return {"name": self.backend, "why": self.why}


def rdma_missing(training: Sequence[str], links: Sequence[Cable],
                 rdma: Mapping[str, Sequence[str] | None]) -> list[str]:
    """The cabled ports of the nodes that train without their RDMA device, as "node2:en3"."""
    missing = []
    for cable in links:
        for end in cable.ends:
            if end.host in training and f"rdma_{end.interface}" not in (rdma.get(end.host) or ()):
                missing.append(str(end))
    return missing


def choose(mode: str, training: Sequence[str], links: Sequence[Cable],
           rdma: Mapping[str, Sequence[str] | None], *, close_over_management: bool = False) -> Choice:
    """The backend `--backend auto` means for this cluster, and why. `close_over_management`: the
    nodes a fault left (Cluster.without), whose cables may make a line where they made a ring:
    MLX's ring then runs over them and closes over the management network, rather than not at
    all (JACCL has no RDMA there)."""
    if mode != "links":
        return Choice("mpi", "one network joins every node (thunderbolt_topology: bridge), which "
                             "MPI uses; per-cable networks (links) allow ring and JACCL")
    used = [cable for cable in links if all(end.host in training for end in cable.ends)]
    if len(training) < 2:
        return Choice("ring", "one node trains: no cable is used")
    missing = rdma_missing(training, used, rdma)
    mesh = is_full_mesh(training, used)
    ring = ring_order(training, used) is not None
    if not missing and mesh:
        return Choice("jaccl", "a cable joins every two nodes and every cabled port has RDMA")
    if not missing and ring:
        return Choice("jaccl-ring", "the cables make a ring (not a full mesh) and every cabled "
                                    "port has RDMA")
    if ring:
        return Choice("ring", f"the cables make a ring; {_no_jaccl(training, missing, rdma)}")
    if close_over_management and (order := ring_over_gaps(training, used)):
        gaps = ", ".join(" and ".join(sorted(gap, key=training.index)) for gap in gaps_of(order, used))
        return Choice("ring", f"the cables of the nodes left make no ring: MLX's ring closes it over "
                              f"the management network between {gaps}, at that network's speed")
    raise ValueError(f"the cables make no ring through the nodes that train ({', '.join(training)})")


def _no_jaccl(training: Sequence[str], missing: Sequence[str],
              rdma: Mapping[str, Sequence[str] | None]) -> str:
    """Why not JACCL: nodes whose RDMA nobody read (Linux has none over Thunderbolt; a Mac is
    read when provisioned in links mode), or the cabled ports without their device."""
    unknown = [host for host in training if rdma.get(host) is None]
    if unknown:
        return (f"RDMA is not known on {', '.join(unknown)} (JACCL needs Macs with Thunderbolt 5, "
                "provisioned in links mode; Linux has no RDMA over Thunderbolt)")
    shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    return f"no RDMA on {shown} for JACCL ({RDMA_HOWTO})"
