"""The cluster a dry run plans on when provisioning has not (fully) run yet.

`invoke train --dry-run` shows the whole run before anything is set up: the layout then comes
from the inventory alone (rendered by playbooks/render.yml, as `invoke hostfile` does, into a
scratch folder: the build folder is provisioning's), and each value only provisioning learns is
shown as a placeholder that the plan's header explains.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from mlxcluster.describe.cluster import Cluster, Node, NotReady, Recorded, recorded
from mlxcluster.paths import build_dir_for
from mlxcluster.provision import ansible

# A node's value that provisioning fills in: its placeholder in the plan, and where it comes from.
FILLED_IN: dict[str, tuple[str, str]] = {
    "cluster_root": ("@CLUSTER_ROOT@", "cluster_root: by default ~/mlx-cluster of the connecting "
                     "user, known once provisioning gathers facts (set it in the inventory to see "
                     "it here)"),
    "venv": ("@VENV@", "the venv with the pinned mlx and mlx-lm (roles/python_env, "
             "python_env_dir: cluster_root/venv by default)"),
    "env_file": ("@ENV_FILE@", "the env file every rank sources (roles/python_env, "
                 "python_env_env_file: cluster_root/env.sh by default)"),
    "openmpi_prefix": ("@OPENMPI_PREFIX@", "Open MPI's prefix (roles/openmpi: /usr on Linux, "
                       "Homebrew's on macOS)"),
}


def from_inventory(inventory: str) -> Cluster:
    """The layout the inventory alone gives: settings, and cluster_root where it needs no facts.
    A UserError with validation's own message, alone, when it refuses the inventory."""
    with tempfile.TemporaryDirectory(prefix="mlx-plan-") as scratch:
        plan = Path(scratch) / "cluster.json"
        ansible.timed_run(ansible.render_hostfiles(inventory, scratch, plan=plan), env=ansible.JSON_OUTPUT)
        return Cluster.load(plan)


def filled_in(cluster: Cluster) -> tuple[Cluster, list[str]]:
    """`cluster` with a placeholder for every value provisioning has not recorded yet, and one
    line per placeholder used, saying where its value will come from."""
    used: dict[str, str] = {}

    def fill(node: Node) -> Node:
        missing = {name: FILLED_IN[name][0] for name in FILLED_IN if not getattr(node, name)}
        for name in missing:
            used[name] = f"{FILLED_IN[name][0]}: {FILLED_IN[name][1]}"
        return dataclasses.replace(node, **missing)

    return (dataclasses.replace(cluster, nodes=tuple(fill(n) for n in cluster.nodes)),
            [used[name] for name in FILLED_IN if name in used])


def layout(inventory: str) -> tuple[Recorded, list[str]]:
    """What a dry run plans on: the recorded layout (provisioned or not), else the inventory's;
    with the lines that say which values provisioning still fills in."""
    build = build_dir_for(inventory)
    notes = []
    if not (build / "cluster.json").exists():
        notes += ["not provisioned yet: the layout comes from the inventory alone",
                  "the model: provisioning installs cluster_model on every training node "
                  "(playbooks/model.yml) and a run then only verifies that copy; this plan "
                  "copies the controller's, as a run given --model does"]
        cluster = from_inventory(inventory)
    else:
        try:
            cluster = recorded(inventory).cluster
        except NotReady as exc:  # a real run stops here; the plan still shows what it would do
            notes.append(f"a real run would stop now: {exc}")
            cluster = recorded(inventory, ready=False).cluster
    cluster, filled = filled_in(cluster)
    return Recorded(inventory, cluster, build), notes + filled
