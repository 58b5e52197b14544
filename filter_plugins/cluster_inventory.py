"""Ansible filters over the cluster inventory; the logic lives in mlxcluster.inventory."""

from __future__ import annotations

from typing import Any

from mlxcluster.inventory import inventory_errors


def cluster_inventory_errors(groups: dict[str, list[str]], hostvars: Any) -> list[str]:
    """``{{ groups | cluster_inventory_errors(hostvars) }}``: problems found, one per line."""
    keys = ("thunderbolt_ip", "thunderbolt_prefix", "thunderbolt_interface", "mpi_slots")
    hosts = set(groups.get("cluster", [])) | set(groups.get("launcher", []))
    plain = {
        host: {key: hostvars[host][key] for key in keys if key in hostvars[host]}
        for host in hosts if host in hostvars
    }
    return inventory_errors(groups, plain)


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"cluster_inventory_errors": cluster_inventory_errors}
