"""invoke run's plan (mlxcluster/jobs/everywhere.py): the words after `--` as typed, the script or
folder of the job sent to every node, the rendezvous every rank gets; run for real on a cluster of
one local node (real rsync, real shell, the command as built), and as command lines for two."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcluster.describe.cluster import Cluster
from mlxcluster.errors import UserError
from mlxcluster.jobs import everywhere
from mlxcluster.launch import builder
from mlxcluster.paths import REPO

from .test_train import lab_layout

JOB = f"""import json, os, sys
here = os.path.dirname(os.path.abspath(__file__))
env = {{k: os.environ.get(k) for k in {everywhere.RENDEZVOUS_NAMES!r}}}
print(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "here": here, "env": env}}))
"""
# What a shell would mangle if the words were joined and split again.
AWKWARD = ["a b", "$HOME", "x; rm -rf /tmp/nothing", "'single'", '"double"', "", "back\\slash", "--"]


@pytest.fixture
def local(tmp_path: Path) -> Cluster:
    """One node, this machine, its cluster root a temporary folder (env.sh puts the venv first)."""
    root = tmp_path / "root"
    (root / "work").mkdir(parents=True)
    venv = Path(sys.executable).parent.parent
    (root / "env.sh").write_text(f'export PATH="{venv}/bin:$PATH"\n')
    layout = lab_layout()
    layout["nodes"] = [dict(layout["nodes"][0], cluster_root=str(root), venv=str(venv),
                            env_file=str(root / "env.sh"), connection={"type": "local"})]
    return Cluster.from_json(layout)


def run_plan(plan: everywhere.Plan) -> dict:
    for label, step in plan.steps:
        if not label.startswith("sync code"):  # the repository's code: not needed by these jobs
            subprocess.run(step, check=True, capture_output=True)
    done = subprocess.run(plan.command, capture_output=True, text=True, check=True, stdin=subprocess.DEVNULL)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_words_after_the_dashes_are_the_program_as_typed():
    argv = ["invoke", "run", "-i", "x.yml", "--", "python", "-c", "import os; print(1)", "--", "a b"]
    assert everywhere.program_of(argv, "python -c import os; print(1) -- a b") == \
        ["python", "-c", "import os; print(1)", "--", "a b"]
    assert everywhere.program_of(["invoke"], "hostname -f") == ["hostname", "-f"]
    with pytest.raises(UserError, match="nothing to run"):
        everywhere.program_of(["invoke", "run", "--"])


def test_a_local_script_is_sent_and_gets_its_words_exactly_and_the_rendezvous(local, tmp_path, monkeypatch):
    jobs = tmp_path / "mine"
    jobs.mkdir()
    (jobs / "job.py").write_text(JOB)
    monkeypatch.chdir(jobs)
    plan = everywhere.plan(local, ["python", "-u", "./job.py", *AWKWARD], port=31337)
    said = run_plan(plan)
    assert said["argv"] == AWKWARD
    assert said["here"].startswith(f"{local.head.work_dir}/shipped/mine-")
    assert said["cwd"] == local.head.work_dir
    assert said["env"] == {"RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "1",
                           "MASTER_ADDR": "10.78.5.11", "MASTER_PORT": "31337", "DMLC_TASK_ID": "0",
                           "DMLC_NUM_WORKER": "1", "DMLC_TRACKER_URI": "10.78.5.11",
                           "DMLC_TRACKER_PORT": "31337", "HOROVOD_RANK": "0", "HOROVOD_SIZE": "1",
                           "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "1"}
    # An absolute path anywhere on this machine, too; the training code's place is left alone.
    monkeypatch.chdir(tmp_path)
    plan = everywhere.plan(local, ["python", str(jobs / "job.py"), "x"])
    assert run_plan(plan)["argv"] == ["x"]
    assert not any("/training" in shlex.join(cmd) for label, cmd in plan.steps if "job.py" in label)


def test_a_shipped_folder_is_sent_whole_without_what_links_out_of_it_and_the_job_runs_from_it(
        local, tmp_path, monkeypatch):
    folder = tmp_path / "project"
    (folder / "lib").mkdir(parents=True)
    (folder / "lib" / "job.py").write_text(JOB)
    (folder / "data.txt").write_text("rows")
    (tmp_path / "secret").write_text("keys")
    (folder / "leak").symlink_to(tmp_path / "secret")  # out of the folder: never sent
    (folder / "alias.txt").symlink_to("data.txt")  # inside it: kept
    monkeypatch.chdir(folder)
    plan = everywhere.plan(local, ["python", "lib/job.py", "go"], ship=Path("."))
    said = run_plan(plan)
    shipped = Path(said["cwd"])
    assert said["argv"] == ["go"] and shipped.name.startswith("project-") and plan.workdir == str(shipped)
    assert sorted(str(p.relative_to(shipped)) for p in shipped.rglob("*")) == \
        ["alias.txt", "data.txt", "lib", "lib/job.py"]
    assert (shipped / "alias.txt").read_text() == "rows"
    # From anywhere (invoke runs in the repository): the script is the shipped folder's.
    monkeypatch.chdir(tmp_path)
    said = run_plan(everywhere.plan(local, ["python", "lib/job.py", "again"], ship=folder))
    assert said["argv"] == ["again"] and said["cwd"] == str(shipped)
    # Again: only what changed is sent, and what went from the folder goes from the nodes.
    (folder / "data.txt").unlink()
    run_plan(everywhere.plan(local, ["python", "lib/job.py"], ship=folder))
    assert not (shipped / "data.txt").exists()


def test_what_cannot_be_shipped_is_refused_with_what_to_do(local, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="no such file here"):
        everywhere.plan(local, ["python", "./missing.py"])
    with pytest.raises(UserError, match="not a folder"):
        everywhere.plan(local, ["hostname"], ship=tmp_path / "nowhere")
    with pytest.raises(UserError, match="holds this repository"):
        everywhere.plan(local, ["hostname"], ship=REPO.parent)
    # Not scripts: modules, code given inline, programs installed on the nodes.
    for program in (["python", "-m", "training.examples.logistic_regression"], ["python", "-c", "print(1)"],
                    ["hostname"], ["/usr/bin/env"], ["bash", "-c", "echo hi"]):
        assert everywhere.plan(local, program).program == program


def test_every_rank_of_two_nodes_gets_its_rank_from_mpirun_and_the_launcher_s_address():
    cluster = Cluster.from_json(lab_layout())
    plan = everywhere.plan(cluster, ["python", "-c", "import os; print(os.environ['RANK'])"], port=40000)
    words = shlex.split(plan.command[-1])
    assert "/usr/bin/mpirun" in words
    exported = {words[i + 1] for i, w in enumerate(words) if w == "-x"}
    assert {"MASTER_ADDR=10.78.5.11", "MASTER_PORT=40000", "WORLD_SIZE=2", "DMLC_NUM_WORKER=2"} <= exported
    tail = words[words.index("sh"):]
    assert tail[:2] == ["sh", "-c"] and "OMPI_COMM_WORLD_RANK" in tail[2]
    assert tail[3:] == ["rank", "/opt/mlx-cluster/venv/bin/python", "-c",
                        "import os; print(os.environ['RANK'])"]


def test_a_python_program_runs_over_mlx_s_ring_with_its_rank_from_mlx_launch():
    cluster = Cluster.from_json(lab_layout())
    plan = everywhere.plan(cluster, ["python3", "-m", "training.examples.logistic_regression"],
                           backend="ring", port=40000)
    words = shlex.split(plan.command[-1])
    assert any(w.endswith("/bin/mlx.launch") for w in words) and words[words.index("--backend") + 1] == "ring"
    assert {"MASTER_ADDR=10.78.5.11", "WORLD_SIZE=2"} <= {words[i + 1] for i, w in enumerate(words)
                                                          if w == "--env"}
    script = words[words.index("--") + 2]
    assert script == builder.rank_script("/opt/mlx-cluster/env.sh", everywhere.RANK_SETUP)
    assert words[words.index("--") + 3:] == ["python", "-m", "training.examples.logistic_regression"]
    with pytest.raises(UserError, match="Python programs only"):
        everywhere.plan(cluster, ["hostname"], backend="ring")
    with pytest.raises(UserError, match="--backend must be"):
        everywhere.plan(cluster, ["python", "-c", "1"], backend="carrier-pigeon")


def test_the_rank_setup_reads_mpirun_s_rank_else_mlx_launch_s_else_one_alone():
    def ranks(env: dict[str, str]) -> list[str]:
        echo = '; echo "$RANK $LOCAL_RANK $DMLC_TASK_ID"'
        said = subprocess.run(["sh", "-c", everywhere.RANK_SETUP + echo], env=env, capture_output=True,
                              text=True, check=True, stdin=subprocess.DEVNULL)
        return said.stdout.split()
    assert ranks({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}) == ["3", "1", "3"]
    assert ranks({"MLX_RANK": "2"}) == ["2", "0", "2"]
    assert ranks({}) == ["0", "0", "0"]
