"""Ansible filter that builds the recorded layout; the logic lives in mlxcluster.describe.record."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from mlxcluster.describe.inventory import topology_view
from mlxcluster.describe.record import asked_backend, cables_of, planned, record, seen_in_run


def cluster_record(groups: Mapping[str, list[str]], hostvars: Any, targeted: Iterable[str],
                   answered: Iterable[str], previous: str | None = None) -> dict[str, Any]:
    """``{{ groups | cluster_record(hostvars, ansible_play_hosts_all, ansible_play_hosts,
    previous_json) }}``: build/<inventory>/cluster.json, this run's news merged into the last."""
    view = topology_view(groups["cluster"], hostvars)
    return record(groups["launcher"][0], seen_in_run(groups, hostvars, targeted, answered),
                  previous, cables_of(groups, view), asked_backend(groups, view))


class FilterModule:
    def filters(self) -> dict[str, Any]:
        return {"cluster_record": cluster_record,
                # {{ groups | cluster_plan(hostvars) }}: the layout from the inventory alone
                "cluster_plan": planned}
