"""The ranks' beats read out of a launch's output (mlxcluster/launch/liveness.py): every rank
alive or not, the run progressing or not, and a hang told from a slow step by the run's pace."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from mlxcluster.launch import builder, relay
from mlxcluster.launch.liveness import Liveness


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def beat(rank: int, progress: int, step: int, phase: str = "train", end: str = "\n") -> bytes:
    return f"@@mlx-cluster beat rank={rank} progress={progress} step={step} phase={phase}{end}".encode()


def run_of(world: int = 2, **options: float) -> tuple[Liveness, Clock]:
    clock = Clock()
    return Liveness(world, clock=clock, **options), clock


def steps(seen: Liveness, clock: Clock, gaps: list[float], world: int = 2) -> None:
    """Every rank beats a step after each gap (steps 1, 2, ...)."""
    for step, gap in enumerate(gaps, start=1):
        clock.now += gap
        seen.take(b"".join(beat(rank, step, step) for rank in range(world)))


def test_records_are_taken_out_of_the_output_wherever_they_fall_and_the_rest_is_kept():
    seen, _ = run_of()
    out = seen.take(b"iter 1/50 loss 2.1\n" + beat(0, 1, 1) + b"\rtrain  3/50 " + beat(1, 1, 1, end="\r\n"))
    assert out == b"iter 1/50 loss 2.1\n\rtrain  3/50 "
    # A record cut between two reads waits for its end; output that only looks like one is shown.
    whole = beat(0, 2, 2)
    assert seen.take(b"x" + whole[:9]) == b"x"
    assert seen.take(whole[9:] + b"@@ not a record\n") == b"@@ not a record\n"
    assert seen.ranks[0].progress == 2
    assert seen.take(b"tail @@mlx-clu") == b"tail "
    assert seen.rest() == b"@@mlx-clu"  # the output's end: it was output after all


def test_a_slow_step_is_not_a_hang_and_the_allowance_follows_the_run_s_slowest_step():
    seen, clock = run_of(margin=20, first_bound=500)
    steps(seen, clock, [100.0, 3.0, 5.0, 4.0])  # the first step (compiling) does not set the pace
    assert seen.slowest == 5.0 and seen.bound() == 25.0
    clock.now += 25.0
    assert seen.verdict() is None
    clock.now += 0.5
    seen.take(beat(0, 4, 4) + beat(1, 4, 4))  # alive, not progressing
    stuck = seen.verdict()
    assert stuck is not None and stuck.silent == () and stuck.step == 4
    assert "no rank progressed for 26 s after step 4 (the slowest step so far took 5.0 s; allowed 25 s)" \
        in stuck.line()
    assert seen.verdict() is None  # said once


def test_before_the_run_has_a_pace_the_first_bound_applies():
    seen, clock = run_of(first_bound=500)
    seen.take(beat(0, 0, 0) + beat(1, 0, 0))
    clock.now += 499
    assert seen.verdict() is None
    clock.now += 2
    assert seen.verdict() is not None


def test_nothing_is_judged_until_every_rank_is_heard_nor_while_one_saves_a_checkpoint_or_ends():
    seen, clock = run_of(world=3, margin=20)
    steps(seen, clock, [1.0, 1.0, 1.0], world=2)
    clock.now += 100
    assert seen.verdict() is None  # rank 2 never heard
    seen.take(beat(2, 3, 3, phase="save"))
    clock.now += 100
    assert seen.verdict() is None  # a save takes what it takes
    seen.take(beat(2, 3, 3))  # the save is over: its end is progress, not a step's length
    assert seen.slowest == 1.0
    clock.now += 10
    assert seen.verdict() is None
    seen.take(b"@@mlx-cluster exit rank=0 code=0\n")
    clock.now += 100
    assert seen.verdict() is None  # ranks are ending: the launcher says how


@pytest.mark.parametrize("heard", [(0,), (0, 1)])
def test_ranks_whose_beats_stopped_are_named_silent(heard):
    seen, clock = run_of(margin=20)
    steps(seen, clock, [1.0, 1.0, 1.0])
    clock.now += 15
    seen.take(b"".join(beat(rank, 3, 3) for rank in heard))
    clock.now += 10
    stuck = seen.verdict()
    assert stuck is not None and stuck.silent == tuple(r for r in (0, 1) if r not in heard)


def test_each_rank_s_exit_record_decides_whether_it_finished():
    seen, _ = run_of(world=3)
    seen.take(b"@@mlx-cluster exit rank=0 code=0\n@@mlx-cluster exit rank=2 code=2\n")
    assert seen.exit_codes() == {0: 0, 1: None, 2: 2}
    assert seen.unfinished() == [1, 2]


LAUNCH = """import sys, time
def beat(progress):
    for rank in (0, 1):
        sys.stdout.write(f"@@mlx-cluster beat rank={rank} progress={progress} step={progress} phase=train\\n")
for step in range(1, 6):
    print(f"iter {step}/50 loss 2.0", flush=True)
    beat(step)
    sys.stdout.flush()
    time.sleep(0.05)
for _ in range(600):  # alive, stuck
    beat(5)
    sys.stdout.flush()
    time.sleep(0.05)
"""


def test_the_relay_reads_the_beats_out_of_a_launch_and_stops_it_once_stuck():
    seen = Liveness(2, margin=0.5, first_bound=30)
    said = []

    def on_stuck(stuck) -> None:
        said.append(stuck)
        launched[0].kill()

    launched: list[subprocess.Popen] = []
    real_popen = subprocess.Popen

    def keep(*args, **kwargs):  # the launch's process, for on_stuck to stop as supervise does
        launched.append(real_popen(*args, **kwargs))
        return launched[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(relay.subprocess, "Popen", keep)
        relayed = relay.relay([sys.executable, "-c", LAUNCH], liveness=seen, on_stuck=on_stuck,
                              stdin=subprocess.DEVNULL)
    assert len(said) == 1 and relayed.stuck is said[0] and said[0].silent == ()
    assert "iter 5/50 loss 2.0" in relayed.output and "@@mlx-cluster" not in relayed.output
    assert said[0].idle < 5  # 0.5 s past a step of 0.05 s, not the first bound


def test_every_node_s_stop_ends_a_rank_that_ignores_sigterm(tmp_path):
    marker = f"{tmp_path}/runs/20261129-000000"
    rank = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                             "signal.SIG_IGN); time.sleep(60)", marker])
    time.sleep(0.3)
    subprocess.run(["bash", "-c", builder.stop_everywhere_line(marker, grace=1.0)], check=True, timeout=20)
    assert rank.wait(timeout=5) == -9  # asked, then killed


def test_the_end_of_a_run_is_not_a_hang_but_a_rank_that_never_ends_is():
    seen, clock = run_of(margin=20, first_bound=100)
    steps(seen, clock, [1.0, 1.0, 1.0])
    seen.take(beat(0, 3, 3, phase="finish") + beat(1, 3, 3, phase="finish"))
    clock.now += 60  # the checks across ranks, the summary, the plot: longer than a step
    seen.take(b"@@mlx-cluster exit rank=0 code=0\n")
    clock.now += 99
    assert seen.verdict() is None
    clock.now += 2
    stuck = seen.verdict()  # rank 1 never ended
    assert stuck is not None and stuck.bound == 100 and stuck.silent == (1,)


def test_steps_quicker_than_the_beats_set_the_pace_even_when_a_save_s_beat_shows_them_first():
    seen, clock = run_of(margin=15, first_bound=500)
    seen.take(beat(0, 0, 10) + beat(1, 0, 10))  # resumed at step 10
    clock.now += 2
    seen.take(beat(0, 10, 20, phase="save") + beat(1, 10, 20))  # ten steps within one beat
    clock.now += 1
    seen.take(beat(0, 10, 20))  # the save is over; then nothing progresses any more
    assert seen.slowest == 2.0 and seen.bound() == 17.0
    clock.now += 18
    assert seen.verdict() is not None
