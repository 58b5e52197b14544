"""The labs the lab tests run on, and the groups `invoke test` keeps whole on one pytest-xdist worker.

Two fresh lab clusters for the session, each with its modules in the order they run (a module of
tests/cluster not named runs on the cluster lab after them, in file order):
- the cluster lab, three nodes: test_site.py wants them fresh (it checks the first provisioning, and
  adds a fourth node), test_restarts.py trains on the three provisioned nodes (the fourth stopped,
  then back), and test_train_links.py cables them in a ring;
- the training lab, two nodes of its own provisioned once (tests/cluster/conftest.py's
  `provisioned`): test_docs.py's dry runs, then test_run_job.py, test_benches.py, test_plan.py and
  test_train.py, which stops node2 for good last.
The stand-in Macs (tests/contract) and the molecule scenarios have labs of their own. Each group's
tests share a lab, so they stay together on one worker, in their order, and the groups run side by
side (LabScheduling in tests/conftest.py). A unit test module is a group of its own: its module
fixtures (a reference run trained once) are made on one worker, and the modules spread over the
workers the labs leave free. Those that start ranks here on MLX's ring take ports of their
worker's own (tests/unit/rings.py): two on the same ports reset each other's connections.
"""

from __future__ import annotations

from pathlib import PurePosixPath

LABS = {"cluster": ("test_site.py", "test_restarts.py", "test_train_links.py"),
        "training": ("test_docs.py", "test_run_job.py", "test_benches.py", "test_plan.py", "test_train.py")}
MOLECULE_MODULE = "test_molecule.py"


def group_of(nodeid: str) -> str | None:
    """The group of a test by its node id (tests/<folder>/<module>::...): its lab's, or for a unit
    test its module's; None for a test outside them."""
    module_path = nodeid.split("::")[0]
    parts = PurePosixPath(module_path).parts
    if len(parts) >= 2 and parts[:2] == ("tests", "unit"):
        return module_path
    if len(parts) != 3 or parts[0] != "tests":
        return None
    folder, module = parts[1], parts[2]
    if folder == "contract":
        return "contract"
    if folder != "cluster":
        return None
    if module == MOLECULE_MODULE:
        return "molecule"
    return next((lab for lab, modules in LABS.items() if module in modules), "cluster")
