"""Ansible filters for the ssh_mesh role; the logic lives in mlxcluster.describe.known_hosts."""

from __future__ import annotations

from typing import Any

from mlxcluster.describe.known_hosts import block_lines, missing_keys, pinned

BEGIN, END = "BEGIN", "END"


def ssh_mesh_known_hosts(hosts: list[str], hostvars: Any, play_hosts: list[str],
                         existing: str, marker: str) -> str:
    """``{{ groups['cluster'] | ssh_mesh_known_hosts(hostvars, ansible_play_hosts, text,
    marker) }}``: the block of pinned host keys, as blockinfile's `block`."""
    # Ansible works out all of a host's variables on every hostvars[host]: once per host.
    seen = {host: hostvars[host] for host in dict.fromkeys([*play_hosts, *hosts])}
    fresh = {host: list(seen[host]["__ssh_mesh_known_hosts_lines"]) for host in play_hosts
             if "__ssh_mesh_known_hosts_lines" in seen[host]}
    away = {host: [str(name) for name in (host, seen[host].get("ansible_host"),
                                         seen[host].get("thunderbolt_ip")) if name]
            for host in hosts if host not in fresh}
    previous = block_lines(existing, marker.replace("{mark}", BEGIN),
                           marker.replace("{mark}", END))
    return "\n".join(pinned(hosts, fresh, away, previous))


def ssh_mesh_missing_keys(keys: list[str], authorized: str | None) -> list[str]:
    """``{{ keys | ssh_mesh_missing_keys(authorized_keys_text) }}``: the keys still to authorize."""
    return missing_keys(keys, authorized or "")


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"ssh_mesh_known_hosts": ssh_mesh_known_hosts,
                "ssh_mesh_missing_keys": ssh_mesh_missing_keys}
