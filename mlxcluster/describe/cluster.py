"""The cluster as provisioning recorded it, and the layouts a launch runs on.

`build/<inventory>/cluster.json` (written by every site.yml run, mlxcluster/describe/record.py) holds every
value Ansible resolved: per node its link, slots, paths and how the controller reaches it. `Cluster` is
that record; its sub-layouts (the first k nodes, one rank per node, one node alone) are clusters
too, so every launch, sync and check takes a `Cluster` and nothing else.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxcluster.describe.backends import Choice, choose
from mlxcluster.describe.topology import Cable, Port
from mlxcluster.errors import UserError
from mlxcluster.paths import build_dir_for


class NotReady(UserError):
    """The cluster cannot be launched on as it is; the message says what to fix."""


# A node is provisioned once its roles recorded these (a run limited by --tags or --limit may
# not have run them there yet).
REQUIRED_PATHS = ("cluster_root", "venv", "env_file", "openmpi_prefix")


@dataclass(frozen=True)
class Node:
    name: str
    thunderbolt_ip: str
    slots: int
    os_family: str = "Debian"
    thunderbolt_interface: str | None = None
    thunderbolt_prefix: int = 24
    thunderbolt_mtu: int = 0  # 0: not recorded
    # links mode (a network per cable): the pool every cable's /30 is in; MPI is pinned to it.
    thunderbolt_link_pool: str | None = None
    cluster_root: str | None = None
    venv: str | None = None
    env_file: str | None = None
    openmpi_prefix: str | None = None
    reachable: bool = True
    # The model provisioning installed (roles/model): path, manifest_sha256, source,
    # controller_path, bytes; None on a 0-slot node or before the model play ran.
    model: Mapping[str, Any] | None = None
    connection: Mapping[str, Any] = field(default_factory=dict)
    # A Mac in links mode: its RDMA devices (ibv_devices: rdma_en2, ...) and its address on the
    # management network (JACCL's ranks meet rank 0 there); None where not probed.
    rdma_devices: tuple[str, ...] | None = None
    management_ip: str | None = None
    # A Mac: the network service of its Thunderbolt Bridge (thunderbolt_macos_service), which
    # links mode turns off.
    bridge_service: str | None = None
    # Each of its ranks' weight in a global batch (a number, or "auto": from the calibration), and
    # the most examples a rank of it runs at once (0: no limit); mlxcluster/launch/batch_shares.py.
    batch_share: float | str | None = None
    max_micro_batch: int = 0
    # Its ranks dequantize a quantized model as they load it (memory for speed), as its inventory's
    # model_dequantize says; mlxcluster/launch/quantized.py. A quantized model stays so by default.
    model_dequantize: bool = False
    # The layers each of its ranks holds in a pipeline-parallel run (0: sized from its memory, as
    # mlxcluster/launch/stages.py does for nodes that do not say).
    pipeline_layers: int = 0

    @property
    def management_address(self) -> str:
        """Where the other nodes reach it without a cable: the address Ansible reaches it at."""
        return str(self.connection.get("host") or self.management_ip or self.name)

    @property
    def provisioned(self) -> bool:
        return all(getattr(self, name) for name in REQUIRED_PATHS)

    # Where things live on a node: under its cluster_root, the same path on every node. The work
    # directory holds the training code (work/training), the data (work/data) and configs.
    work_dir = property(lambda self: f"{self.cluster_root or ''}/work")
    models_dir = property(lambda self: f"{self.cluster_root or ''}/models")
    runs_dir = property(lambda self: f"{self.cluster_root or ''}/runs")


# The way between two nodes that no cable joins in links mode.
MANAGEMENT = "the management network, no cable between them"


@dataclass(frozen=True)
class Route:
    """Where one node reaches another, and over what (a cable, the bridge, the management
    network)."""

    address: str
    over: str

    @property
    def cabled(self) -> bool:
        """Over the cluster link (a cable or the bridge), not the management network."""
        return self.over != MANAGEMENT


@dataclass(frozen=True)
class LinkPort:
    """One of a node's ports on the cluster link: the bridge's interface, or a cable's end."""

    node: str
    interface: str | None
    address: str
    prefix: int
    cable: str | None = None  # "node1:en2 <-> node2:en2" in links mode

    @property
    def label(self) -> str:
        return f"interface {self.interface}" + (f" (cable {self.cable})" if self.cable else "")


@dataclass(frozen=True)
class Cluster:
    launcher: str
    nodes: tuple[Node, ...]
    # links mode: each cable's ends, {"ends": [{"host", "interface", "address"}, ...], "network"}
    cables: tuple[Mapping[str, Any], ...] = ()
    # The backend `--backend auto` means here, as provisioning chose it: {"name", "why"}.
    backend: Mapping[str, str] | None = None
    # The nodes and slots as provisioned, whose hostfiles are on the nodes; False for a layout
    # of fewer ranks (first_nodes, only...), which a launch gives hosts files of its own.
    provisioned: bool = True
    # The nodes a fault left out of this layout (without): its ring of cables may then be a line
    # that the management network closes (mlxcluster/describe/backends.py).
    left_out: frozenset[str] = frozenset()

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Cluster:
        nodes = tuple(Node(**{k: v for k, v in node.items() if k in Node.__dataclass_fields__})
                      for node in data["nodes"])
        return cls(launcher=data["launcher"], nodes=nodes, cables=tuple(data.get("cables") or ()),
                   backend=data.get("backend"))

    def links(self) -> list[Cable]:
        """The cables as topology's Cables (links mode; none on a bridge)."""
        found = []
        for i, cable in enumerate(self.cables):
            a, b = cable["ends"]
            found.append(Cable(i, (Port(a["host"], a["interface"]), Port(b["host"], b["interface"])),
                               ipaddress.ip_network(cable["network"])))
        return found

    def backend_choice(self, asked: str | None = None) -> Choice:
        """The backend a launch uses and why: the one asked for, else (auto) the recorded choice,
        else the choice for this layout (mlxcluster/describe/backends.py)."""
        if asked and asked != "auto":
            return Choice(asked, "asked for (--backend)")
        if self.backend:
            return Choice(self.backend["name"], self.backend["why"])
        return choose("links" if self.cables else "bridge", [n.name for n in self.training_nodes],
                      self.links(), {n.name: n.rdma_devices for n in self.nodes},
                      close_over_management=bool(self.left_out))

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def ports_of(self, node: Node) -> list[LinkPort]:
        """The node's ports on the cluster link: its one interface on a bridge, else one per
        cable end it has."""
        if not self.cables:
            return [LinkPort(node.name, node.thunderbolt_interface, node.thunderbolt_ip,
                             node.thunderbolt_prefix)]
        return [LinkPort(node.name, cable.port_of(node.name).interface, cable.address_of(node.name),
                         cable.network.prefixlen, str(cable))
                for cable in self.links() if node.name in (end.host for end in cable.ends)]

    def path_towards(self, node: Node, peer: Node) -> Route:
        """How `node` reaches `peer` for what needs no Thunderbolt speed (ssh, checks, copies of
        the model, data and checkpoints), the one rule every caller takes: on a bridge, the
        peer's thunderbolt_ip; in links mode the peer's end of a cable between them, and when no
        cable joins them (node1 and node3 of a ring of four), the peer's management address,
        which ssh_mesh pinned too. The backends need less: ring only each rank's neighbours,
        JACCL a cable per pair, MPI every pair (refused off a full mesh of cables)."""
        if not self.cables:
            return Route(peer.thunderbolt_ip, "the bridge")
        for cable in self.links():
            if cable.joins(node.name, peer.name):
                return Route(cable.address_of(peer.name), f"cable {cable}")
        return Route(peer.management_address, MANAGEMENT)

    def address_towards(self, node: Node, peer: Node) -> str:
        """Where `node` reaches `peer` (path_towards)."""
        return self.path_towards(node, peer).address

    @classmethod
    def load(cls, path: Path) -> Cluster:
        if not path.exists():
            raise NotReady(f"{path} is missing: provision the cluster first "
                           "(invoke provision -i <inventory>)")
        return cls.from_json(json.loads(path.read_text()))

    @property
    def head(self) -> Node:
        """The launcher: rank 0, where mpirun starts."""
        return next(n for n in self.nodes if n.name == self.launcher)

    @property
    def training_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.slots > 0]

    @property
    def world_size(self) -> int:
        return sum(n.slots for n in self.training_nodes)

    def installed_model(self) -> Mapping[str, Any] | None:
        """The model provisioning installed on every training node (None: it recorded none);
        NotReady when a training node lacks that copy."""
        model = self.head.model
        if not model:
            return None
        lacking = [n.name for n in self.training_nodes
                   if (n.model or {}).get("manifest_sha256") != model.get("manifest_sha256")]
        if lacking:
            raise NotReady(f"{', '.join(lacking)} has no copy of the provisioned model "
                           f"{model.get('source')}: run invoke provision --tags model")
        return model

    def hostfile_lines(self) -> list[str]:
        return [f"{n.thunderbolt_ip} slots={n.slots}" for n in self.training_nodes]

    def rank_nodes(self) -> list[str]:
        """Node name of each rank: launchers fill the hostfile's hosts in order, slot by slot."""
        return [n.name for n in self.training_nodes for _ in range(n.slots)]

    def node_of_rank(self, rank: int) -> str:
        names = self.rank_nodes()
        return names[rank] if 0 <= rank < len(names) else "?"

    def _with_slots(self, slots: Mapping[str, int]) -> Cluster:
        same = self.provisioned and all(slots.get(n.name, 0) == n.slots for n in self.nodes)
        return Cluster(self.launcher, tuple(dataclasses.replace(n, slots=slots.get(n.name, 0))
                                            for n in self.nodes), self.cables, provisioned=same)

    def first_nodes(self, count: int) -> Cluster:
        """The launcher and the next count - 1 training nodes with their slots; the others get
        none (bench.scaling's configurations)."""
        ordered = sorted(self.training_nodes, key=lambda n: n.name != self.launcher)
        return self._with_slots({n.name: n.slots for n in ordered[:count]})

    def one_rank_per_node(self) -> Cluster:
        """One slot on each node that trains: ranks that share a node would talk through its
        memory, not over the cable (bench.links)."""
        return self._with_slots({n.name: 1 for n in self.training_nodes})

    def without(self, names: Collection[str]) -> Cluster:
        """The layout of the nodes left when `names` are left out (drained after a fault): they
        are not in it at all, so that no launch, copy or check reaches them. When the launcher is
        one of them, the first training node left launches (and gets the run's checkpoints). The
        backend is chosen again for the nodes left: a ring of cables less one node is a line,
        which the management network closes into a ring (backends.choose)."""
        nodes = tuple(n for n in self.nodes if n.name not in names)
        training = [n for n in nodes if n.slots > 0]
        if not training:
            raise NotReady(f"no node that trains is left without {', '.join(sorted(names))}")
        launcher = self.launcher if self.launcher not in names else training[0].name
        cables = tuple(c for c in self.cables if not {e["host"] for e in c["ends"]} & set(names))
        if self.cables and not cables and len(training) > 1:
            # Per-cable networks with none left between them: no cluster link at all.
            raise NotReady(f"no cable joins the nodes left without {', '.join(sorted(names))} "
                           f"({', '.join(n.name for n in training)})")
        if nodes == self.nodes:
            return self
        return Cluster(launcher, nodes, cables, backend=None if self.cables else self.backend,
                       provisioned=False, left_out=self.left_out | set(names))

    def only(self, node: Node) -> Cluster:
        """`node` alone, as its own launcher with one slot: a process run on it by itself."""
        return Cluster(node.name, (dataclasses.replace(node, slots=1),), self.cables, provisioned=False)


def hostfile_entries(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def check_ready(cluster: Cluster, hostfile_text: str) -> None:
    """Refuse to launch on a cluster that provisioning has not (fully) prepared."""
    needed = [cluster.head, *(n for n in cluster.training_nodes if n.name != cluster.launcher)]
    down = [n.name for n in needed if n.provisioned and not n.reachable]
    if down:
        raise NotReady(f"{', '.join(down)} could not be reached when the cluster was last "
                       "provisioned: bring it back and run invoke provision, or set its "
                       "mpi_slots: 0")
    bare = [n.name for n in needed if not n.provisioned]
    if bare:
        raise NotReady(f"{', '.join(bare)} not provisioned yet (no venv, env file or Open MPI "
                       "recorded): run invoke provision -i <inventory> with every play (--tags and "
                       "--limit set up only part of the cluster)")
    if hostfile_entries(hostfile_text) != cluster.hostfile_lines():
        raise NotReady("the rendered hostfile does not match the inventory: run invoke "
                       "provision (or invoke hostfile) after editing the inventory")


@dataclass(frozen=True)
class Recorded:
    """What provisioning left on the controller for one inventory."""

    inventory: str
    cluster: Cluster
    build: Path

    @property
    def rendered_hostfile(self) -> str:
        path = self.build / "hostfile"
        return path.read_text() if path.exists() else ""

    @property
    def hosts_json(self) -> Path:
        return self.build / "hosts.json"

    @property
    def calibration(self) -> Path:
        """invoke bench.calibrate's measures of each node (mlxcluster/launch/batch_shares.py)."""
        return self.build / "calibration.json"

    @property
    def mlx_envs(self) -> list[str]:
        """What MLX's launcher exports on every rank (hostfile_mlx_envs), as provisioning rendered it
        into hosts.json; a hosts file written at launch (JACCL's, a benchmark's) carries them too."""
        try:
            return list(json.loads(self.hosts_json.read_text()).get("envs", []))
        except (OSError, ValueError):
            return []


def recorded(inventory: str, *, ready: bool = True) -> Recorded:
    """The recorded layout of `inventory`; with `ready`, only if it can be launched on as it is."""
    build = build_dir_for(inventory)
    try:
        found = Recorded(inventory, Cluster.load(build / "cluster.json"), build)
        if ready:
            if not (build / "hostfile").exists():
                raise NotReady(f"{build / 'hostfile'} is missing: run invoke provision")
            check_ready(found.cluster, found.rendered_hostfile)
    except NotReady as exc:
        raise NotReady(f"cannot {'launch' if ready else 'check'}: {exc}") from None
    return found
