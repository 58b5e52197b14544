"""Fixtures for tests on a lab cluster: real Debian hosts in network namespaces."""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from mlxcluster import local, paths
from mlxcluster.lab import hosts
from mlxcluster.launch import runs
from mlxcluster.provision import ansible
from tests.labs import LABS

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
# Tests use their own lab number, so a developer's lab 0 is never touched.
TEST_LAB_ID = int(os.environ.get("MLX_TEST_LAB_ID", "5"))


# The session's two labs and their modules' order: tests/labs.py.
TRAINING_LAB_ID = (TEST_LAB_ID + 3) % 10  # the molecule scenarios take the two after TEST_LAB_ID
# The molecule scenarios (roles/<role>/molecule/<scenario>) whose checks hold on the session's nodes
# once site.yml has converged them: test_site.py runs each one's verify.yml on its three nodes as
# the bridge left them (SITE_VERIFIED), test_train_links.py on the same nodes cabled in a ring
# (LINKS_VERIFIED), and test_molecule.py leaves these scenarios to MLX_MOLECULE=all. Each would
# bring up two or three more lab hosts and install them again, the venv with MLX twice: a third of
# CI's time for checks that hold as well on the session's nodes. The one left, macos, checks that
# the role writes nothing on a Linux node, from a mark made before it runs.
SITE_VERIFIED = ("thunderbolt", "ssh_mesh", "openmpi", "python_env", "model", "hostfile", "apt_packages")
LINKS_VERIFIED = (("thunderbolt", "links"),)
SESSION_VERIFIED = (*((role, "default") for role in SITE_VERIFIED), *LINKS_VERIFIED)

LAB_ORDER = (*LABS["cluster"], *LABS["training"])


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    rank = {name: n for n, name in enumerate(LAB_ORDER)}

    def place(item: pytest.Item) -> int:
        # Only this folder's modules move (others after them, as in file order); the sort is
        # stable, so tests keep their order within each.
        return rank.get(item.path.name, len(LAB_ORDER)) if item.path.parent == here else len(LAB_ORDER) + 1

    items.sort(key=place)
    if os.geteuid() != 0:
        skip = pytest.mark.skip(reason="lab-cluster tests need root (network namespaces)")
        for item in items:
            if "cluster" in item.keywords:
                item.add_marker(skip)


@dataclass
class PlaybookRun:
    """One ansible-playbook run, digested from its JSON output by the product's own reader
    (ansible.Recap). A run whose recap cannot be read has no stats, changes or failures to offer:
    asking for them fails the test (an idempotence check on an unreadable recap would otherwise
    pass whatever the run did)."""

    returncode: int
    stdout: str
    stderr: str

    @classmethod
    def of(cls, proc: subprocess.CompletedProcess) -> PlaybookRun:
        return cls(proc.returncode, proc.stdout, proc.stderr)

    @functools.cached_property
    def recap(self) -> ansible.Recap:
        """Read once: stats, changed and failures each ask for it."""
        try:
            return ansible.Recap.read(self.stdout, self.stderr)
        except ansible.UnreadableRecap as unreadable:
            raise AssertionError(f"exit {self.returncode}: {unreadable}") from None

    def results(self) -> Iterator[tuple[str, str, dict[str, Any]]]:
        return self.recap.results()

    @property
    def stats(self) -> dict[str, dict[str, int]]:
        """host -> counters from the run's stats."""
        return self.recap.stats

    @property
    def changed(self) -> dict[str, list[str]]:
        """host -> names of the tasks that reported `changed`."""
        return self.recap.changed_tasks

    @property
    def failures(self) -> dict[str, list[str]]:
        """host -> messages of failed/unreachable results."""
        return self.recap.failures


@dataclass
class LabCluster:
    lab: hosts.Lab
    inventory: Path
    facts_dir: Path
    # cluster_model for site.yml's model play (the session's tiny model: CI stays fast)
    model: Path | None = None

    def env(self) -> dict[str, str]:
        return local.tool_env({**hosts.ansible_env(self.facts_dir), **ansible.JSON_OUTPUT})

    def playbook(self, *args: str, inventory: Path | None = None,
                 check: bool = False) -> PlaybookRun:
        """Run site.yml (or args) and digest its JSON output."""
        cmd = ansible.provision(inventory or self.inventory, check=check)
        if self.model:
            cmd += ["-e", f"cluster_model={self.model}"]
        cmd += list(args)
        proc = subprocess.run(cmd, cwd=REPO, env=self.env(), capture_output=True, text=True)
        return PlaybookRun.of(proc)

    def verify(self, *scenarios: tuple[str, str], **extra_vars: str) -> PlaybookRun:
        """The molecule checks of each (role, scenario) (their verify.yml) on these nodes, in one
        ansible-playbook run (one start, one connection per node, for all of them), with the
        shipped defaults as molecule gives them: playbooks/group_vars beside the inventory (the
        lab's settings, its `cluster` group's vars, still win over them)."""
        with tempfile.TemporaryDirectory() as folder:
            inventory = Path(folder) / self.inventory.name
            inventory.symlink_to(self.inventory)
            (Path(folder) / "group_vars").symlink_to(REPO / "playbooks" / "group_vars")
            playbook = Path(folder) / "verify.yml"
            checks = [REPO / "roles" / role / "molecule" / name / "verify.yml" for role, name in scenarios]
            playbook.write_text(yaml.safe_dump([{"ansible.builtin.import_playbook": str(c)} for c in checks]))
            cmd = ansible.ansible_playbook(str(playbook), inventory, extra_vars=extra_vars)
            proc = subprocess.run(cmd, cwd=REPO, env=self.env(), capture_output=True, text=True)
        return PlaybookRun.of(proc)

    def ssh(self, node: int, command: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run a command on a lab node as root over its management link."""
        return subprocess.run(
            ["ssh", "-i", str(self.lab.key), "-o", f"UserKnownHostsFile={self.lab.known_hosts}",
             "-o", "BatchMode=yes", f"root@{self.lab.mgmt_ip(node)}", command],
            capture_output=True, text=True, timeout=timeout)


@contextmanager
def fresh_lab(tmp_path_factory: pytest.TempPathFactory, nodes: int,
              lab_id: int = TEST_LAB_ID) -> Iterator[LabCluster]:
    """A lab cluster of `nodes` fresh hosts with its own fact cache, torn down afterwards."""
    facts = tmp_path_factory.mktemp("facts")
    try:
        with hosts.fresh(nodes, lab_id) as inventory:
            yield LabCluster(hosts.Lab(lab_id), inventory, facts)
    finally:
        shutil.rmtree(facts, ignore_errors=True)


@pytest.fixture(scope="session")
def lab_cluster(tmp_path_factory: pytest.TempPathFactory, tiny_inputs: tuple[Path, Path]):
    """The cluster lab: three fresh nodes, shared by its modules (LABS) and torn down at the end.

    Provisioning a lab is most of a lab test's time, so it is done once: test_site.py checks the
    provisioning of the fresh nodes (dry run, first and second run, ...), and the modules after it
    use the nodes it provisioned. A module run alone provisions what it needs itself.
    """
    with fresh_lab(tmp_path_factory, 3) as cluster:
        yield dataclasses.replace(cluster, model=tiny_inputs[0])


@pytest.fixture(scope="session")
def provisioned(tmp_path_factory: pytest.TempPathFactory, tiny_inputs: tuple[Path, Path]):
    """The training lab: two fresh nodes of its own, one rank each, provisioned once for the
    session (test_docs.py's dry runs use it just before test_run_job.py and test_train.py train on
    it), beside the cluster lab, and torn down at the end."""
    with fresh_lab(tmp_path_factory, 2, TRAINING_LAB_ID) as fresh:
        cluster = dataclasses.replace(fresh, model=tiny_inputs[0])
        try:
            run = cluster.playbook()
            assert run.returncode == 0, json.dumps(run.failures, indent=1)
            yield cluster
        finally:
            shutil.rmtree(paths.build_dir_for(cluster.inventory), ignore_errors=True)


def own_name(model: str) -> str:
    """A model's folder name for this test process: the controller keeps a model by its folder's name
    (models/<name>, and the model role's copies), and the labs' tests side by side (pytest-xdist's
    workers) each make their own."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return f"{model}-{worker}" if worker else model


@pytest.fixture(scope="session")
def tiny_inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny llama in mlx-lm's layout and the prepared pirate data, made once."""
    from tests.unit.training.model.test_folder import tiny_model
    from training.data.prepare import prepare
    from training.model import folder as model_tools

    tmp = tmp_path_factory.mktemp("tiny-inputs")
    name = own_name("tiny")
    tiny_model(tmp / f"{name}-src")
    model_dir = model_tools.fetch(str(tmp / f"{name}-src"), tmp / name, dtype="float32")
    prepare(REPO / "training/data/pirate.jsonl", tmp / "pirate")
    return model_dir, tmp / "pirate"


@pytest.fixture(scope="session")
def tiny_quantized_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny 4-bit llama (group 32) as `mlx_lm convert -q` writes one, fetched as it stays: packed.
    Its 3 key-value groups and 5 MLP quantization groups split unevenly on 2 ranks (2 and 1; 3
    and 2) and on 3 (1 each; 2, 2 and 1)."""
    from tests.unit.training.model.test_folder import tiny_model
    from training.model import folder as model_tools

    tmp = tmp_path_factory.mktemp("tiny-4bit")
    name = own_name("tiny-4bit")
    tiny_model(tmp / f"{name}-src", quantized=True, hidden_size=192, num_attention_heads=6,
               num_key_value_heads=3, intermediate_size=160)
    return model_tools.fetch(str(tmp / f"{name}-src"), tmp / name, dtype="float32")


def assert_tensor_qlora_is_one_process(cluster: LabCluster, model_dir: Path, data_dir: Path, out: Path,
                                       ranks: int, then: Callable[[Path], None] | None = None) -> None:
    """`invoke train --parallel tensor` on a 4-bit model: every rank holds packed shards, and the
    gathered adapters and losses are one process's QLoRA on the same global batches; `then` checks
    more of the run before it is removed."""
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "invoke"), "train", "-i", str(cluster.inventory), "--parallel",
         "tensor", "--model", str(model_dir), "--data", str(data_dir), "--iters", "4", "--batch-size", "2",
         "--extra", "--steps-per-report 2 --steps-per-eval 4 --val-batches 1 --max-seq-length 256 "
         "--learning-rate 1e-3 --num-layers -1"],
        cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = runs.named_in(proc.stdout)
    assert run_dir is not None, proc.stdout[-3000:]
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["world_size"] == ranks and summary["parallel"] == "tensor"
        assert summary["base_weights_per_rank"] == ["4-bit affine, group 32"] * ranks
        reference = one_process_run(run_dir, model_dir, data_dir, out)
        # Wider than float training's 1e-4: each rank dequantizes its packed shard and the partial
        # products are summed in another order, and Adam scales a near-zero gradient's difference up
        # towards the learning rate; 3 ranks once measured 1.05e-4, run alone.
        print(f"{ranks} tensor-parallel QLoRA ranks against 1 process: "
              f"{assert_trains_as_one_process(run_dir, reference, tolerance=2e-4):.3g}")
        if then is not None:
            then(run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


# --- checks that do not trust the run's own figures ------------------------------------------------


def rank_weights(cluster: LabCluster, run_dir: Path, nodes: list[int]) -> list[dict[str, Any]]:
    """Each rank's own copy of the weights all ranks hold alike (a run with save_rank_weights), in
    rank order, read from the nodes it trained on: the files under the run's path on each node
    (the launcher's path, the same on every node)."""
    import mlx.core as mx

    remote = f"/opt/mlx-cluster/runs/{run_dir.name}/ranks"
    found: dict[int, dict[str, Any]] = {}
    for node in nodes:
        listing = cluster.ssh(node, f"ls {remote}")
        for name in listing.stdout.split():
            rank = int(name.removeprefix("rank").removesuffix(".safetensors"))
            got = cluster.ssh(node, f"base64 -w0 {remote}/{name}")
            assert got.returncode == 0 and rank not in found, (node, name, got.stderr)
            local = run_dir / "ranks" / f"node{node}.{name}"
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(base64.b64decode(got.stdout))
            weights = mx.load(str(local))
            assert isinstance(weights, dict) and weights, local
            found[rank] = weights
    assert sorted(found) == list(range(len(found))) and len(found) >= len(nodes), sorted(found)
    return [found[rank] for rank in sorted(found)]


def assert_equal_across_ranks(weights: list[dict[str, Any]]) -> None:
    """Every rank's file holds the same arrays as rank 0's, bit for bit."""
    import mlx.core as mx

    first = weights[0]
    for rank, other in enumerate(weights[1:], start=1):
        assert other.keys() == first.keys(), rank
        unequal = [k for k in first if not mx.array_equal(first[k], other[k]).item()]
        assert unequal == [], f"rank {rank} differs from rank 0 in {unequal[:5]}"


def one_process_run(run_dir: Path, model_dir: Path, data_dir: Path, out: Path) -> Path:
    """The run's own settings (its config.yaml) trained again by one process on the controller:
    the same global batches, nothing split, the reference a run on several ranks must match."""
    settings = yaml.safe_load((run_dir / "config.yaml").read_text())
    settings |= {"model": str(model_dir), "data": str(data_dir), "adapter_path": str(out),
                 "parallel": "data", "pipeline_layers": None, "pipeline_micro_batches": 0,
                 "batch_shares": None, "max_micro_batch": None,
                 "save_rank_weights": False}
    config = out.with_suffix(".yaml")
    config.write_text(yaml.safe_dump(settings))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "MLX_"))}
    proc = subprocess.run([sys.executable, "-m", "training.finetune", "--config", str(config)], cwd=REPO,
                          env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out


def assert_trains_as_one_process(run_dir: Path, reference: Path, tolerance: float = 1e-4) -> float:
    """The run's adapters and its reported losses equal one process's on the same global batches,
    within float tolerance (the order of sums differs across ranks); the largest difference."""
    import mlx.core as mx

    from training.loop import report

    ours = mx.load(str(run_dir / "adapters.safetensors"))
    theirs = mx.load(str(reference / "adapters.safetensors"))
    assert isinstance(ours, dict) and isinstance(theirs, dict) and ours.keys() == theirs.keys()
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    difference = max(mx.abs(ours[k] - theirs[k]).max().item() for k in ours)
    moved = max(mx.abs(v).max().item() for v in theirs.values())
    assert difference < tolerance < moved, (difference, moved)
    for key in ("train_loss", "val_loss"):
        mine = [r[key] for r in report.read_metrics(run_dir / "metrics.jsonl") if key in r]
        one = [r[key] for r in report.read_metrics(reference / "metrics.jsonl") if key in r]
        assert len(mine) == len(one) > 0 and mine == pytest.approx(one, abs=tolerance), (key, mine, one)
    return difference
