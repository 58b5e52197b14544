"""invoke serve's plan (mlxcluster/jobs/serve.py): the runs it serves and their one base, where it
runs (sharded across every node, or one process on the launcher), what is sent (the code, the
model, each run's two adapter files), the launch and the ssh tunnel; refusals that say what to do."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from mlxcluster.describe.cluster import Cluster, Recorded
from mlxcluster.errors import UserError
from mlxcluster.jobs import flags, serve
from mlxcluster.launch import sync
from tests.unit import fake_inputs
from tests.unit.mlxcluster.jobs.test_train import lab_layout


def run(root: Path, name: str, model: Path, parallel: str = "tensor", kind: str = "lora",
        stages: list[int] | None = None) -> Path:
    """A finished run's folder as invoke train leaves it, as far as serving reads it."""
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "adapters.safetensors").write_bytes(b"\0" * 8)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": kind, "num_layers": 2, "lora_parameters": {"rank": 4}}))
    (folder / "run.json").write_text(json.dumps({"model": str(model), "parallel": parallel,
                                                 "pipeline_layers": stages}))
    return folder


def layered_model(path: str, layers: int) -> Path:
    """A model folder whose config says how many layers its body has."""
    folder = fake_inputs.model(path)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": layers}))
    fake_inputs.write_manifest(folder, source=path)
    return folder


def recorded() -> Recorded:
    return Recorded("inventory/lab/hosts.yml", Cluster.from_json(lab_layout()), Path("/nowhere"))


def plan(*runs: Path, **options: object) -> serve.Plan:
    return serve.plan(recorded(), serve.Options(runs=tuple(str(r) for r in runs), **options), "20261125-1")


def test_a_tensor_parallel_run_is_served_sharded_on_every_node_through_a_tunnel(tmp_path: Path):
    model = fake_inputs.model("/m/tiny")
    first, second = run(tmp_path, "20261125-101", model), run(tmp_path, "20261125-102", model, "data")
    the_plan = plan(first, second)
    steps = [step for step in the_plan.steps if step != sync.WAIT]
    assert [label for label, _ in steps] == [
        "sync code to node1", "sync code to node2", "copy the model to node1",
        "copy the model from node1 to node2 over the cluster link",
        "verify the model's checksums on node1", "verify the model's checksums on node2",
        "send run 20261125-101's adapters to node1", "send run 20261125-101's adapters to node2",
        "send run 20261125-102's adapters to node1", "send run 20261125-102's adapters to node2"]
    sent = shlex.join(steps[6][1])
    # Only the run's two adapter files leave the controller.
    assert "--include=/adapter_config.json --include=/adapters.safetensors '--exclude=*'" in sent
    assert sent.endswith("root@10.77.5.11:/opt/mlx-cluster/work/adapters/20261125-101/")
    line = the_plan.launch[-1]
    assert "mpirun" in line and "-np 2" in line
    assert ("-m training.serve --model /opt/mlx-cluster/models/tiny --base-name tiny "
            "--adapter=20261125-101=/opt/mlx-cluster/work/adapters/20261125-101 "
            "--adapter=20261125-102=/opt/mlx-cluster/work/adapters/20261125-102 --host 127.0.0.1 --port 8080 "
            "--max-tokens 512 --expected-world-size 2 --tag serve-20261125-1") in line
    assert shlex.join(the_plan.tunnel or []).endswith(
        "-N -o ExitOnForwardFailure=yes -L 127.0.0.1:8080:127.0.0.1:8080 root@10.77.5.11")
    assert the_plan.url == "http://127.0.0.1:8080/v1"
    assert "tensor-parallel across node1, node2, 2 ranks" in the_plan.notices[0]
    assert the_plan.marker == "serve-20261125-1"


def test_a_data_parallel_run_is_served_by_one_process_on_the_launcher(tmp_path: Path):
    model = fake_inputs.model("/m/tiny")
    the_plan = plan(run(tmp_path, "20261125-103", model, "data"), port=9000)
    assert the_plan.cluster.world_size == 1 and the_plan.cluster.head.name == "node1"
    assert "mpirun" not in the_plan.launch[-1] and "--expected-world-size 1" in the_plan.launch[-1]
    assert "one process on node1" in the_plan.notices[0]
    assert the_plan.url == "http://127.0.0.1:9000/v1"
    # Asked for, the same run is served sharded.
    assert plan(run(tmp_path, "20261125-104", model, "data"), parallel="tensor").cluster.world_size == 2


def test_listening_on_a_network_needs_a_key_and_no_tunnel(tmp_path: Path):
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    the_plan = plan(run(tmp_path, "20261125-105", fake_inputs.model("/m/tiny")), host="0.0.0.0",
                    api_key_file=str(key))
    assert the_plan.tunnel is None and the_plan.url == "http://10.77.5.11:8080/v1"
    assert "listening on 0.0.0.0: whoever reaches node1 on port 8080 with the key can use the API" \
        in the_plan.notices
    assert "--api-key-file /opt/mlx-cluster/work/serve-20261125-1/key" in the_plan.launch[-1]
    assert [label for label, _ in the_plan.steps if "API key" in label] == ["send the API key to node1"]


def test_a_server_on_a_network_without_a_key_is_refused(tmp_path: Path):
    mine = run(tmp_path, "20261125-109", fake_inputs.model("/m/tiny"))
    for host in ("0.0.0.0", "::", "10.77.5.11"):
        with pytest.raises(UserError, match=rf"--host {host}: a server on a network with no --api-key-file "
                                            "lets anyone who reaches node1 use it: give --api-key-file FILE"):
            plan(mine, host=host)


def test_a_host_the_launcher_does_not_hold_is_refused_before_anything_is_sent(tmp_path: Path):
    """Asked of the launcher itself (here this machine, through the same shell line as a remote one):
    a documentation-only address (RFC 5737) is no one's; another loopback address is its own."""
    layout = lab_layout()
    venv = Path(sys.executable).parent.parent
    (tmp_path / "env.sh").write_text(f'export PATH="{venv}/bin:$PATH"\n')
    layout["nodes"] = [dict(layout["nodes"][0], env_file=str(tmp_path / "env.sh"), venv=str(venv),
                            connection={"type": "local"})]
    head = Cluster.from_json(layout).head
    with pytest.raises(UserError, match=r"--host 192\.0\.2\.7: not an address of node1, the launcher"):
        serve.check_host(head, "192.0.2.7")
    serve.check_host(head, "127.0.0.2")
    serve.check_host(head, "0.0.0.0")


@pytest.mark.parametrize(("given", "read"), [("::1", "::1"), ("0.0.0.0", "0.0.0.0"),
                                             ("localhost", "localhost"), (" 10.0.0.1", "10.0.0.1")])
def test_host_is_an_address_or_localhost(given: str, read: str):
    assert flags.address(given, "--host") == read


@pytest.mark.parametrize("given", ["node1.local", "10.0.0.256", "0.0.0.0; rm -rf /", ""])
def test_a_host_that_is_no_address_is_refused(given: str):
    if not given:
        assert flags.address(given, "--host") is None
        return
    with pytest.raises(UserError, match="give an IP address of the launcher"):
        flags.address(given, "--host")


def test_what_cannot_be_served_is_refused_with_what_to_do(tmp_path: Path):
    tiny, other = fake_inputs.model("/m/tiny"), fake_inputs.model("/m/other")
    mine = run(tmp_path, "20261125-106", tiny)
    with pytest.raises(UserError, match="trained on different base models"):
        plan(mine, run(tmp_path, "20261125-107", other))
    with pytest.raises(UserError, match="must be tensor, pipeline or single"):
        plan(mine, parallel="sideways")
    with pytest.raises(UserError, match=r"fine_tune_type full.*mlx_lm fuse"):
        plan(run(tmp_path, "20261125-108", tiny, kind="full"))
    with pytest.raises(UserError, match="given twice"):
        plan(mine, mine)
    with pytest.raises(UserError, match=r"--run .*: no adapter_config\.json"):
        plan(tmp_path / "20261125-106" / "..")
    with pytest.raises(UserError, match=r"api-key-file .* no such file"):
        plan(mine, api_key_file=str(tmp_path / "missing"))
    # Several runs over one base, one given with --model: served over that base.
    assert plan(mine, run(tmp_path, "20261125-109", other), model=str(tiny)).cluster.world_size == 2


def test_a_pipeline_run_is_served_in_its_recorded_stages_on_every_node(tmp_path: Path):
    model = layered_model("/m/deep", 30)
    the_plan = plan(run(tmp_path, "20261125-111", model, "pipeline", stages=[18, 12]))
    assert the_plan.mode == "pipeline" and the_plan.cluster.world_size == 2 and the_plan.stages == (18, 12)
    line = the_plan.launch[-1]
    assert "mpirun" in line and "-np 2" in line
    assert "--expected-world-size 2" in line and line.endswith("--parallel pipeline --pipeline-layers 18,12")
    assert "in pipeline stages of 18,12 layers across node1, node2, as run 20261125-111 trained them" \
        in the_plan.notices[0]
    # Stages recorded for other ranks than the cluster serves with: as equal as can be.
    other = plan(run(tmp_path, "20261125-112", model, "pipeline", stages=[10, 10, 10]))
    assert other.stages == (15, 15) and other.launch[-1].endswith("--pipeline-layers 15,15")
    assert "as equal as can be" in other.notices[0]
    # Asked for, a data-parallel run is served in stages; a pipeline run by one process.
    asked = plan(run(tmp_path, "20261125-113", model, "data"), parallel="pipeline")
    assert asked.mode == "pipeline" and asked.stages == (15, 15)
    single = plan(run(tmp_path, "20261125-114", model, "pipeline"), parallel="single")
    assert single.cluster.world_size == 1 and "--parallel" not in single.launch[-1]


def test_the_mode_is_as_the_runs_trained_tensor_first_then_pipeline_else_single(tmp_path: Path):
    model = layered_model("/m/deep", 30)
    tensor, pipeline, data = (run(tmp_path, f"20261125-12{i}", model, mode)
                              for i, mode in enumerate(("tensor", "pipeline", "data")))
    assert serve.default_mode([data, pipeline]) == "pipeline"
    assert serve.default_mode([pipeline, tensor]) == "tensor"
    assert serve.default_mode([data]) == "single"
    assert plan(data, pipeline).mode == "pipeline" and plan(tensor, pipeline).mode == "tensor"
    assert "--parallel" not in plan(tensor).launch[-1]


def test_more_ranks_than_layers_is_refused_in_pipeline_mode_with_what_to_do(tmp_path: Path):
    shallow = layered_model("/m/shallow", 1)
    with pytest.raises(UserError, match=r"--parallel pipeline on 2 ranks: .*shallow has 1 layers, and each "
                                        r"stage holds at least one; serve it with --parallel single or "
                                        r"tensor, or on an inventory of at most 1 ranks"):
        plan(run(tmp_path, "20261125-131", shallow, "pipeline"))
    # A model whose layers are not said here: the ranks split them equally, and check them on load.
    unknown = plan(run(tmp_path, "20261125-132", fake_inputs.model("/m/tiny"), "pipeline"))
    assert unknown.stages is None and unknown.launch[-1].endswith("--parallel pipeline")


def test_the_context_and_the_prompt_cache_asked_for_reach_the_ranks(tmp_path: Path):
    model = fake_inputs.model("/m/tiny")
    line = plan(run(tmp_path, "20261125-105", model, "data"), context=4096, prompt_cache=3).launch[-1]
    assert "--max-tokens 512 --expected-world-size 1 --context 4096 --prompt-cache-size 3 " in line
    # Not asked for: the model's own context, and mlx-lm's prompt cache until the nodes are probed.
    line = plan(run(tmp_path, "20261125-106", model, "data")).launch[-1]
    assert "--context" not in line and "--prompt-cache-size" not in line
