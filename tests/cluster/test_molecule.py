"""Every molecule scenario of every role (roles/<role>/molecule/<scenario>) on real lab hosts.

Each role has its `default` scenario; a role with variants has one more per variant (thunderbolt's
`links`: per-cable networks). `molecule test -s <scenario>` in the role directory: fresh lab hosts
(molecule/shared/create.yml), prepare, converge, a second converge that must change nothing, the
scenario's checks (verify.yml), and the lab taken down again (molecule/shared/destroy.yml).

CI runs the scenarios whose checks the session's nodes cannot hold (SESSION_VERIFIED in
conftest.py: the others' verify.yml runs in test_site.py and test_train_links.py on the session's
nodes); MLX_MOLECULE=all runs every one, as for work on a role. The scenarios run two at a time,
each on a lab of its own (the two numbers after the test lab's, so that a lab left up by the other
lab tests is never met): a scenario is mostly ansible waiting on its hosts, so two share this
machine's cores well. `invoke test` runs this module in a pytest session of its own, after the
other lab tests (mlxcluster/devtools.py).
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from mlxcluster.lab import cache, hosts
from tests.cluster.conftest import SESSION_VERIFIED

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
ROLES = ["thunderbolt", "ssh_mesh", "openmpi", "python_env", "model", "hostfile", "macos", "apt_packages"]
# The two lab numbers after the one the other cluster tests use (see conftest.py): each scenario
# brings one up and takes it down again, never meeting theirs. (The contract tests' is 3.)
LAB_ID = int(os.environ.get("MLX_TEST_LAB_ID", "5"))
LAB_IDS = ((LAB_ID + 1) % 10, (LAB_ID + 2) % 10)


def scenarios() -> list[tuple[str, str]]:
    """(role, scenario) of every scenario on disk: the roles in ROLES' order, then any other, each
    role's default scenario first."""
    found = sorted((p.parts[-4], p.parts[-2]) for p in (REPO / "roles").glob("*/molecule/*/molecule.yml"))
    order = {role: i for i, role in enumerate(ROLES)}
    return sorted(found, key=lambda rs: (order.get(rs[0], len(ROLES)), rs[0], rs[1] != "default", rs[1]))


def selected() -> list[tuple[str, str]]:
    """The scenarios this run tests: every one with MLX_MOLECULE=all, else those site.yml's nodes
    do not cover."""
    every = scenarios()
    if os.environ.get("MLX_MOLECULE") == "all":
        return every
    return [scenario for scenario in every if scenario not in SESSION_VERIFIED]


def run_scenario(role: str, scenario: str, labs: queue.Queue[int]) -> subprocess.CompletedProcess:
    """`molecule test -s <scenario>` in the role's directory, on a lab taken from `labs` (given
    back after)."""
    lab = labs.get()
    try:
        # molecule runs ansible-config and ansible-playbook from PATH.
        env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
               "MLX_LAB_ID": str(lab), "ANSIBLE_FORCE_COLOR": "0", "NO_COLOR": "1"}
        env.pop("MOLECULE_EPHEMERAL_DIRECTORY", None)
        proc = subprocess.run([str(VENV_BIN / "molecule"), "test", "-s", scenario], cwd=REPO / "roles" / role,
                              env=env, capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            # molecule destroys after a failed step, but not when it dies itself.
            hosts.down(lab)
        return proc
    finally:
        labs.put(lab)


@pytest.fixture(scope="module")
def scenario_runs() -> Iterator[dict[tuple[str, str], Future[subprocess.CompletedProcess]]]:
    """Every scenario started, two at a time; each test waits for its own."""
    if os.geteuid() != 0:
        pytest.skip("molecule scenarios need root (network namespaces)")
    # Lab hosts install from the machine's caches: fill them once (quick when full).
    cache.prepare_offline_cache()
    labs: queue.Queue[int] = queue.Queue()
    for lab in LAB_IDS:
        labs.put(lab)
    with ThreadPoolExecutor(max_workers=len(LAB_IDS)) as pool:
        runs = {rs: pool.submit(run_scenario, *rs, labs) for rs in selected()}
        try:
            yield runs
        finally:
            for run in runs.values():
                run.cancel()


def test_every_role_has_a_scenario() -> None:
    roles = sorted(p.name for p in (REPO / "roles").iterdir() if (p / "tasks").is_dir())
    missing = [r for r in roles if not (REPO / "roles" / r / "molecule/default/molecule.yml").is_file()]
    assert not missing, f"roles without a molecule scenario: {missing}"
    assert set(ROLES) <= set(roles)
    # A scenario folder without its molecule.yml would be left out of the runs below unnoticed.
    folders = sorted(str(p.relative_to(REPO)) for p in (REPO / "roles").glob("*/molecule/*") if p.is_dir())
    assert folders == [f"roles/{role}/molecule/{scenario}" for role, scenario in sorted(scenarios())]


def test_ci_leaves_out_only_the_scenarios_whose_checks_run_on_the_site_nodes(monkeypatch) -> None:
    left_out = set(scenarios()) - set(selected())
    assert left_out == set(SESSION_VERIFIED)
    assert ("macos", "default") in selected()
    monkeypatch.setenv("MLX_MOLECULE", "all")
    assert selected() == scenarios()


def test_molecule_finds_the_shared_base_config_from_a_role() -> None:
    # Each molecule.yml holds only what differs from .config/molecule/config.yml, which
    # molecule looks up from its working directory (the role's) at the repository root.
    proc = subprocess.run(
        [sys.executable, "-c", "from molecule.util import lookup_config_file as find; "
         "print(find('.config/molecule/config.yml'))"],
        cwd=REPO / "roles" / ROLES[0], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == str(REPO / ".config/molecule/config.yml"), proc.stderr


@pytest.mark.parametrize(("role", "scenario"), [pytest.param(*rs, id="-".join(rs)) for rs in selected()])
def test_molecule_scenario_passes(role: str, scenario: str, scenario_runs) -> None:
    proc = scenario_runs[role, scenario].result()
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "idempotence: Executed: Successful" in output, output[-3000:]
    assert "verify: Executed: Successful" in output, output[-3000:]
