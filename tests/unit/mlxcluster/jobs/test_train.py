"""`invoke train`'s plan (mlxcluster/jobs/train.py): the sync steps and the launch line, from a recorded
layout; and `invoke train --dry-run`, which prints them."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcluster import paths
from mlxcluster.describe.cluster import Cluster
from mlxcluster.errors import UserError
from mlxcluster.jobs import everywhere
from mlxcluster.jobs import train as training
from mlxcluster.jobs.request import Options, Request, resumed
from mlxcluster.launch import builder, sync
from tests.unit import fake_inputs

REPO = Path(__file__).resolve().parents[4]


def plan(cluster: Cluster, *, data: str = "/d/p", model: str = "/m/t", config: str | None = None,
         overrides: tuple[str, ...] = (), backend: str | None = None, threads: int | None = None,
         resume: bool = False) -> training.Plan:
    """The plan of a run on `cluster`; data, model and config given by name are made first (a
    config that exists is used as it is)."""
    config_file = Path(config) if config and Path(config).exists() else (
        fake_inputs.config(config) if config else None)
    request = Request(fake_inputs.dataset(data), fake_inputs.model(model), config_file,
                      overrides, backend, threads=threads, interactive=False)
    return training.plan(cluster, request, run_id="r1", resume=resume)


def lab_layout() -> dict:
    def node(i: int) -> dict:
        return {"name": f"node{i}", "thunderbolt_ip": f"10.78.5.1{i}", "slots": 1,
                "os_family": "Debian", "thunderbolt_interface": "bridge0",
                "cluster_root": "/opt/mlx-cluster", "venv": "/opt/mlx-cluster/venv",
                "env_file": "/opt/mlx-cluster/env.sh", "openmpi_prefix": "/usr",
                "reachable": True,
                "connection": {"type": "ssh", "host": f"10.77.5.1{i}", "user": "root",
                               "private_key_file": "/k/id", "ssh_common_args": ""}}
    return {"launcher": "node1", "nodes": [node(1), node(2)]}


def test_plan_syncs_code_and_data_everywhere_and_fans_the_model_out_over_the_link():
    the_plan = plan(Cluster.from_json(lab_layout()), data="/d/pirate", model="/m/tiny",
                    overrides=("--iters", "5"))
    steps, launch_cmd = the_plan.steps, the_plan.launch
    # In waves: every node's code and data and the model to the launcher at once, then the model
    # from there, then every copy checked.
    assert [[label for label, _ in wave] for wave in sync.waves(steps)] == [
        ["sync code to node1", "sync data to node1", "sync code to node2", "sync data to node2",
         "copy the model to node1"],
        ["copy the model from node1 to node2 over the cluster link"],
        ["verify the model's checksums on node1", "verify the model's checksums on node2"]]
    fan = shlex.join(sync.waves(steps)[1][0][1])
    assert "root@10.77.5.11" in fan and "10.78.5.12:/opt/mlx-cluster/models/tiny/" in fan
    line = launch_cmd[-1]
    assert launch_cmd[:3] == ["ssh", "-o", "BatchMode=yes"]
    assert line.startswith(". /opt/mlx-cluster/env.sh && cd /opt/mlx-cluster/work && ")
    assert ("/usr/bin/mpirun --allow-run-as-root --hostfile /opt/mlx-cluster/hostfile -np 2 "
            "--bind-to none --mca btl_tcp_if_include bridge0 --mca oob_tcp_if_include bridge0") in line
    assert line.endswith("--wdir /opt/mlx-cluster/work /opt/mlx-cluster/venv/bin/python -m "
                         "training.finetune --model /opt/mlx-cluster/models/tiny --data "
                         "/opt/mlx-cluster/work/data/pirate --adapter-path "
                         "/opt/mlx-cluster/runs/r1 --expected-world-size 2 --iters 5")


def test_a_plan_reads_the_settings_twice_the_user_s_then_the_ranks_and_carries_them(monkeypatch):
    from mlxcluster.launch import settings as run_settings

    reads = []
    real_read = run_settings.read
    monkeypatch.setattr(run_settings, "read", lambda config, flags: reads.append(list(flags))
                        or real_read(config, flags))
    the_plan = plan(Cluster.from_json(lab_layout()), overrides=("--iters", "5", "--batch-size", "2"))
    # Once as the user gave them (shares, dequantizing and the inputs are worked out from these),
    # once as every rank will read them: the user's flags, then the nodes' paths.
    assert reads == [["--iters", "5", "--batch-size", "2"], ["--iters", "5", "--batch-size", "2"]]
    assert (the_plan.settings.iters, the_plan.settings.batch_size) == (5, 2)
    assert the_plan.request.settings is the_plan.request.settings  # resolved once, then carried


def test_ring_backend_uses_the_venv_s_launcher_and_the_rendered_hosts_json():
    line = plan(Cluster.from_json(lab_layout()), config="/c/my.yaml", backend="ring").launch[-1]
    assert "/opt/mlx-cluster/venv/bin/python /opt/mlx-cluster/venv/bin/mlx-cluster-launch --backend ring " \
           "--hostfile /opt/mlx-cluster/hosts.json" in line
    assert "--config /opt/mlx-cluster/work/config/my.yaml" in line
    assert f" -- bash -c {shlex.quote(builder.rank_script('/opt/mlx-cluster/env.sh'))} python " \
           "-m training.finetune " in line


def test_ring_ranks_run_the_python_their_env_file_selects(tmp_path):
    """What the launcher runs per rank: the args after `--` (bash -c ...); env.sh picks python and
    LD_PRELOAD."""
    (tmp_path / "bin").mkdir()
    fake_python = tmp_path / "bin" / "python"
    fake_python.write_text('#!/bin/sh\necho "venv python $LD_PRELOAD $*"\n')
    fake_python.chmod(0o755)
    env_file = tmp_path / "env.sh"
    env_file.write_text(f'export PATH="{tmp_path}/bin:$PATH"\nexport LD_PRELOAD=libopenblas.so.0\n')
    layout = lab_layout()
    layout["nodes"][0]["env_file"] = str(env_file)
    launch_cmd = plan(Cluster.from_json(layout), backend="ring").launch
    launcher = shlex.split(launch_cmd[-1].split(" && ", 1)[1])
    rank_args = launcher[launcher.index("--") + 1:]
    out = subprocess.run(rank_args, capture_output=True, text=True, check=True).stdout
    assert out.startswith("venv python libopenblas.so.0 -m training.finetune --model ")


def test_dry_run_prints_the_commands_and_touches_no_host(tmp_path):
    # A name no lab uses: build/<name>/ is removed afterwards.
    inventory = tmp_path / f"dry-run-{os.getpid()}" / "inventory" / "hosts.yml"
    inventory.parent.mkdir(parents=True)
    inventory.write_text("cluster: {}\n")
    build = paths.build_dir_for(inventory)
    build.mkdir(parents=True, exist_ok=True)
    try:
        (build / "cluster.json").write_text(json.dumps(lab_layout()))
        (build / "hostfile").write_text("10.78.5.11 slots=1\n10.78.5.12 slots=1\n")
        proc = subprocess.run([str(Path(sys.executable).parent / "invoke"), "train", "-i",
                               str(inventory), "--dry-run", "--data", str(fake_inputs.dataset("/d/p")),
                               "--model", str(fake_inputs.model("/m/t"))],
                              cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert "# launch on node1" in proc.stdout and "mpirun" in proc.stdout
        assert "==>" not in proc.stdout  # nothing ran
        # A plan still shows what a run would do, and why a real run would stop.
        (build / "hostfile").write_text("10.78.5.11 slots=1\n")
        proc = subprocess.run([str(Path(sys.executable).parent / "invoke"), "train", "-i",
                               str(inventory), "--dry-run", "--data", str(fake_inputs.dataset("/d/p")),
                               "--model", str(fake_inputs.model("/m/t"))],
                              cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("# a real run would stop now: cannot launch: the rendered "
                                      "hostfile does not match the inventory")
        assert "# launch on node1" in proc.stdout
    finally:
        for f in build.iterdir():
            f.unlink()
        build.rmdir()


def test_a_single_rank_on_the_launcher_runs_without_mpirun():
    layout = lab_layout()
    layout["nodes"][1]["slots"] = 0
    line = plan(Cluster.from_json(layout), threads=1).launch[-1]
    assert "mpirun" not in line
    assert ("cd /opt/mlx-cluster/work && env HF_HUB_OFFLINE=1 MLX_CLUSTER_BEATS=2.0 OPENBLAS_NUM_THREADS=1 "
            "TTY_COMPATIBLE=0 /opt/mlx-cluster/venv/bin/python -m training.finetune ") in line
    assert line.endswith("--expected-world-size 1")


def test_resume_continues_the_run_with_the_settings_it_was_started_with():
    launch_cmd = plan(Cluster.from_json(lab_layout()), data="/d/pirate", model="/m/tiny",
                      config="/b/resume/r1.yaml", overrides=("--steps-per-report", "5"),
                      resume=True).launch
    assert launch_cmd[-1].endswith(
        "training.finetune --config /opt/mlx-cluster/work/config/r1.yaml --resume --model "
        "/opt/mlx-cluster/models/tiny --data /opt/mlx-cluster/work/data/pirate --adapter-path "
        "/opt/mlx-cluster/runs/r1 --expected-world-size 2 --steps-per-report 5")


def test_scaling_configurations_keep_the_launcher_and_the_first_nodes():
    layout = lab_layout()
    layout["nodes"].append({**layout["nodes"][1], "name": "node3", "thunderbolt_ip": "10.78.5.13"})
    cluster = Cluster.from_json(layout)
    assert cluster.first_nodes(1).hostfile_lines() == ["10.78.5.11 slots=1"]
    assert [n.name for n in cluster.first_nodes(2).training_nodes] == ["node1", "node2"]
    assert cluster.first_nodes(3).world_size == 3


def rank_environment(cmd: list[str]) -> set[str]:
    words = shlex.split(cmd[-1])
    return {words[i + 1] for i, word in enumerate(words) if word == "-x" and "=" in words[i + 1]}


def test_invoke_run_gives_its_ranks_the_environment_training_ranks_get():
    for layout in (lab_layout(), {**lab_layout(), "nodes": [
            {**n, "slots": 2} for n in lab_layout()["nodes"]]}):
        cluster = Cluster.from_json(layout)
        trained = rank_environment(plan(cluster).launch)
        ran = rank_environment(everywhere.plan(cluster, ["hostname"]).command)
        # and invoke run's own rendezvous (test_everywhere.py); a training rank's beats are its own
        assert trained - {"MLX_CLUSTER_BEATS=2.0"} <= ran
        assert {"HF_HUB_OFFLINE=1", "TTY_COMPATIBLE=0"} <= ran
    assert "OPENBLAS_NUM_THREADS=1" in ran  # two ranks share each node's cores


def test_a_config_file_is_sent_alone_never_the_folder_it_sits_in(tmp_path):
    # A config kept in the home folder: its neighbours are private keys and tokens.
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("PRIVATE KEY")
    (home / ".cache" / "huggingface").mkdir(parents=True)
    (home / ".cache" / "huggingface" / "token").write_text("hf_secret")
    (home / "my.yaml").write_text("iters: 5\n")
    layout = lab_layout()
    layout["nodes"] = [dict(layout["nodes"][0], cluster_root=str(tmp_path / "root"),
                            connection={"type": "local"})]
    the_plan = plan(Cluster.from_json(layout), config=str(home / "my.yaml"))
    [sync_config] = [cmd for label, cmd in the_plan.steps if label.startswith("sync config")]
    assert str(home) + "/" not in sync_config and str(home / "my.yaml") in sync_config
    (tmp_path / "root" / "work").mkdir(parents=True)  # provisioned (a local rsync makes one level)
    subprocess.run(sync_config, check=True, capture_output=True)  # real rsync, to a local node
    sent = sorted(p.relative_to(tmp_path / "root") for p in (tmp_path / "root").rglob("*"))
    assert sent == [Path("work"), Path("work/config"), Path("work/config/my.yaml")]
    assert "--config " + str(tmp_path / "root/work/config/my.yaml") in the_plan.launch[-1]


def test_data_model_or_config_without_a_plain_name_is_refused_before_any_copy():
    import pytest

    from mlxcluster.errors import UserError
    cluster = Cluster.from_json(lab_layout())
    for given, says in (("data", "--data /"), ("model", "--model /")):
        request = Request(Path("/") if given == "data" else fake_inputs.dataset("/d/p"),
                          Path("/") if given == "model" else fake_inputs.model("/m/t"),
                          interactive=False)
        with pytest.raises(UserError, match="letters, digits") as info:
            training.plan(cluster, request, run_id="r1")
        assert says in str(info.value)
    for kwargs, says in (({"data": "/d/my data"}, "'my data'"), ({"model": "/m/$(reboot)"}, "'$(reboot)'"),
                         ({"config": "/c/a b.yaml"}, "'a b.yaml'"), ({"data": "/d/.hidden"}, "'.hidden'")):
        with pytest.raises(UserError, match="letters, digits") as info:
            plan(cluster, **kwargs)
        assert says in str(info.value)
    assert plan(cluster, data="/d/pirate-v2", model="/m/SmolLM2_135M@f32").steps


def test_a_resume_gives_the_launcher_the_checkpoints_it_lacks_and_keeps_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr(training, "RUNS", tmp_path / "runs")
    saved = tmp_path / "runs" / "r1" / "checkpoints" / "0000010"
    saved.mkdir(parents=True)
    (saved / "state.json").write_text("controller's")
    layout = lab_layout()
    layout["nodes"] = [dict(layout["nodes"][0], cluster_root=str(tmp_path / "root"),
                            connection={"type": "local"})]
    cluster = Cluster.from_json(layout)
    own = Path(cluster.head.runs_dir) / "r1" / "checkpoints" / "0000020"
    own.mkdir(parents=True)
    (own / "state.json").write_text("launcher's")
    (own.parent / "0000010").mkdir()
    (own.parent / "0000010" / "state.json").write_text("launcher's too")
    (saved.parent / "0000005").mkdir()
    (saved.parent / "0000005" / "state.json").write_text("only on the controller")
    steps = plan(cluster, resume=True).steps
    [(label, restore)] = [(label, cmd) for label, cmd in steps if label.startswith("restore")]
    assert label == "restore the run's checkpoints on node1" and "--delete" not in restore
    subprocess.run(restore, check=True, capture_output=True)
    assert (own.parent / "0000005" / "state.json").read_text() == "only on the controller"
    assert (own.parent / "0000010" / "state.json").read_text() == "launcher's too"  # kept
    assert (own / "state.json").read_text() == "launcher's"
    # No checkpoint on the controller yet: nothing to restore.
    monkeypatch.setattr(training, "RUNS", tmp_path / "elsewhere")
    assert not [label for label, _ in plan(cluster, resume=True).steps if label.startswith("restore")]


def test_a_resume_with_another_model_is_refused_naming_both(tmp_path, monkeypatch):
    from mlxcluster.errors import UserError
    from mlxcluster.jobs import request
    from mlxcluster.launch import runs
    from training.model.manifest import manifest_sha256, write_manifest

    models = {}
    for name, weights in (("tiny", b"\0" * 8), ("other", b"\1" * 8)):
        models[name] = tmp_path / name
        models[name].mkdir()
        (models[name] / "model.safetensors").write_bytes(weights)
        write_manifest(models[name], source=name)
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("iters: 10\n")
    runs.write_info(run, {"data": "/d/pirate", "model": str(models["tiny"]),
                          "model_sha256": manifest_sha256(models["tiny"])})
    monkeypatch.setattr(request, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(runs, "RUNS", tmp_path / "runs")
    with pytest.raises(UserError, match=rf"--model {models['other']} is not the model run r1 was "
                                        rf"trained on \({models['tiny']}, manifest sha256"):
        resumed(Options(resume="r1", model=str(models["other"])))
    # The same model (another copy of it is fine too), or none given: resumed.
    run_id, options = resumed(Options(resume="r1", model=str(models["tiny"])))
    assert run_id == "r1" and options.model == str(models["tiny"])
    assert resumed(Options(resume="r1"))[1].model == str(models["tiny"])


def dry_run(inventory: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "invoke"), "train", "-i", str(inventory),
                           "--dry-run", "--data", str(fake_inputs.dataset("/d/pirate")),
                           "--model", str(fake_inputs.model("/m/tiny"))],
                          cwd=REPO, capture_output=True, text=True)


def test_a_dry_run_before_provisioning_plans_from_the_inventory_alone(tmp_path):
    # Two Macs that do not exist: the plan must come without reaching them, and leave the
    # inventory's build folder (provisioning's) as it was: absent.
    inventory = tmp_path / f"unprovisioned-{os.getpid()}" / "inventory" / "hosts.yml"
    inventory.parent.mkdir(parents=True)
    macs = {f"mac{i}": {"ansible_host": f"mac{i}.invalid", "thunderbolt_ip": f"192.168.200.{i}"}
            for i in (1, 2)}
    inventory.write_text(json.dumps({"cluster": {"children": {"macs": {"hosts": macs}},
                                                 "vars": {"ansible_user": "mlx"}},
                                     "launcher": {"hosts": {"mac2": None}}}))
    proc = dry_run(inventory)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.startswith("# not provisioned yet: the layout comes from the inventory alone\n")
    # Each value provisioning fills in is a placeholder, and the header says where it comes from.
    for placeholder, source in (("@CLUSTER_ROOT@", "facts"), ("@VENV@", "roles/python_env"),
                                ("@ENV_FILE@", "roles/python_env"),
                                ("@OPENMPI_PREFIX@", "roles/openmpi")):
        [line] = [line for line in out.splitlines() if line.startswith(f"# {placeholder}: ")]
        assert source in line
    launch = out.split("# launch on mac2\n")[1].splitlines()[0]
    assert launch.startswith("ssh -o BatchMode=yes mlx@mac2.invalid '. @ENV_FILE@ && ")
    assert "@OPENMPI_PREFIX@/bin/mpirun --hostfile @CLUSTER_ROOT@/hostfile -np 2 " in launch
    assert "@VENV@/bin/python -m training.finetune --model @CLUSTER_ROOT@/models/tiny " in launch
    assert "mlx@mac1.invalid:@CLUSTER_ROOT@/work/data/pirate/" in out
    assert not paths.build_dir_for(inventory).exists()

    # What the inventory says is shown as it is; a bad inventory is refused as provisioning would.
    text = json.loads(inventory.read_text())
    text["cluster"]["vars"]["cluster_root"] = "/opt/mlx"
    inventory.write_text(json.dumps(text))
    out = dry_run(inventory).stdout
    assert "@CLUSTER_ROOT@" not in out and "--hostfile /opt/mlx/hostfile" in out
    text["cluster"]["children"]["macs"]["hosts"]["mac1"]["thunderbolt_ip"] = "192.168.200.2"
    inventory.write_text(json.dumps(text))
    proc = dry_run(inventory)
    assert proc.returncode != 0
    assert "192.168.200.2" in proc.stderr and "mac1" in proc.stderr
    assert not paths.build_dir_for(inventory).exists()


def test_a_dry_run_before_the_default_model_is_fetched_knows_how_far_it_shards(tmp_path):
    # SmolLM2-135M (9 query heads in 3 key-value groups) shards across at most 3 ranks: a dry run
    # on 4 refuses, before the model exists, as the real run would after fetching it.
    layout = lab_layout()
    layout["nodes"] += [{**layout["nodes"][-1], "name": f"node{i}", "thunderbolt_ip": f"10.78.5.1{i}"}
                        for i in (3, 4)]

    def pending_plan(nodes: int) -> training.Plan:
        cluster = Cluster.from_json(layout).first_nodes(nodes)
        request = Request(fake_inputs.dataset("/d/p"), tmp_path / "not-fetched-yet", None,
                          ("--parallel", "tensor"), None, interactive=False,
                          pending=frozenset({"model"}))
        return training.plan(cluster, request, run_id="r1")

    assert "tensor parallel: each of the 3 ranks" in pending_plan(3).notices[-1]
    with pytest.raises(UserError, match="its 3 key-value head groups cannot go whole to each of 4 ranks: "
                                        "it shards across at most 3 ranks"):
        pending_plan(4)
