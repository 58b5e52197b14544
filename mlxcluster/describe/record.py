"""Writing the recorded layout: `build/<inventory>/cluster.json` after any site.yml run.

A run learns a node's paths (venv, env file, Open MPI prefix, the model) only from the roles it
ran on that node, and a run limited by `--tags` or `--limit` runs few of them. So the record is
the previous one with this run's news merged in, never a fresh guess: what a run did not learn
is kept from the last record, what no run learned yet is null, and such a node reads "not
provisioned" (cluster.py's `Node.provisioned`). The inventory's own settings (link, slots, how
to reach a node) always come from the inventory as it is now.

Kept values belong to the cluster_root they were recorded under: when the inventory moves
cluster_root, a node's kept paths are dropped until the roles run there again.

roles/hostfile/tasks/record.yml calls `record` through filter_plugins/cluster_record.py on the
controller, every run, whatever its tags; Ansible's copy writes the file atomically.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from jinja2 import Undefined

from mlxcluster.describe import addresses, inventory, topology
from mlxcluster.describe.backends import Choice
from mlxcluster.describe.cluster import REQUIRED_PATHS, Cluster
from mlxcluster.describe.inventory import topology_view

# What a node's roles tell the record: the node field and the fact (set_fact) it comes from.
# A new fact to record is one line here (and an optional field of cluster.py's Node).
LEARNED: Mapping[str, str] = {
    "venv": "python_env_venv",
    "env_file": "python_env_env_path",
    "openmpi_prefix": "openmpi_prefix",
    "model": "model_installed",  # the model role's {path, manifest sha256}
    # A Mac in links mode (the thunderbolt role): what --backend auto needs to pick JACCL.
    "rdma_devices": "thunderbolt_rdma_devices",
    "management_ip": "thunderbolt_management_ip",
}


@dataclass(frozen=True)
class Seen:
    """What this run knows of one inventory node."""

    settings: Mapping[str, Any]  # from the inventory: name, link, slots, connection
    targeted: bool = True  # in this run's hosts (not left out by --limit)
    answered: bool = True  # and still in the play when it was recorded (not down, not failed)
    cluster_root: str | None = None  # as the inventory resolves it now (answered nodes)
    learned: Mapping[str, Any] = field(default_factory=dict)  # LEARNED fields set in this run


def previous_nodes(text: str | None) -> dict[str, Mapping[str, Any]]:
    """The nodes of the last record by name. A missing or unreadable record counts as none:
    it is derived data, and what this run does not learn then reads "not provisioned"."""
    try:
        data = json.loads(text) if text else {}
    except ValueError:
        return {}
    nodes = data.get("nodes") if isinstance(data, dict) else None
    if not isinstance(nodes, list):
        return {}
    return {n["name"]: n for n in nodes if isinstance(n, dict) and isinstance(n.get("name"), str)}


def node_record(seen: Seen, before: Mapping[str, Any] | None) -> dict[str, Any]:
    """One node's entry: the inventory's settings, this run's news, the rest kept from `before`."""
    kept = before or {}
    if seen.answered:
        root = seen.cluster_root
        # Paths recorded under another cluster_root are not where this one looks.
        base = kept if kept.get("cluster_root") == root else {}
    else:  # left out by --limit, or down/failed in this run: it still is what it was
        root = kept.get("cluster_root")
        base = kept
    record: dict[str, Any] = {
        **seen.settings,
        # A node this run did not target keeps its last state; one it targeted says how it went.
        "reachable": seen.answered if seen.targeted else bool(kept.get("reachable", False)),
        "cluster_root": root,
        **{name: seen.learned.get(name, base.get(name)) for name in LEARNED},
    }
    record["provisioned"] = all(record.get(name) for name in REQUIRED_PATHS)
    return record


def record(launcher: str, seen: Iterable[Seen], previous: str | None,
           cables: list[dict[str, Any]] | None = None, asked: str = "auto") -> dict[str, Any]:
    """The whole record: the launcher and every inventory node in the order given (rank order:
    the launcher first), in links mode the cables, and the backend `--backend auto` means (the
    inventory's cluster_backend, or the best this layout carries) with why. Nodes no longer in
    the inventory are dropped."""
    before = previous_nodes(previous)
    found = {"launcher": launcher,
             "nodes": [node_record(s, before.get(s.settings["name"])) for s in seen]}
    found |= {"cables": cables} if cables else {}
    try:
        choice = (Choice(asked, "cluster_backend in the inventory") if asked not in (None, "auto")
                  else Cluster.from_json(found).backend_choice())
    except ValueError:  # no backend fits (the inventory check says why): nothing to record
        return found
    return found | {"backend": choice.as_record()}


def cables_of(groups: Mapping[str, list[str]], view: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """links mode's cables as the record keeps them (none on a bridge)."""
    cluster = list(groups["cluster"])
    if topology.mode_of(cluster, view) == "bridge":
        return []
    found = topology.listed_cables(cluster, view)
    return [{"ends": [{"host": end.host, "interface": end.interface, "address": address}
                      for end, address in zip(cable.ends, cable.addresses, strict=True)],
             "network": str(cable.network)} for cable in found]


# --- from Ansible's variables ---------------------------------------------------------------------


def node_settings(name: str, hostvars: Mapping[str, Any], launcher: str,
                  view: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """A node's settings from its resolved inventory variables."""
    hv = hostvars[name]

    def get(key: str, default: Any = None) -> Any:
        return hv[key] if key in hv and hv[key] is not None else default

    cluster = list(view)
    return {
        "name": name,
        "os_family": "Darwin" if "macs" in hv["group_names"] else "Debian",
        # Its address on the cluster link: thunderbolt_ip, or in links mode its end of the cable
        # to the launcher (mlxcluster/describe/addresses.py).
        **addresses.link_of(name, cluster, launcher, view),
        "thunderbolt_mtu": int(get("thunderbolt_mtu", 0)),
        **({"bridge_service": str(get("thunderbolt_macos_service", "Thunderbolt Bridge"))}
           if "macs" in hv["group_names"] else {}),
        "slots": int(get("mpi_slots", 1)),
        # Validation has checked both (mlxcluster/launch/batch_shares.py).
        "batch_share": inventory.share_value(get("batch_share")),
        "max_micro_batch": inventory.micro_batch_value(get("max_micro_batch")),
        # Validation has checked it too (mlxcluster/launch/quantized.py).
        "model_dequantize": inventory.dequantize_value(get("model_dequantize")),
        # And this (mlxcluster/launch/stages.py).
        "pipeline_layers": inventory.stage_layers_value(get("pipeline_layers")),
        "connection": {
            "type": get("ansible_connection", "ssh"),
            "host": get("ansible_host", name),
            "user": get("ansible_user"),
            "port": get("ansible_port"),
            "private_key_file": get("ansible_ssh_private_key_file"),
            "ssh_common_args": get("ansible_ssh_common_args", ""),
        },
    }


def rank_order(groups: Mapping[str, list[str]], view: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The inventory's nodes in rank order: the launcher first (addresses.rank_order)."""
    return addresses.rank_order(list(groups["cluster"]), groups["launcher"][0], view)


def seen_in_run(groups: Mapping[str, list[str]], hostvars: Mapping[str, Any],
                targeted: Iterable[str], answered: Iterable[str]) -> list[Seen]:
    """Every inventory node as this run saw it (`targeted`: ansible_play_hosts_all, `answered`:
    ansible_play_hosts)."""
    targeted, answered = set(targeted), set(answered)
    view = topology_view(groups["cluster"], hostvars)
    launcher = groups["launcher"][0]
    seen = []
    for name in rank_order(groups, view):
        hv = hostvars[name]
        alive = name in answered
        seen.append(Seen(
            settings=node_settings(name, hostvars, launcher, view), targeted=name in targeted, answered=alive,
            cluster_root=hv["cluster_root"] if alive else None,
            learned={field: hv[fact] for field, fact in LEARNED.items()
                     if alive and fact in hv and hv[fact] is not None}))
    return seen


def _resolved(hv: Mapping[str, Any], key: str) -> Any:
    """A variable's value, or None where it needs what only a run learns (facts, say)."""
    try:
        value = hv[key] if key in hv else None
        if isinstance(value, Undefined):
            return None
    except Exception:  # templating raised: the value depends on something not known yet
        return None
    return value


def planned(groups: Mapping[str, list[str]], hostvars: Mapping[str, Any]) -> dict[str, Any]:
    """The record as the inventory alone gives it, before any run (`invoke train --dry-run` on a
    cluster not provisioned yet): every node's settings and, when the inventory resolves it
    without facts, its cluster_root; nothing learned."""
    view = topology_view(groups["cluster"], hostvars)
    launcher = groups["launcher"][0]
    return record(launcher, [Seen(settings=node_settings(name, hostvars, launcher, view),
                                  cluster_root=_resolved(hostvars[name], "cluster_root"))
                             for name in rank_order(groups, view)], None, cables_of(groups, view),
                  asked_backend(groups, view))


def asked_backend(groups: Mapping[str, list[str]], view: Mapping[str, Mapping[str, Any]]) -> str:
    """The inventory's cluster_backend (validation made it one for the cluster): auto by default."""
    return str(view.get(groups["launcher"][0], {}).get("cluster_backend") or "auto")
