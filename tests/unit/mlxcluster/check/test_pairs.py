"""invoke doctor's send/recv check (mlxcluster/check/pairs.py): the node side's lines from real
local ranks, started as the doctor starts them (its text with `python -c`), judged per pair."""

from __future__ import annotations

import sys

from mlxcluster.check import doctor, pairs
from tests.unit import rings
from tests.unit.mlxcluster.check.test_doctor import HOSTFILE, cluster, healthy
from tests.unit.training.test_finetune import run_launcher
from training.tools import send_recv


def job(*extra: str) -> tuple[int, str, str]:
    """The doctor's program on 3 local ring ranks (test_doctor's cluster: node1 ranks 0 and 1,
    node2 rank 2)."""
    program = pairs.program()
    argv = [*rings.launch(3), sys.executable, *program[1:], *extra]
    proc = run_launcher(argv, timeout=120)  # on a timeout, the ranks go down too
    return proc.returncode, proc.stdout + proc.stderr, "ring"


def test_the_marker_is_the_node_side_s():
    assert pairs.MARKER == send_recv.MARKER


def test_every_pair_green_on_real_ranks():
    checks = pairs.judge(cluster(), job())
    assert [(c.scope, c.ok) for c in checks] == [("node1 -> node1", True), ("node1 -> node2", True)]
    assert checks[1].name == "MLX send/recv, pipeline shapes, ranks 1 <-> 2 (ring)"


def test_a_wrong_value_names_its_pairs_tensor_and_values():
    checks = pairs.judge(cluster(), job("--corrupt-rank", "2"))
    assert [c.ok for c in checks] == [True, False]
    red = checks[1]
    assert red.scope == "node1 -> node2" and red.nodes == ["node1", "node2"]
    assert "rank 2 -> 1 (backward), tensor 1 float32 (2, 16, 64): 1 of 2048 values wrong" in red.detail
    assert "another backend" in red.fix and "cable" in red.fix


def test_a_rank_that_never_answers_is_named():
    out = ('SEND_RECV_JSON {"rank": 0, "size": 3, "checked": [], "mismatches": []}\n'
           'SEND_RECV_JSON {"rank": 1, "size": 3, "checked": [{"from": 0, "to": 1, "direction": "forward",'
           ' "tensors": 6}], "mismatches": []}\n')
    checks = pairs.judge(cluster(), (124, out + "no answer within 60 s", "mpi"))
    assert [c.ok for c in checks] == [False, False]
    assert "rank 0 (node1) received nothing from rank 1" in checks[0].detail
    assert "rank 2 (node2) received nothing from rank 1" in checks[1].detail
    assert "exit 124" in checks[1].detail


def test_the_doctor_shows_the_pairs_among_its_checks():
    gathered = healthy()
    gathered["jobs"]["send_recv"] = job("--corrupt-rank", "1")
    red = [c for c in doctor.evaluate(cluster(), HOSTFILE, gathered) if not c.ok]
    assert [c.scope for c in red] == ["node1 -> node1", "node1 -> node2"]
    assert doctor.red_for("node2", red) == [red[1]]


def test_the_doctor_runs_it_after_the_all_sum_over_the_backend_a_run_takes(monkeypatch):
    launched = []

    def fake_job(_cluster, program, timeout=60, backend="mpi"):
        launched.append((program[:2], backend))
        return (1, "MPI_Init failed") if fail_all_sum and "-c" in program[:2] else (0, "")

    monkeypatch.setattr(doctor, "mpi_job", fake_job)
    monkeypatch.setattr(doctor.builder, "backend_for", lambda _cluster, _asked: "ring")
    fail_all_sum = False
    jobs = doctor.run_jobs(cluster())
    assert launched[-1] == (["python", "-c"], "ring") and jobs["send_recv"][2] == "ring"
    assert "import mlx.core" in pairs.program()[2]  # the node side's own text
    launched.clear()
    fail_all_sum = True
    assert "send_recv" not in doctor.run_jobs(cluster())  # MLX cannot join the ranks: said once
