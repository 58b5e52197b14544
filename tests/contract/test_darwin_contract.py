"""Darwin CONTRACT test: what the roles' macOS branches ask macOS to do.

There is no Mac here. Two lab nodes (Debian network namespaces) are made to look like
Apple Silicon Macs to Ansible (facts: Darwin, MacOSX, arm64) and get recording
stand-ins for the macOS tools the roles call (``brew``, ``networksetup``, ``pmset``,
``sysctl`` for ``iogpu.*``, ``plutil``, ``dscl``, ``ifconfig``: tests/contract/standins/). The
stand-ins answer from a small state file, refuse what the real tools refuse (brew as
root, settings changes without root) and log every call.

Two (node1 and node2 of the session's stand-in Macs: stand_in_macs.py), because ssh_mesh
only acts among several nodes and thunderbolt checks the link by pinging the other node.
The contract play (tests/contract/darwin.yml) then runs three times: ``--check`` on the
fresh "Macs", a first run, and a second run. The asserts are on the call logs: the right
commands, as the right user, probe before change, each change issued once across both
runs, and nothing changed by ``--check`` or by the second run. This proves the roles'
Darwin task files are right and idempotent against the tools' documented behaviour; it
does not prove that macOS behaves like the stand-ins.

Roles whose Darwin branch does not exist yet are left out of the play, and their tests
are skipped with a reason saying so.
"""

from __future__ import annotations

import json
import plistlib
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from mlxcluster.lab import cache
from mlxcluster.lab.hosts import Lab
from tests.contract.stand_in_macs import (
    ADMIN,
    CONTRACT_ROOT,
    HERE,
    REPO,
    Call,
    StandInMacs,
    ansible_playbook,
    node_shell,
    recap,
)

pytestmark = pytest.mark.cluster

NODES = (1, 2)
# In site.yml's order. A role takes part once it has a Darwin branch.
ROLES = ("macos", "thunderbolt", "ssh_mesh", "openmpi", "python_env")
GPU_WIRED_LIMIT_MB = 8192
RUNS = ("check", "first", "second")


def has_darwin_branch(role: str) -> bool:
    tasks = REPO / "roles" / role / "tasks"
    if role == "macos":
        return (tasks / "main.yml").exists()
    return any(tasks.glob("*Darwin*.yml"))


COVERED = tuple(role for role in ROLES if has_darwin_branch(role))


def needs_role(role: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        role not in COVERED,
        reason=f"roles/{role} has no Darwin branch yet (no tasks/*Darwin*.yml): not in the play",
    )


@dataclass(frozen=True)
class Contract:
    """What the three runs left behind."""

    recaps: dict[str, dict[str, dict[str, int]]]
    calls: list[Call]
    lab: Lab

    def in_run(self, run: str) -> list[Call]:
        return [call for call in self.calls if call.run == run]

    def issued(self, command: str, host: str) -> list[Call]:
        return [c for c in self.calls if c.command == command and c.host == host]

    def commands(self, run: str, tool: str, host: str) -> list[str]:
        return [c.command for c in self.in_run(run) if c.tool == tool and c.host == host]

    def ssh(self, node: int, command: str) -> str:
        return node_shell(self.lab, node, command)


def write_contract_inventory(macs: StandInMacs) -> Path:
    """node1 and node2 as the Macs of a cluster on the Thunderbolt Bridge."""
    return macs.write_inventory("inventory", {
        f"node{i}": {"ansible_host": macs.lab.mgmt_ip(i), "thunderbolt_ip": macs.lab.tb_ip(i),
                     "mpi_slots": 1} for i in NODES}, {
        # The lab node has no registry access: pip installs from the host's wheelhouse.
        "python_env_pip_extra_args": cache.PIP_ARGS,
        # On a Mac the mlx wheel brings Metal; on this Linux node it needs a CPU backend.
        "python_env_extra_packages": ["mlx-cpu=={{ python_env_mlx_version }}"],
        "macos_keep_awake": True,
        "macos_gpu_wired_limit_mb": GPU_WIRED_LIMIT_MB,
    })


@pytest.fixture(scope="module")
def contract(stand_in_macs: StandInMacs) -> Contract:
    """The three runs on node1 and node2 of the stand-in Macs, over the Thunderbolt Bridge."""
    if not COVERED:
        pytest.skip("no role has a Darwin branch yet")
    lab = stand_in_macs.lab
    inventory = write_contract_inventory(stand_in_macs)
    recaps: dict[str, dict[str, dict[str, int]]] = {}
    for run in RUNS:
        extra = {"contract_run": run, "contract_roles": list(COVERED)}
        check = ["--check"] if run == "check" else []
        output = ansible_playbook(inventory, HERE / "darwin.yml", *check,
                                  "-e", json.dumps(extra), facts_dir=stand_in_macs.facts_dir)
        recaps[run] = recap(output, NODES)
    calls = [call for call in stand_in_macs.calls(NODES) if call.run in RUNS]
    return Contract(recaps=recaps, calls=calls, lab=lab)


# --- every role -------------------------------------------------------------------------

def test_every_run_succeeds_on_every_node(contract: Contract) -> None:
    for run in RUNS:
        for host, counts in contract.recaps[run].items():
            assert (counts["failed"], counts["unreachable"]) == (0, 0), (run, host)


def test_second_run_changes_nothing(contract: Contract) -> None:
    assert {host: c["changed"] for host, c in contract.recaps["second"].items()} == {
        f"node{i}": 0 for i in NODES}
    assert [(c.host, c.command) for c in contract.in_run("second") if c.changes_something] == []


def test_check_mode_on_fresh_macs_changes_nothing(contract: Contract) -> None:
    assert contract.in_run("check"), "the check run issued no probe at all"
    assert [(c.host, c.command) for c in contract.in_run("check") if c.changes_something] == []


def test_every_stand_in_call_succeeds(contract: Contract) -> None:
    # A failing call is a command the real tool would refuse too (e.g. a change without
    # root) or one the stand-in does not know: either way the role needs a look.
    assert [(c.host, c.command, c.user, c.rc) for c in contract.calls if c.rc != 0] == []


def test_changes_run_as_root_and_brew_never_does(contract: Contract) -> None:
    for call in contract.calls:
        if call.tool == "brew":
            assert call.uid != 0, f"{call.host}: {call.command} ran as root"
        elif call.changes_something:
            assert call.uid == 0, f"{call.host}: {call.command} ran as {call.user}, not root"


def test_every_change_is_issued_once_across_both_runs(contract: Contract) -> None:
    changes = [(c.host, c.command) for c in contract.calls if c.changes_something]
    assert sorted(changes) == sorted(set(changes))


# --- macos ------------------------------------------------------------------------------

@needs_role("macos")
@pytest.mark.parametrize("node", NODES)
def test_macos_keeps_the_mac_awake_after_reading_its_settings(contract: Contract,
                                                              node: int) -> None:
    host = f"node{node}"
    assert contract.commands("first", "pmset", host) == [
        "pmset -g custom", "pmset -g", "pmset -a sleep 0", "pmset -a disablesleep 1"]
    assert contract.commands("second", "pmset", host) == ["pmset -g custom", "pmset -g"]
    # Display sleep is left as it was.
    assert not [c for c in contract.calls if c.tool == "pmset" and "displaysleep" in c.argv]


@needs_role("macos")
@pytest.mark.parametrize("node", NODES)
def test_macos_raises_the_gpu_wired_limit_once(contract: Contract, node: int) -> None:
    host = f"node{node}"
    probe = "sysctl -n iogpu.wired_limit_mb"
    change = f"sysctl iogpu.wired_limit_mb={GPU_WIRED_LIMIT_MB}"
    assert contract.commands("first", "sysctl", host) == [probe, change]
    assert contract.commands("second", "sysctl", host) == [probe]
    assert [c.user for c in contract.issued(change, host)] == ["root"]


@needs_role("macos")
@pytest.mark.parametrize("node", NODES)
def test_macos_persists_the_limit_with_a_valid_launchdaemon(contract: Contract,
                                                            node: int) -> None:
    plist_path = f"{CONTRACT_ROOT}/Library/LaunchDaemons/org.mlx-cluster.iogpu-wired-limit.plist"
    plist = plistlib.loads(contract.ssh(node, f"cat {plist_path}").encode())
    assert plist == {
        "Label": "org.mlx-cluster.iogpu-wired-limit",
        "ProgramArguments": ["/usr/sbin/sysctl", f"iogpu.wired_limit_mb={GPU_WIRED_LIMIT_MB}"],
        "RunAtLoad": True,
    }
    assert contract.ssh(node, f"stat -c '%U:%G %a' {plist_path}").strip() == "root:wheel 644"
    # Written once, after `plutil -lint` accepted it.
    lints = [c for c in contract.calls if c.tool == "plutil" and c.host == f"node{node}"]
    assert [(c.run, c.argv[0], c.user) for c in lints] == [("first", "-lint", "root")]


# --- thunderbolt ------------------------------------------------------------------------

@needs_role("thunderbolt")
@pytest.mark.parametrize("node", NODES)
def test_thunderbolt_sets_the_bridge_address_once(contract: Contract, node: int) -> None:
    host = f"node{node}"
    setmanual = shlex.join(["networksetup", "-setmanual", "Thunderbolt Bridge",
                            contract.lab.tb_ip(node), "255.255.255.0"])
    assert [(c.run, c.user) for c in contract.issued(setmanual, host)] == [("first", "root")]
    first = contract.commands("first", "networksetup", host)
    assert "networksetup -getinfo 'Thunderbolt Bridge'" in first[:first.index(setmanual)], (
        "no -getinfo probe before -setmanual")
    # The MTU already matched (1500): read, never set.
    assert "networksetup -getMTU bridge0" in first
    assert not [c for c in contract.calls if c.tool == "networksetup" and c.argv[0] == "-setMTU"]


# --- ssh_mesh ---------------------------------------------------------------------------

@needs_role("ssh_mesh")
@pytest.mark.parametrize("node", NODES)
def test_ssh_mesh_keeps_the_key_pair_in_the_admins_home(contract: Contract, node: int) -> None:
    # The home comes from the account database (getpwnam, which macOS answers from Directory
    # Services), read with the rest of the role's files in one round trip: no dscl call.
    home = contract.ssh(node, f"getent passwd {ADMIN}").strip().split(":")[5]
    files = set(contract.ssh(node, f"ls {home}/.ssh").split())
    assert {"authorized_keys", "id_ed25519", "id_ed25519.pub", "known_hosts"} <= files, files
    for run in RUNS:
        assert contract.commands(run, "dscl", f"node{node}") == [], run


@needs_role("ssh_mesh")
def test_ssh_mesh_lets_the_admin_reach_the_other_mac(contract: Contract) -> None:
    # The mesh the role built, used for real: node1's admin to node2 by inventory name.
    # The admin account runs ssh through su: lab nodes have no sudo.
    answer = contract.ssh(1, f"su - {ADMIN} -c 'ssh -o BatchMode=yes node2 hostname'")
    assert answer.strip() == "node2"


# --- openmpi ----------------------------------------------------------------------------

@needs_role("openmpi")
@pytest.mark.parametrize("node", NODES)
def test_openmpi_installs_the_formula_once_as_the_admin(contract: Contract, node: int) -> None:
    host = f"node{node}"
    installs = contract.issued("brew install open-mpi", host)
    assert [(c.run, c.user) for c in installs] == [("first", ADMIN)]
    first = contract.commands("first", "brew", host)
    assert first.index("brew info --json=v2 open-mpi") < first.index("brew install open-mpi")
    assert "brew info --json=v2 open-mpi" in contract.commands("check", "brew", host)


# --- python_env -------------------------------------------------------------------------

@needs_role("python_env")
@pytest.mark.parametrize("node", NODES)
def test_python_env_builds_the_venv_from_homebrew_python(contract: Contract, node: int) -> None:
    formula = yaml.safe_load((REPO / "roles/python_env/defaults/main.yml").read_text())[
        "python_env_brew_python_formula"]
    installs = contract.issued(f"brew install {formula}", f"node{node}")
    assert [(c.run, c.user) for c in installs] == [("first", ADMIN)]
    # The venv comes from that formula's Python, at Apple Silicon's Homebrew prefix.
    config = contract.ssh(node, f"cat /home/{ADMIN}/mlx-cluster/venv/pyvenv.cfg")
    python = f"/opt/homebrew/opt/{formula}/bin/{formula.replace('@', '')}"
    assert f"command = {python} -m venv" in config, config
