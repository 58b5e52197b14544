"""Ansible filters over the cluster inventory; the logic lives in mlxcluster.inventory."""

from __future__ import annotations

from typing import Any

from jinja2 import Undefined

from mlxcluster.inventory import cluster_root_error, inventory_errors, link_errors

LINK_KEYS = ("thunderbolt_ip", "thunderbolt_prefix", "thunderbolt_interface", "thunderbolt_mtu")


def cluster_inventory_errors(groups: dict[str, list[str]], hostvars: Any) -> list[str]:
    """``{{ groups | cluster_inventory_errors(hostvars) }}``: problems found, one per line."""
    keys = (*LINK_KEYS, "mpi_slots", "ansible_host", "ansible_user", "ansible_connection",
            "thunderbolt_topology", "thunderbolt_links", "thunderbolt_link_pool", "cluster_backend")
    hosts = sorted(set(groups.get("cluster", [])) | set(groups.get("launcher", [])))
    unresolved: list[str] = []
    plain: dict[str, dict[str, Any]] = {}
    for host in hosts:
        if host not in hostvars:
            continue
        plain[host] = {}
        for key in keys:
            if key not in hostvars[host]:
                continue
            try:
                value = hostvars[host][key]
                if isinstance(value, Undefined):
                    str(value)  # raises the undefined error, naming the variable
            except Exception as exc:  # whatever templating raised, said with the host
                unresolved.append(f"{host}: {key} cannot be resolved ({exc}); write it out in the "
                                  "inventory, or define what it refers to")
                continue
            plain[host][key] = value
    return unresolved or inventory_errors(groups, plain)


def cluster_link_errors(settings: dict[str, Any]) -> list[str]:
    """``{{ {host: {thunderbolt_ip: ..., ...}, ...} | cluster_link_errors }}``: the link's problems."""
    plain = {host: {key: value[key] for key in LINK_KEYS if value.get(key) is not None}
             for host, value in settings.items()}
    return link_errors(plain)


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"cluster_inventory_errors": cluster_inventory_errors,
                # {{ inventory_hostname | cluster_root_problem(cluster_root) }}: None when fine
                "cluster_root_problem": cluster_root_error,
                "cluster_link_errors": cluster_link_errors}
