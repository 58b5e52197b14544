"""The parts a resumable run is made of: the seed-only batch order, whole-or-nothing checkpoint
files, and the watchdog that stops a stalled rank (in a real process)."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from training import config as tc
from training.data.batches import seeded_iterate_batches
from training.loop import checkpoint
from training.loop.watchdog import StallWatchdog

REPO = Path(__file__).resolve().parents[4]
# (tokens, offset) pairs, as mlx-lm's datasets give them; lengths vary so sorting matters.
DATASET = [([i + 1] * (i % 5 + 2), 0) for i in range(12)]


def first_batches(iterate, count: int, draw_between: bool = False) -> list[list[list[int]]]:
    batches = iterate(DATASET, batch_size=2, max_seq_length=64, loop=True)
    taken = []
    for batch, _lengths in itertools.islice(batches, count):
        taken.append(batch.tolist())
        if draw_between:
            np.random.permutation(10)  # what a validation does with numpy's global RNG
    return taken


def test_the_batch_order_depends_on_the_seed_alone():
    plain = first_batches(seeded_iterate_batches(7), 15)
    assert first_batches(seeded_iterate_batches(7), 15, draw_between=True) == plain
    assert first_batches(seeded_iterate_batches(8), 15) != plain
    # A resumed run trains on exactly the batches that come after its checkpoint's step.
    assert first_batches(seeded_iterate_batches(7, skip=4), 11) == plain[4:]
    # Validation starts from the same order every time.
    iterate = seeded_iterate_batches(7)
    once = [b.tolist() for b, _ in iterate(DATASET, batch_size=2, max_seq_length=64)]
    assert [b.tolist() for b, _ in iterate(DATASET, batch_size=2, max_seq_length=64)] == once
    assert len(once) == 6


def test_a_checkpoint_is_whole_or_absent(tmp_path: Path):
    weights = {"a": mx.ones((2, 3)), "b": mx.zeros((4,))}
    optimizer = {"step": mx.array(4, mx.uint64), "a.m": mx.ones((2, 3))}
    assert checkpoint.latest(tmp_path) is None
    first = checkpoint.save(tmp_path, 4, weights, optimizer, {"trained_tokens": 10, "random_key": [0, 1]})
    assert first == tmp_path / "checkpoints" / "0000004"
    # What a writer that died mid-way leaves: a partial directory, a directory without state.
    (tmp_path / "checkpoints" / ".0000008.partial").mkdir()
    (tmp_path / "checkpoints" / "0000009").mkdir()
    found = checkpoint.latest(tmp_path)
    assert found is not None and found.step == 4 and found.state["trained_tokens"] == 10
    adapters, state = checkpoint.load_arrays(found)
    assert mx.array_equal(adapters["a"], weights["a"]).item() and state["step"].item() == 4

    # Saving the same step again (a run resumed from before it) replaces it whole.
    checkpoint.save(tmp_path, 4, {"a": mx.full((2, 3), 2.0)}, optimizer,
                    {"trained_tokens": 11, "random_key": [0, 1]})
    again = checkpoint.latest(tmp_path)
    assert again is not None and again.state["trained_tokens"] == 11
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        ".0000008.partial",
        "0000004",
        "0000009",
    ]

    target = tmp_path / "adapters.safetensors"
    checkpoint.save_safetensors(target, weights)
    assert set(mx.load(str(target))) == {"a", "b"}  # type: ignore[arg-type]
    assert [p.name for p in tmp_path.iterdir() if "partial.safetensors" in p.name] == []


def test_settings_that_change_the_training_are_named():
    saved = {"learning_rate": 1e-3, "iters": 10, "steps_per_report": 2}
    now = {"learning_rate": 1e-3, "iters": 20, "steps_per_report": 5}
    assert checkpoint.settings_differences(saved, now) == [
        "iters: the checkpoint was made with 10, this run has 20"
    ]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_allowance_grows_with_the_slowest_step():
    clock = Clock()
    dog = StallWatchdog(timeout=60, first_timeout=600, clock=clock)
    assert dog.allowance() == 600  # loading, compiling and the first step
    clock.now = 100.0
    dog.pet()  # a validation batch before the first step
    assert dog.allowance() == 600
    clock.now = 400.0
    dog.step()
    dog.pet()
    assert dog.allowance() == 3000  # until a second step, the first one's 300 s set the pace
    clock.now = 402.0
    dog.step()
    dog.pet()
    assert dog.allowance() == 60  # 10 x 2 s is less than the floor: compiling no longer counts
    clock.now = 422.0
    dog.step()
    dog.pet()
    assert dog.allowance() == 200  # 10 x the 20 s step
    clock.now = 621.0
    assert dog.overdue() is None  # 199 s of the 200 allowed
    clock.now = 623.0
    assert dog.overdue() == 201.0


def test_a_run_whose_steps_take_longer_than_the_timeout_is_not_stopped_at_its_second_step():
    # bench.train's stock-BLAS part: about 100 s a step against a 30 s stall_timeout.
    clock = Clock()
    dog = StallWatchdog(timeout=30, first_timeout=600, clock=clock)
    clock.now = 20.0
    dog.pet()  # the first validation batch
    for step in range(1, 4):
        clock.now += 100.0
        assert dog.overdue() is None, step
        dog.step()
        dog.pet()
        assert dog.allowance() == 1000


STALLED_RANK = textwrap.dedent("""
    import sys, time
    from training.loop.watchdog import StallWatchdog
    dog = StallWatchdog(timeout=float(sys.argv[1]), first_timeout=30, describe=lambda: "rank 1: ")
    dog.start()
    for _ in range(int(sys.argv[2])):  # steps that complete
        time.sleep(float(sys.argv[4]) if len(sys.argv) > 4 else 0.1)
        dog.step()
        dog.pet()
    def waiting_for_the_all_reduce():
        time.sleep(60)
    if sys.argv[3] == "hang":
        waiting_for_the_all_reduce()
    dog.stop()
    print("finished")
""")


def run_rank(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", STALLED_RANK, *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    return proc, time.perf_counter() - start


def test_a_stalled_process_stops_itself_and_says_where_it_waited():
    proc, took = run_rank("1", "5", "hang")
    assert proc.returncode == 1
    assert re.search(r"rank 1: error: no progress for [12] s \(allowed 1 s\)", proc.stderr), proc.stderr
    assert "waiting_for_the_all_reduce" in proc.stderr  # the stack of the stuck thread
    assert took < 10


def test_a_process_that_keeps_progressing_is_left_alone():
    proc, _ = run_rank("1", "25", "finish")  # 2.5 s of steps against a 1 s allowance
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "finished\n"


def test_a_process_whose_steps_are_slower_than_the_timeout_finishes():
    proc, _ = run_rank("1", "3", "finish", "1.6")  # 1.6 s steps against a 1 s stall_timeout
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "finished\n"


def test_a_single_process_is_not_told_about_other_ranks():
    from training.finetune import watchdog_for
    from training.loop.progress import ProgressDisplay

    group = mx.distributed.init()
    assert group.size() == 1
    config = tc.merge_config({}, {"stall_timeout": 30})
    dog = watchdog_for(config, group, ProgressDisplay(1, None))
    assert "single process" in dog.cause and "another rank" not in dog.cause


@pytest.mark.parametrize("bad", ["0", "-5"])
def test_stall_timeout_must_be_positive(bad: str):
    config = tc.merge_config({}, {"stall_timeout": int(bad)})
    assert any("stall_timeout must be at least 1" in p for p in tc.config_problems(config))


def test_state_json_is_plain_json(tmp_path: Path):
    path = checkpoint.save(tmp_path, 1, {"a": mx.ones(1)}, {"step": mx.array(1)}, {"x": [1, 2]})
    state = json.loads((path / "state.json").read_text())
    arrays = ("adapters.safetensors", "optimizer.safetensors")
    assert state == {"step": 1, "x": [1, 2],
                     "files": {name: checkpoint.file_digest(path / name) for name in arrays}}


def saved_steps(tmp_path: Path, *steps: int) -> None:
    for step in steps:
        checkpoint.save(tmp_path, step, {"a": mx.full((2, 3), float(step))}, {"step": mx.array(step)},
                        {"random_key": [0, step]})


@pytest.mark.parametrize(("damage", "why"), [
    (lambda p: (p / "adapters.safetensors").write_bytes((p / "adapters.safetensors").read_bytes()[:40]),
     "adapters.safetensors is not the file that was saved"),
    (lambda p: (p / "optimizer.safetensors").write_bytes(b"garbage"),
     "optimizer.safetensors is not the file that was saved"),
    (lambda p: (p / "state.json").write_text('{"step": 30, "files": {}}'), "state.json lacks random_key"),
    (lambda p: (p / "state.json").write_text((p / "state.json").read_text()[:25]),
     "state.json is unreadable"),
    (lambda p: (p / "adapters.safetensors").unlink(), "no adapters.safetensors"),
])
def test_a_damaged_checkpoint_is_passed_over_for_the_newest_whole_one_by_rank_and_controller(
        tmp_path: Path, damage, why):
    from mlxcluster.launch import runs
    saved_steps(tmp_path, 10, 20, 30)
    damage(tmp_path / "checkpoints" / "0000030")
    passed: list[str] = []
    found = checkpoint.latest(tmp_path, passed)
    assert found is not None and found.step == 20
    assert passed == [f"checkpoint 0000030 is damaged ({why}" + passed[0].split(why, 1)[1]]
    assert runs.latest_checkpoint(tmp_path) == 20  # the controller names the same step
    adapters, _ = checkpoint.load_arrays(found)
    assert adapters["a"].tolist()[0][0] == 20.0


FULL_DISK = """
import json, os, sys
from pathlib import Path
import mlx.core as mx
from training.loop import checkpoint
run = Path(sys.argv[1])
arrays = {"w": mx.arange(2000, dtype=mx.float32)}
checkpoint.save(run, 10, arrays, arrays, {"random_key": [0, 1]})
filler = os.open(run / "filler", os.O_WRONLY | os.O_CREAT)  # the rest of the disk, taken
try:
    while True:
        os.write(filler, b"x" * 4096)
except OSError:
    os.close(filler)
try:
    checkpoint.save(run, 20, arrays, arrays, {"random_key": [0, 1]})
    print(json.dumps({"error": None}))
except OSError as error:
    print(json.dumps({"error": error.errno, "said": str(error),
                      "left": sorted(p.name for p in (run / "checkpoints").iterdir()),
                      "latest": checkpoint.latest(run).step}))
"""


def test_a_full_disk_while_a_checkpoint_is_written_keeps_the_one_before(tmp_path: Path):
    """A real full disk (a 256 KiB tmpfs in a mount namespace of its own): MLX's writer does not
    say that a write failed, so the file is checked against its own header; the checkpoint being
    written is removed, giving its space back, and the one before it stays the latest."""
    disk = tmp_path / "disk"
    disk.mkdir()
    script = (f"mount -t tmpfs -o size=256k tmpfs {disk} && "
              f"{sys.executable} -c '{FULL_DISK}' {disk}/run")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True,
                          cwd=REPO, stdin=subprocess.DEVNULL, timeout=120)
    if "mount" in proc.stderr and proc.returncode != 0:
        pytest.skip(f"no mount namespace here: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found["error"] == 28, found  # ENOSPC
    assert found["left"] == ["0000010"] and found["latest"] == 10



def test_a_write_mlx_does_not_report_failed_is_caught_by_the_file_s_own_header():
    """MLX's writer says nothing when every write fails (/dev/full, a real device): the file is
    read back against its header."""
    with pytest.raises(OSError, match="full: written short, its header cannot be read"):
        checkpoint.write_safetensors(Path("/dev/full"), {"w": mx.zeros((1000,))})
