"""A rank's beats and exit record (training/loop/heartbeat.py), as the controller reads them
(mlxcluster/launch/liveness.py): the two sides hold the same words."""

from __future__ import annotations

import time

from mlxcluster.launch.liveness import Liveness
from training.loop import heartbeat
from training.loop.heartbeat import Heartbeat


def test_the_launch_asks_for_beats_and_a_rank_started_by_hand_prints_none():
    assert Heartbeat.from_env(3, {heartbeat.ENV: "2.0"}).every == 2.0
    assert Heartbeat.from_env(3, {}) is None
    assert Heartbeat.from_env(3, {heartbeat.ENV: "no"}) is None
    assert Heartbeat.from_env(3, {heartbeat.ENV: "0"}) is None


def test_beats_say_progress_step_and_phase_and_the_controller_reads_them_all():
    written: list[str] = []
    beats = Heartbeat(1, every=0.05, write=written.append)
    beats.start()
    beats.progressed()
    beats.stepped(7)
    with beats.busy("save"):
        time.sleep(0.12)
    beats.stop()
    beats.exit_record(0)
    assert written[0] == f"{heartbeat.BEAT} rank=1 progress=0 step=0 phase=train\n"
    assert f"{heartbeat.BEAT} rank=1 progress=1 step=7 phase=save\n" in written
    assert written[-2] == f"{heartbeat.BEAT} rank=1 progress=1 step=7 phase=train\n"
    assert written[-1] == f"{heartbeat.EXIT} rank=1 code=0\n"
    seen = Liveness(2)
    assert seen.take("".join(written).encode()) == b""  # every line is a record, none shown
    assert (seen.ranks[1].progress, seen.ranks[1].step, seen.ranks[1].code) == (1, 7, 0)
    assert seen.unfinished() == [0]  # rank 0 said nothing


def test_a_hang_is_injected_on_its_rank_alone():
    environ = {heartbeat.FAULT: "hang:1:5"}
    assert heartbeat.hang_at(1, environ) == 5
    assert heartbeat.hang_at(0, environ) is None
    for spec in ("", "hang", "hang:x:5", "kill:1:5", "hang:1"):
        assert heartbeat.hang_at(1, {heartbeat.FAULT: spec}) is None
