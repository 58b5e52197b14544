"""The stand-in Macs the Darwin contracts run on, and how their runs are read.

Lab 3's nodes, each made a stand-in Apple Silicon Mac once per session by prepare.yml (an admin
account, the recording stand-ins of tests/contract/standins/); conftest.py's `stand_in_macs`
brings them up. The nodes are also cabled as a ring, point to point (en2, en3), for links mode:
the bridge contract (test_darwin_contract.py) uses node1 and node2 over the lab's bridge, the links
contract (test_darwin_links_contract.py) all three over their cables. Every stand-in call is in
the node's call log, labelled with the run that made it (MLX_CONTRACT_RUN).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mlxcluster.lab.hosts import Lab, up

# Lab 3 unless a developer runs a second copy beside CI (MLX_CONTRACT_LAB_ID).
LAB_ID = int(os.environ.get("MLX_CONTRACT_LAB_ID", "3"))
NODES = 3
HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
CONTRACT_ROOT = "/opt/mlx-contract"
# The Mac's admin account, as in inventory/example/hosts.yml: not root, reaches root with become.
ADMIN = "mlx"
PLAYBOOK_TIMEOUT = 1800


@dataclass(frozen=True)
class Call:
    """One logged stand-in invocation."""

    host: str
    tool: str
    argv: tuple[str, ...]
    user: str
    uid: int
    run: str
    rc: int

    @property
    def command(self) -> str:
        return shlex.join([self.tool, *self.argv])

    @property
    def changes_something(self) -> bool:
        """Whether the real tool would change the Mac (queries do not)."""
        first = self.argv[0] if self.argv else ""
        if self.tool == "brew":
            return first in {"install", "upgrade", "reinstall", "uninstall", "remove", "rm",
                             "link", "unlink", "update"}
        if self.tool == "networksetup":
            return first.startswith("-set") or first in {"-createnetworkservice",
                                                         "-removenetworkservice"}
        if self.tool == "pmset":
            return first != "-g"
        if self.tool == "sysctl":
            return any("=" in arg for arg in self.argv)
        if self.tool == "rdma_ctl":
            return first != "status"
        if self.tool == "ifconfig":
            return len(self.argv) > 1
        return False


def node_shell(lab: Lab, node: int, command: str) -> str:
    """Run a shell command as root on a lab node, over its own ssh."""
    result = subprocess.run(
        ["ssh", "-i", str(lab.key), "-o", f"UserKnownHostsFile={lab.known_hosts}",
         "-o", "BatchMode=yes", f"root@{lab.mgmt_ip(node)}", command],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert result.returncode == 0, f"{command!r} failed on the node: {result.stderr}"
    return result.stdout


RECAP = re.compile(
    r"^(?P<host>\S+)\s*:\s*ok=(?P<ok>\d+)\s+changed=(?P<changed>\d+)\s+"
    r"unreachable=(?P<unreachable>\d+)\s+failed=(?P<failed>\d+)\s+skipped=(?P<skipped>\d+)",
    re.MULTILINE,
)


def ansible_playbook(inventory: Path, playbook: Path, *args: str, facts_dir: Path) -> str:
    env = {**os.environ, "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(facts_dir),
           "ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0"}
    result = subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "-i", str(inventory), str(playbook), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=PLAYBOOK_TIMEOUT,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{playbook.name} {' '.join(args)} failed:\n{output[-6000:]}"
    return output


def recap(output: str, nodes: Sequence[int]) -> dict[str, dict[str, int]]:
    """PLAY RECAP counts by host: exactly `nodes`."""
    counts = {m["host"]: {key: int(value) for key, value in m.groupdict().items() if key != "host"}
              for m in RECAP.finditer(output)}
    assert sorted(counts) == [f"node{i}" for i in nodes], f"PLAY RECAP:\n{output[-3000:]}"
    return counts


@dataclass(frozen=True)
class StandInMacs:
    """The prepared stand-in Macs of the session."""

    lab: Lab
    work: Path  # the session's folder for inventories
    facts_dir: Path
    root_password: str  # root's, for become (su) as the admin account

    def write_inventory(self, name: str, macs: dict[str, Any], cluster_vars: dict[str, Any]) -> Path:
        """An inventory of `macs` (host: vars) as the Macs of a cluster, node1 the launcher,
        reached as the admin account; `cluster_vars` on top of the shipped defaults."""
        directory = self.work / name
        directory.mkdir(parents=True)
        # darwin.yml is not in playbooks/, so the shipped defaults come in next to this inventory
        # (ranked, like there, below the cluster vars below: ansible.cfg's precedence).
        (directory / "group_vars").symlink_to(REPO / "playbooks" / "group_vars")
        admin = {
            "ansible_user": ADMIN,
            "ansible_ssh_private_key_file": str(self.lab.key),
            "ansible_ssh_common_args": f"-o UserKnownHostsFile={self.lab.known_hosts}",
            "ansible_python_interpreter": "/usr/bin/python3",
            # A Mac's admin reaches root with sudo; lab nodes have no sudo, su does the same job.
            "ansible_become_method": "su",
            "ansible_become_password": self.root_password,
        }
        hosts = {
            "cluster": {"children": {"macs": {"hosts": macs}, "linux": {"hosts": {}}},
                        "vars": {**admin, **cluster_vars}},
            "launcher": {"hosts": {"node1": None}},
        }
        inventory = directory / "hosts.yml"
        inventory.write_text(yaml.safe_dump(hosts, sort_keys=False))
        return inventory

    def calls(self, nodes: Sequence[int]) -> list[Call]:
        """Every stand-in call logged so far on `nodes`."""
        return [Call(host=f"node{i}", tool=e["tool"], argv=tuple(e["argv"]), user=e["user"],
                     uid=e["uid"], run=e["run"], rc=e["rc"])
                for i in nodes
                for e in map(json.loads,
                             node_shell(self.lab, i, f"cat {CONTRACT_ROOT}/calls.jsonl").splitlines())]


def bring_up(work: Path) -> StandInMacs:
    """Lab 3's nodes up and cabled as a ring, each made a stand-in Mac (prepare.yml)."""
    lab = Lab(LAB_ID)
    lab_inventory = up(NODES, LAB_ID, cables="ring")
    macs = StandInMacs(lab=lab, work=work, facts_dir=work / "facts",
                       root_password=secrets.token_urlsafe(18))
    ansible_playbook(
        lab_inventory, HERE / "prepare.yml",
        "-e", json.dumps({"contract_public_key": Path(f"{lab.key}.pub").read_text().strip(),
                          "contract_root_password": macs.root_password}),
        facts_dir=macs.facts_dir,
    )
    return macs
