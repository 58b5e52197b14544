"""invoke run's plan (mlxcluster/jobs/everywhere.py): the words after `--` as typed, the script or
folder of the job sent to every node, the rendezvous every rank gets, the job's tag that stops it,
the nodes left out after a fault; run for real on a cluster of one local node (real rsync, real
shell, the command as built), and as command lines for two."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from mlxcluster.check import doctor
from mlxcluster.check.doctor import Check
from mlxcluster.describe import drained
from mlxcluster.describe.cluster import Cluster, NotReady, Recorded
from mlxcluster.errors import UserError
from mlxcluster.jobs import everywhere
from mlxcluster.launch import builder, relay, sync
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
    # As invoke run sends (it makes a local node's folder first); the repository's code is not
    # needed by these jobs.
    sync.run_steps([(label, step) for label, step in plan.steps if not label.startswith("sync code")])
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


def test_a_shipped_folder_s_files_are_sent_without_what_links_out_of_it_and_the_job_runs_from_it(
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
    assert plan.notices == ("--ship .: left out 1 link out of the folder (leak): it never goes to the nodes; "
                            "copy into the folder a file the job needs instead of linking it",)
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


def job_folder_among_secrets(tmp_path: Path) -> Path:
    """A job's folder (job.py, lib/util.py, data/rows.csv) that also holds what must never leave this
    machine: keys, tokens, credentials, hidden files, a link to a file outside it."""
    folder = tmp_path / "project"
    job = ("import json, os, sys\nsys.path.insert(0, 'lib')\nimport util\n"
           "rows = open('data/rows.csv').read()\n"
           "print(json.dumps({'rows': rows, 'util': util.NAME, 'cwd': os.getcwd()}))\n")
    secrets = {".ssh/id_ed25519": "key", ".netrc": "machine x password y", ".aws/credentials": "aws",
               ".cache/huggingface/token": "hf_x", ".env": "TOKEN=x", "keys/id_rsa": "key",
               "service-account.json": "{}", "cert.pem": "cert", "sub/.hidden/x.py": "x"}
    for name, text in {"job.py": job, "lib/util.py": "NAME = 'util'\n", "data/rows.csv": "a,b\n1,2\n",
                       **secrets}.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "secret.txt").write_text("keys")
    (folder / "out").symlink_to(tmp_path / "elsewhere" / "secret.txt")
    return folder


LEFT_OUT = ("--ship project: left out 10 hidden or secret files and links out of the folder (out, cert.pem, "
            "service-account.json, keys/id_rsa, .aws/ and 5 more): they never go to the nodes; copy into "
            "the folder a file the job needs instead of linking it")


def test_a_shipped_folder_sends_the_job_s_files_only_never_keys_tokens_hidden_files_or_links_out(
        local, tmp_path, monkeypatch):
    folder = job_folder_among_secrets(tmp_path)
    monkeypatch.chdir(tmp_path)
    plan = everywhere.plan(local, ["python", "job.py"], ship=Path("project"))
    assert plan.notices == (LEFT_OUT,)
    said = run_plan(plan)
    assert said["rows"] == "a,b\n1,2\n" and said["util"] == "util"  # the job ran from its files
    shipped = Path(said["cwd"])
    assert shipped.name.startswith("project-") and shipped != folder
    assert sorted(str(p.relative_to(shipped)) for p in shipped.rglob("*") if not p.is_dir()) == \
        ["data/rows.csv", "job.py", "lib/util.py"]


def test_what_a_shipped_folder_left_out_is_said_by_the_dry_run_and_by_the_run(
        local, tmp_path, monkeypatch, capsys):
    job_folder_among_secrets(tmp_path)
    monkeypatch.chdir(tmp_path)
    everywhere.run(local, ["python", "job.py"], ship=Path("project"), dry_run=True)
    dry = capsys.readouterr().out
    assert f"# {LEFT_OUT}\n" in dry and "--include=/job.py" in dry
    sent = dry.replace(LEFT_OUT, "")  # the steps and the command: none names what was left out
    assert not re.search(r"id_rsa|id_ed25519|\.ssh|\.netrc|credentials|token|\.env|service-account|cert\.pem|"
                         r"\.hidden|--include=/out", sent)
    monkeypatch.setattr(everywhere, "free_port", lambda head: 40000)
    monkeypatch.setattr(sync, "run_steps", lambda steps, dry_run=False: None)
    monkeypatch.setattr(relay, "supervise", lambda *args, **options: relay.Relayed(0, ""))
    everywhere.run(local, ["python", "job.py"], ship=Path("project"))
    assert f"==> {LEFT_OUT}\n" in capsys.readouterr().out


def test_a_home_folder_the_root_folder_and_a_folder_of_home_folders_are_never_shipped(
        local, tmp_path, monkeypatch):
    home = tmp_path / "Users" / "me"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("key")
    (home / "job.py").write_text(JOB)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(home)
    for ship, kind in ((Path("."), "a home folder"), (home, "a home folder"), (Path("/"), "the root folder"),
                       (tmp_path / "Users", "a folder holding home folders")):
        with pytest.raises(UserError, match=f"^--ship {re.escape(str(ship))}: .* is {kind}, which is never "
                                            "sent to the nodes: give the folder of the job's own files"):
            everywhere.plan(local, ["python", "job.py"], ship=ship)


def test_a_script_named_as_a_key_or_on_a_hidden_path_is_never_sent_as_the_job(local, tmp_path, monkeypatch):
    """Without --ship, the script the command names goes alone, through the same selector."""
    home = tmp_path / "me"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "run.py").write_text(JOB)
    (home / "keys").mkdir()
    (home / "keys" / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    monkeypatch.chdir(home)
    for script in (".ssh/run.py", "keys/id_rsa", str(home / "keys" / "id_rsa")):
        with pytest.raises(UserError, match=f"^{re.escape(script)}: a hidden or secret file, which is never"):
            everywhere.plan(local, ["python", script])
    (home / "job.py").write_text(JOB)
    steps = everywhere.plan(local, ["python", "job.py"]).steps
    sent = [command for label, command in steps if label.startswith("send job.py")]
    # The one file, by the selector's filter: never the folder it sits in.
    rules = [word for word in sent[0] if word.startswith(("--include", "--exclude"))]
    assert rules == ["--include=/job.py", "--exclude=*"]


def test_a_shipped_folder_with_no_file_that_may_go_or_too_many_is_refused_with_what_to_do(
        local, tmp_path, monkeypatch):
    folder = tmp_path / "dotfiles"
    (folder / ".ssh").mkdir(parents=True)
    for name in (".ssh/id_rsa", ".env", "token"):
        (folder / name).write_text("secret")
    with pytest.raises(UserError, match=re.escape(
            f"--ship {folder}: no file of {folder} can be sent: it holds only 3 hidden or secret files "
            "(token, .ssh/, .env), which never go to the nodes; ship a folder that holds the job's own "
            "files")):
        everywhere.plan(local, ["hostname"], ship=folder)
    (folder / "job.py").write_text(JOB)
    with pytest.raises(UserError, match=r"\.env: left out of --ship .*, as every hidden or secret file is"):
        everywhere.plan(local, ["python", ".env"], ship=folder)
    monkeypatch.setattr(everywhere, "MOST_SHIPPED_FILES", 3)
    for i in range(3):
        (folder / f"part{i}.txt").write_text("rows")
    with pytest.raises(UserError, match="more than 3 files to send, more than a job's own: ship a smaller "
                                        "folder that holds only the job's own files"):
        everywhere.plan(local, ["python", "job.py"], ship=folder)


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


def test_a_python_program_runs_over_mlx_s_ring_with_its_rank_from_the_venv_s_launcher():
    cluster = Cluster.from_json(lab_layout())
    plan = everywhere.plan(cluster, ["python3", "-m", "training.examples.logistic_regression"],
                           backend="ring", port=40000)
    words = shlex.split(plan.command[-1])
    assert any(w.endswith("/bin/mlx-cluster-launch") for w in words)
    assert words[words.index("--backend") + 1] == "ring"
    assert {"MASTER_ADDR=10.78.5.11", "WORLD_SIZE=2"} <= {words[i + 1] for i, w in enumerate(words)
                                                          if w == "--env"}
    assert words[words.index("--") + 1:words.index("--") + 3] == ["bash", "-c"]
    script = words[words.index("--") + 3]
    assert script == builder.rank_script("/opt/mlx-cluster/env.sh", everywhere.RANK_SETUP)
    assert words[words.index("--") + 4:] == ["python", "-m", "training.examples.logistic_regression"]
    with pytest.raises(UserError, match="Python programs only"):
        everywhere.plan(cluster, ["hostname"], backend="ring")
    with pytest.raises(UserError, match="--backend must be"):
        everywhere.plan(cluster, ["python", "-c", "1"], backend="carrier-pigeon")


def test_the_rank_setup_reads_mpirun_s_rank_else_mlx_s_launcher_s_else_one_alone():
    def ranks(env: dict[str, str]) -> list[str]:
        echo = '; echo "$RANK $LOCAL_RANK $DMLC_TASK_ID"'
        said = subprocess.run(["sh", "-c", everywhere.RANK_SETUP + echo], env=env, capture_output=True,
                              text=True, check=True, stdin=subprocess.DEVNULL)
        return said.stdout.split()
    assert ranks({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}) == ["3", "1", "3"]
    assert ranks({"MLX_RANK": "2"}) == ["2", "0", "2"]
    assert ranks({}) == ["0", "0", "0"]


# --- stopping every rank: the job's tag on its launcher's command line -----------------------------


def launcher_command_line(command: list[str]) -> str:
    """The command line (as pkill -f reads it) of the process that holds the job on the launcher
    once the launch line has run: mpirun, mlx-cluster-launch under the venv's python, or (one rank alone)
    the python that waits for the program."""
    words = shlex.split(command[-1])
    for i, word in enumerate(words):
        if word.endswith("/bin/mpirun"):
            return " ".join(words[i:])
        if word.endswith("/bin/mlx-cluster-launch"):
            return " ".join(words[i - 1:])  # the venv's python runs it
    after_env = words.index("env") + 1
    while "=" in words[after_env]:
        after_env += 1
    return " ".join(words[after_env:])


def stop_pattern(stop: list[str]) -> str:
    """The pattern the stop command's pkill -f kills by."""
    found = re.search(r"pkill -TERM -f '([^']*)'", stop[-1])
    assert found, stop
    return found[1]


@pytest.mark.parametrize("backend", ["mpi", "ring", "direct"])
def test_the_job_is_tagged_where_the_stop_command_finds_it_whatever_the_program(backend):
    """`hostname` names no run: the job's tag, on its launcher's command line, is what train's stop
    command (builder.stop_command) kills it by, on every backend."""
    cluster = Cluster.from_json(lab_layout())
    if backend == "direct":  # one slot alone: no launcher program
        cluster = cluster.only(cluster.head)
    program = ["python", "-c", "print(1)"] if backend == "ring" else ["hostname"]
    plan = everywhere.plan(cluster, program, backend=None if backend == "direct" else backend, port=40000)
    assert re.fullmatch(r"job-\d{8}-\d{6}-[0-9a-f]{6}", plan.marker)
    assert plan.marker != everywhere.plan(cluster, program, backend=None if backend == "direct" else backend,
                                          port=40000).marker
    line = launcher_command_line(plan.command)
    assert f"{builder.JOB_TAG}={plan.marker}" in line or f" {plan.marker} " in line, line
    stop = builder.stop_command(cluster, plan.marker)
    assert stop[:-1] == ["ssh", "-o", "BatchMode=yes", "-i", "/k/id", "root@10.77.5.11"]  # on the launcher
    assert re.search(stop_pattern(stop), line), (stop_pattern(stop), line)
    # Not another job's: invoke train's runs, another invoke run.
    assert not re.search(stop_pattern(builder.stop_command(cluster, everywhere.new_marker() + "x")), line)


def test_the_stop_command_stops_the_launcher_and_every_rank_it_started(tmp_path):
    """The venv's launcher, installed as the role installs it and started under a job's tag, ends on
    the stop command's SIGTERM with 143 and takes its ranks (whose words hold no tag) with it."""
    from tests.unit import rings

    marker = f"job-{uuid.uuid4().hex}"
    token = f"rank-{uuid.uuid4().hex}"  # the rank's own words do not hold the job's tag
    launcher = tmp_path / "bin" / builder.LAUNCHER
    launcher.parent.mkdir()
    launcher.write_text(rings.LAUNCHER.read_text())
    started = subprocess.Popen([sys.executable, str(launcher), "--hostfile", str(rings.local_hosts(2)),
                                "--env", f"{builder.JOB_TAG}={marker}", "--", sys.executable, "-c",
                                "import time; time.sleep(120)", token],
                               stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        ranks = f"^{re.escape(sys.executable)} -c .*{token}"  # not the launcher, whose argv holds it too
        deadline = time.monotonic() + 30
        while len(pids_holding(ranks)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(pids_holding(ranks)) == 2, "the ranks never started"
        here = Cluster.from_json(dict(lab_layout(), nodes=[dict(lab_layout()["nodes"][0],
                                                                  connection={"type": "local"})]))
        builder.stop(here, marker)
        assert started.wait(timeout=30) == 128 + signal.SIGTERM
        gone_within(30, token)
        assert started.communicate(timeout=10)[1].count("was stopped (status -15)") == 2
    finally:
        started.kill()
        started.stderr.close()
        subprocess.run(["pkill", "-KILL", "-f", token], check=False, stdin=subprocess.DEVNULL)


def test_one_rank_alone_runs_under_its_tag_with_its_exit_status_and_is_stopped_by_it(local):
    """With no launcher program (one slot), a python that waits for the program holds the tag: the
    program's exit status is the job's, and stop ends the program, whose words hold no tag."""
    failing = everywhere.plan(local, ["sh", "-c", "exit 3"])
    assert subprocess.run(failing.command, stdin=subprocess.DEVNULL, capture_output=True).returncode == 3
    token = f"sleeper-{everywhere.new_marker()}"  # not the job's tag
    plan = everywhere.plan(local, ["python", "-c", "import time; time.sleep(120)", token])
    job = subprocess.Popen(plan.command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not pids_holding(token) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pids_holding(token), job.communicate(timeout=5)
        builder.stop(local, plan.marker)
        # The python's 143, or -15: the shell that runs the launch line holds the tag too.
        assert job.wait(timeout=30) in (128 + signal.SIGTERM, -signal.SIGTERM)
        gone_within(30, token)
    finally:
        job.kill()
        job.communicate()
        subprocess.run(["pkill", "-KILL", "-f", token], check=False, stdin=subprocess.DEVNULL)


def pids_holding(token: str) -> list[int]:
    """The processes whose command line holds `token`, as pkill -f matches them."""
    found = subprocess.run(["pgrep", "-f", token], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    return [int(pid) for pid in found.stdout.split()]


def gone_within(seconds: float, token: str) -> None:
    deadline = time.monotonic() + seconds
    while pids_holding(token) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pids_holding(token) == []


# --- nodes left out after a fault --------------------------------------------------------------------


def recorded_with_node2_left_out(tmp_path: Path) -> Recorded:
    """Three lab nodes as provisioned, node2 recorded as left out by a run after a fault."""
    build = tmp_path / "build"
    drained.add(build, drained.Drained("node2", "killed", "killed ...", "20261126-100000",
                                       "2026-11-26T10:05:00", 20))
    layout = lab_layout()
    third = {k: v.replace("1", "3", 1) if k == "name" else v for k, v in layout["nodes"][1].items()}
    third |= {"name": "node3", "thunderbolt_ip": "10.78.5.13",
              "connection": dict(third["connection"], host="10.77.5.13")}
    return Recorded("inventory/lab.yml", Cluster.from_json(dict(layout, nodes=[*layout["nodes"], third])),
                    build)


def test_a_node_left_out_stays_out_of_the_job_said_with_how_it_comes_back(tmp_path, monkeypatch, capsys):
    """As for invoke train (restarts.layout): node2, left out after a fault, is checked first; while
    its checks fail the job runs on node1 alone, and a line says which node and how it comes back."""
    rec = recorded_with_node2_left_out(tmp_path)
    monkeypatch.setattr(doctor, "red_node_checks", lambda cluster, need: [
        Check("node2", "management ssh", False, "timed out")])
    monkeypatch.setattr(everywhere, "free_port", lambda head: 40000)
    monkeypatch.setattr(sync, "run_steps", lambda steps, dry_run=False: None)
    launched = []
    monkeypatch.setattr(relay, "supervise", lambda cluster, cmd, marker, **options: launched.append(
        (cluster, cmd, marker, options)) or relay.Relayed(0, ""))
    everywhere.run(rec, ["hostname"])
    said = capsys.readouterr().out
    assert ("==> node2 left out since 2026-11-26 10:05:00 by run 20261126-100000 (killed); its checks still "
            "fail (invoke doctor -i inventory/lab.yml shows them; it is let back in at the first launch "
            "after they pass): running without it") in said
    [(cluster, cmd, marker, options)] = launched
    assert [n.name for n in cluster.nodes] == ["node1", "node3"] and options == {"stderr": None}
    line = cmd[-1]
    assert line.startswith("printf '%s\\n' '10.78.5.11 slots=1\n10.78.5.13 slots=1' > "
                           "/opt/mlx-cluster/work/layout-hostfile && ")
    assert "--hostfile /opt/mlx-cluster/work/layout-hostfile -np 2 " in line
    assert "-x WORLD_SIZE=2 " in line and f"-x {builder.JOB_TAG}={marker} " in line
    assert sorted(drained.read(rec.build)) == ["node2"]  # still out

    # Its checks pass: it is let back in, and the job runs on both.
    monkeypatch.setattr(doctor, "red_node_checks", lambda cluster, need: [])
    everywhere.run(rec, ["hostname"])
    assert "==> node2 rejoins: its checks pass again" in capsys.readouterr().out
    assert launched[-1][0] == rec.cluster and drained.read(rec.build) == {}


def test_a_dry_run_leaves_the_node_out_unchecked_and_no_node_left_is_refused_with_the_fix(tmp_path, capsys):
    rec = recorded_with_node2_left_out(tmp_path)
    everywhere.run(rec, ["hostname"], dry_run=True)  # touches no host: nothing is checked
    said = capsys.readouterr().out
    assert ("# node2 left out since 2026-11-26 10:05:00 by run 20261126-100000 (killed): a run checks it "
            "first, and lets it back in if its checks pass") in said
    assert "--hostfile /opt/mlx-cluster/work/layout-hostfile -np 2 " in said
    for node in ("node1", "node3"):
        drained.add(rec.build, drained.Drained(node, "lost", "lost", "20261126-110000", "2026-11-26T11:00"))
    with pytest.raises(NotReady, match=r"no node that trains is left without node1, node2, node3: node1, "
                                       r"node2, node3 left out after a fault \(.*drained.json\); invoke "
                                       r"doctor -i inventory/lab.yml shows what fails there, and a launch "
                                       r"lets a node back in once its checks pass"):
        everywhere.run(rec, ["hostname"], dry_run=True)


def test_sigterm_is_ctrl_c_while_a_job_runs_and_only_then():
    with relay.terminated_as_interrupted(), pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
