"""Ansible filters over the cluster inventory and its cabling; the logic lives in
mlxcluster.describe.inventory, .topology and .addresses."""

from __future__ import annotations

from typing import Any

from mlxcluster.describe.addresses import (
    addresses_of,
    contact_address,
    links_hostfile,
    ports_of,
    rank_order,
    reach_from_launcher,
)
from mlxcluster.describe.inventory import (
    LINK_KEYS,
    MODEL_KEYS,
    SHARE_KEYS,
    STAGE_KEYS,
    TOPOLOGY_KEYS,
    cluster_root_error,
    inventory_errors,
    link_errors,
    resolved,
    topology_view,
)
from mlxcluster.describe.topology import mode_of


def cluster_inventory_errors(groups: dict[str, list[str]], hostvars: Any) -> list[str]:
    """``{{ groups | cluster_inventory_errors(hostvars) }}``: problems found, one per line."""
    keys = (*LINK_KEYS, "mpi_slots", "ansible_host", "ansible_user", "ansible_connection", *TOPOLOGY_KEYS,
            *SHARE_KEYS, *MODEL_KEYS, *STAGE_KEYS)
    hosts = sorted(set(groups.get("cluster", [])) | set(groups.get("launcher", [])))
    plain, unresolved = resolved(hosts, hostvars, keys)
    return unresolved or inventory_errors(groups, plain)


def thunderbolt_ports(host: str, cluster: list[str], hostvars: Any) -> list[dict[str, Any]]:
    """``{{ inventory_hostname | thunderbolt_ports(groups['cluster'], hostvars) }}``: the
    interfaces the thunderbolt role configures on this node, and who answers across each."""
    return ports_of(host, list(cluster), topology_view(cluster, hostvars))


def cluster_link_errors(settings: dict[str, Any]) -> list[str]:
    """``{{ {host: {thunderbolt_ip: ..., ...}, ...} | cluster_link_errors }}``: the link's problems."""
    plain = {host: {key: value[key] for key in LINK_KEYS if value.get(key) is not None}
             for host, value in settings.items()}
    return link_errors(plain)


def thunderbolt_mode(cluster: list[str], hostvars: Any) -> str:
    """``{{ groups['cluster'] | thunderbolt_mode(hostvars) }}``: bridge or links."""
    return mode_of(list(cluster), topology_view(cluster, hostvars))


def cluster_address(host: str, cluster: list[str], launcher: str, hostvars: Any) -> str | None:
    """``{{ host | cluster_address(groups['cluster'], groups['launcher'][0], hostvars) }}``: the
    address a node is known by on the cluster link (mlxcluster/describe/addresses.py)."""
    return contact_address(host, list(cluster), launcher, topology_view(cluster, hostvars))


def cluster_addresses(host: str, cluster: list[str], hostvars: Any) -> list[str]:
    """``{{ host | cluster_addresses(groups['cluster'], hostvars) }}``: all its link addresses."""
    return addresses_of(host, list(cluster), topology_view(cluster, hostvars))


def cluster_rank_order(cluster: list[str], launcher: str, hostvars: Any) -> list[str]:
    """``{{ groups['cluster'] | cluster_rank_order(launcher, hostvars) }}``: every host in rank
    order (mlxcluster/describe/addresses.py's rank_order)."""
    return rank_order(list(cluster), launcher, topology_view(cluster, hostvars))


def cluster_links_hostfile(cluster: list[str], launcher: str, hostvars: Any,
                           envs: list[str] | None = None) -> dict[str, Any]:
    """``{{ groups['cluster'] | cluster_links_hostfile(launcher, hostvars, envs) }}``: hosts.json
    in links mode."""
    return links_hostfile(list(cluster), launcher, topology_view(cluster, hostvars), envs or [])


def cluster_reach(host: str, cluster: list[str], launcher: str, hostvars: Any) -> str:
    """``{{ host | cluster_reach(groups['cluster'], launcher, hostvars) }}``: where the launcher
    copies to it (the cluster link where a cable joins them, else the management address)."""
    return reach_from_launcher(host, list(cluster), launcher, topology_view(cluster, hostvars))


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"cluster_inventory_errors": cluster_inventory_errors,
                # {{ inventory_hostname | cluster_root_problem(cluster_root) }}: None when fine
                "cluster_root_problem": cluster_root_error,
                "cluster_link_errors": cluster_link_errors,
                "thunderbolt_ports": thunderbolt_ports,
                "thunderbolt_mode": thunderbolt_mode,
                "cluster_address": cluster_address,
                "cluster_addresses": cluster_addresses,
                "cluster_rank_order": cluster_rank_order,
                "cluster_links_hostfile": cluster_links_hostfile,
                "cluster_reach": cluster_reach}
