"""The controller's run records (mlxcluster/launch/runs.py): which run --resume continues; and the relay
of a launch's output (mlxcluster/launch/relay.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mlxcluster.launch import relay, runs


def test_resume_picks_the_latest_unfinished_run_and_refuses_a_finished_one(tmp_path: Path):
    for run_id, finished in (("20260101-000000", False), ("20260102-000000", False),
                             ("20260103-000000", True)):
        (tmp_path / run_id).mkdir()
        runs.write_info(tmp_path / run_id, {"data": "/d", "model": "/m"})
        (tmp_path / run_id / "config.yaml").write_text("iters: 10\n")
        if finished:
            (tmp_path / run_id / "summary.json").write_text("{}")
    assert runs.resumable(tmp_path, None)[0] == "20260102-000000"
    assert runs.resumable(tmp_path, "20260101-000000") == ("20260101-000000", {"data": "/d", "model": "/m"})
    for bad, message in (("20260103-000000", "finished all its steps: nothing to resume"),
                         ("20990101-000000", "no run.json in")):
        with pytest.raises(runs.RunError, match=message):
            runs.resumable(tmp_path, bad)
    (tmp_path / "20260102-000000" / "config.yaml").unlink()
    with pytest.raises(runs.RunError, match="stopped before it started training"):
        runs.resumable(tmp_path, "20260102-000000")


def test_the_resume_hint_names_the_latest_whole_checkpoint(tmp_path: Path):
    assert runs.resume_hint(tmp_path) == ""
    for step in ("0000020", "0000040"):
        (tmp_path / "checkpoints" / step).mkdir(parents=True)
    whole = tmp_path / "checkpoints" / "0000020"  # as checkpoints were before they had digests
    (whole / "state.json").write_text('{"step": 20, "random_key": [0, 1]}')
    for name in ("adapters.safetensors", "optimizer.safetensors"):
        (whole / name).write_bytes(b"x")
    (tmp_path / "checkpoints" / ".0000060.partial").mkdir()
    assert runs.resume_hint(tmp_path) == (
        f"; its checkpoint at step 20 continues with: invoke train --resume {tmp_path.name}")


def test_the_relay_stops_a_launch_that_outlives_a_stalled_rank(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(relay, "STALL_GRACE", 0.5)
    script = ("import sys, time\n"
              "print('rank 1: error: no progress for 30 s (allowed 30 s)', flush=True)\n"
              "time.sleep(30)\n")
    stopped = []
    launch = [sys.executable, "-c", script]

    def stop() -> None:
        stopped.append(True)
        import subprocess

        subprocess.run(["pkill", "-f", "no progress for 30 s"], check=False)

    relayed = relay.relay(launch, on_stall=stop)
    assert stopped == [True]
    assert relayed.code != 0 and "rank 1: error: no progress for 30 s" in relayed.output
    assert json.dumps(relayed.output)  # the tail is text


FROZEN_JOB = """import signal, subprocess, sys, time
# A rank of run runs/20261126-000000: its child, frozen; itself, stalled, as the watchdog says.
# The child's output apart: the relay reads the job's to its end.
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "runs/20261126-000000"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
child.send_signal(signal.SIGSTOP)
time.sleep(0.3)
print(f"child {child.pid}", flush=True)
print("rank 0: error: no progress for 30 s (allowed 30 s)", flush=True)
sys.exit(1)
"""
# The frozen child outlives the job (the test ends it): the controller's look at the nodes may come
# as late as a loaded machine makes it, and still find it.


def _end_child(output: str) -> None:
    found = re.search(r"^child (\d+)$", output, re.M)
    if found:
        os.kill(int(found[1]), signal.SIGKILL)


def test_a_stall_names_the_node_where_a_rank_of_the_job_was_frozen(tmp_path: Path):
    """supervise asks every node for the job's stopped processes as soon as a rank reports a stall
    (for real: ps on this machine, a node of a local cluster)."""
    from mlxcluster.describe.cluster import Cluster
    from tests.unit.mlxcluster.jobs.test_train import lab_layout

    layout = lab_layout()
    layout["nodes"] = [dict(layout["nodes"][0], connection={"type": "local"})]
    cluster = Cluster.from_json(layout)
    relayed = relay.supervise(cluster, [sys.executable, "-c", FROZEN_JOB], "runs/20261126-000000",
                              stdin=subprocess.DEVNULL)
    _end_child(relayed.output)
    assert relayed.code == 1 and relayed.frozen == [cluster.head.name]
    # A stall without a frozen rank (a link gone) names none.
    still = FROZEN_JOB.replace("child.send_signal(signal.SIGSTOP)", "pass")
    relayed = relay.supervise(cluster, [sys.executable, "-c", still], "runs/20261126-000000",
                              stdin=subprocess.DEVNULL)
    _end_child(relayed.output)
    assert relayed.code == 1 and relayed.frozen == []


def test_the_relay_holds_back_marked_lines_stamps_lines_and_gives_up_at_a_timeout(capfd):
    script = ("import time\n"
              "print('one', flush=True)\n"
              "print('RESULT {\"a\": 1}', flush=True)\n"
              "time.sleep(0.3)\n"
              "print('two', flush=True)\n")
    relayed = relay.relay([sys.executable, "-c", script], hide="RESULT ", stamp=True)
    assert relayed.code == 0
    assert relayed.held_back == ['RESULT {"a": 1}']
    assert [line for _, line in relayed.stamped] == ["one", 'RESULT {"a": 1}', "two"]
    assert relayed.stamped[2][0] - relayed.stamped[0][0] >= 0.25
    assert capfd.readouterr().out == "one\ntwo\n"  # shown as it came, but for the held-back line
    slow = relay.relay([sys.executable, "-c", "import time; print('x', flush=True); time.sleep(30)"],
                       timeout=1.5)
    assert slow.code is None and slow.output == "x\n"


def test_a_damaged_run_record_is_refused_with_what_to_do(tmp_path):
    from mlxcluster.launch.runs import RunError, read_info, resumable

    run = tmp_path / "runs" / "20261125-000000"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("iters: 5\n")
    for text, says in (('{"data": "/d/p", "mod', "cannot be read"), ("[1]", "holds no run record"),
                       ("\xff\xfe", "cannot be read")):
        (run / "run.json").write_text(text, encoding="latin-1")
        with pytest.raises(RunError, match=says):
            read_info(run)
        with pytest.raises(RunError, match=says):
            resumable(tmp_path / "runs", run.name)
    (run / "run.json").write_text('{"model": "/m"}')
    with pytest.raises(RunError, match="names no data: the run's record is damaged"):
        runs.recorded_path(run, read_info(run), "data")


def test_generate_refuses_a_folder_that_holds_no_adapters_naming_what_it_lacks(tmp_path):
    from mlxcluster.launch.runs import RunError, adapters_of, model_for

    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(RunError, match=r"no adapter_config\.json"):
        adapters_of(run)
    (run / "adapter_config.json").write_text("{}")
    (run / "adapters.safetensors").symlink_to(tmp_path / "gone.safetensors")  # a broken link
    with pytest.raises(RunError, match=r"no adapters\.safetensors \(a broken link"):
        adapters_of(run)
    (run / "adapters.safetensors").unlink()
    (run / "adapters.safetensors").write_bytes(b"")
    with pytest.raises(RunError, match="lacks num_layers and lora_parameters"):
        adapters_of(run)
    (run / "adapter_config.json").write_text('{"num_layers": 1, "lora_parameters": {}}')
    assert adapters_of(run) == run
    with pytest.raises(RunError, match=r"has no run\.json: pass --model"):
        model_for(run, None)
    with pytest.raises(RunError, match=r"is not a model folder: it has no config\.json"):
        model_for(run, str(run))


# --- invoke generate ----------------------------------------------------------------------------------

INVOKE = str(Path(sys.executable).parent / "invoke")
REPO = Path(__file__).resolve().parents[4]


def invoke_generate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([INVOKE, "generate", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"}, stdin=subprocess.DEVNULL, timeout=300)


def stock_answer(model: Path, prompt: str, *extra: str) -> str:
    """Stock `mlx_lm generate`'s greedy answer (its text between its two ===== lines)."""
    out = subprocess.run([sys.executable, "-m", "mlx_lm", "generate", "--model", str(model),
                          "--prompt", prompt, "--max-tokens", "6", "--temp", "0", *extra],
                         capture_output=True, text=True, check=True, timeout=300)
    return out.stdout.split("==========\n")[1].strip()


def test_invoke_generate_prints_the_answers_stock_mlx_lm_gives_with_and_without_the_adapters(uneven_run):
    model, run = uneven_run / "model", uneven_run / "single"
    proc = invoke_generate("--prompt", "count 001", "--adapter", str(run), "--model", str(model),
                           "--max-tokens", "6")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    base = stock_answer(model, "count 001")
    tuned = stock_answer(model, "count 001", "--adapter-path", str(run))
    assert base != tuned  # the adapters changed the answer
    row = next(line for line in proc.stdout.splitlines() if tuned in line)
    assert [cell.strip() for cell in row.split("│")[1:3]] == [base, tuned]
    assert "base: model" in proc.stdout and "fine-tuned: single" in proc.stdout


def test_invoke_generate_says_what_is_wrong_with_the_adapters_or_the_model(uneven_run, tmp_path):
    from tests.unit.training.model.test_folder import tiny_model

    model, run = uneven_run / "model", uneven_run / "single"
    other = tmp_path / "wider"
    tiny_model(other, hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
    for args, said in (
        (["--adapter", str(tmp_path)], f"--adapter {tmp_path}: no adapter"),
        (["--adapter", str(run), "--model", str(tmp_path)], f"{tmp_path} is not a model folder"),
        (["--adapter", str(run), "--model", str(other)], f"the adapters in {run} do not fit {other}"),
        (["--adapter", str(run), "--model", str(model), "--max-tokens", "0"], "--max-tokens"),
    ):
        proc = invoke_generate("--prompt", "count 001", *args)
        assert proc.returncode == 1 and said in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_the_run_folder_is_read_from_the_summary_table_invoke_train_prints():
    printed = "==> training on 2 ranks\n        run 20261125-094932        \n│ world_size │ 2 │\n"
    assert runs.named_in(printed) == runs.RUNS / "20261125-094932"
    assert runs.named_in("error: no model\n") is None
    # A message that starts with a run's id is not the table's title.
    assert runs.named_in("run 20261126-151026 stopped before it started training: start a new run\n") is None


def test_a_finished_run_says_how_to_serve_and_fuse_it(tmp_path):
    run = tmp_path / "20261125-101010"
    run.mkdir()
    (run / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "lora"}))
    said = "\n".join(runs.next_steps(run, "inventory/studio/hosts.yml"))
    assert "invoke serve -i inventory/studio/hosts.yml --run 20261125-101010" in said
    assert "invoke fuse --run 20261125-101010" in said
    here = "\n".join(runs.next_steps(run, "inventory/local/hosts.yml"))
    assert "invoke serve --run 20261125-101010" in here
    (run / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "full"}))
    assert "invoke serve" not in "\n".join(runs.next_steps(run))  # a whole model: fused, not an adapter


def test_an_error_of_on_line_stops_the_relayed_command_instead_of_waiting_for_it():
    """invoke serve opens its tunnel from on_line: a port taken here fails it, and the relay must
    not then wait for a launch that runs for ever."""
    import time

    from mlxcluster.errors import UserError

    def on_line(line: str) -> None:
        if "ready" in line:
            raise UserError("could not forward the port")

    started = time.monotonic()
    with pytest.raises(UserError, match="could not forward"):
        relay.relay(["bash", "-c", "echo ready; sleep 60"], on_line=on_line, stdin=subprocess.DEVNULL)
    assert time.monotonic() - started < 20


def test_each_checkpoint_comes_back_as_it_is_saved_and_one_being_written_stays(tmp_path: Path):
    """A launcher lost for good, or a controller killed, leaves the controller the latest checkpoint
    and the settings (sync.CheckpointPulls, fed the lines rank 0 prints), real rsync from a local
    node."""
    from mlxcluster.describe.cluster import Node
    from mlxcluster.launch import sync

    launcher = tmp_path / "launcher" / "run"
    (launcher / "checkpoints" / "0000020").mkdir(parents=True)
    (launcher / "checkpoints" / "0000020" / "state.json").write_text("{}")
    (launcher / "checkpoints" / ".0000040.partial").mkdir()  # being written
    results = tmp_path / "runs" / "run"
    results.mkdir(parents=True)
    (launcher / "config.yaml").write_text("iters: 40\n")
    (launcher / ".metrics.jsonl.partial").write_text("")  # being written
    pulls = sync.CheckpointPulls(Node("here", "127.0.0.1", 1, connection={"type": "local"}), str(launcher),
                                 results)
    pulls("iter 10/40  loss 2.0  lr 1.00e-03")  # not a save: nothing starts
    assert pulls._thread is None
    pulls(f"iter 20/40  saved {launcher}/checkpoints/0000020")
    pulls.wait()
    assert (results / "checkpoints" / "0000020" / "state.json").read_text() == "{}"
    assert sorted(p.name for p in (results / "checkpoints").iterdir()) == ["0000020"]
    # What --resume needs besides: the settings the run started with.
    assert sorted(p.name for p in results.iterdir()) == ["checkpoints", "config.yaml"]


def test_runs_started_in_the_same_second_get_folders_of_their_own(tmp_path, monkeypatch):
    monkeypatch.setattr(runs, "RUNS", tmp_path / "runs")
    monkeypatch.setattr(runs, "new_id", lambda: "20261128-054012")
    claimed = [runs.claim_id() for _ in range(3)]
    assert claimed == ["20261128-054012", "20261128-054012-2", "20261128-054012-3"]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(claimed)
    (tmp_path / "runs" / claimed[1] / "run.json").write_text("{}")
    for run_id in claimed[1:]:  # one never started, one did: that one is kept
        with pytest.raises(RuntimeError), runs.released_if_unstarted(run_id):
            raise RuntimeError("the checks before the run failed")
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == claimed[:2]
