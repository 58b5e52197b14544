"""training/tools/send_recv.py on 2 and 3 local ring ranks: every neighbouring pair checked both
ways, and a rank that sends one wrong value named by the ranks it sent to."""

from __future__ import annotations

import json
import sys

import pytest

from tests.unit import rings
from tests.unit.training.test_finetune import run_launcher
from training.sharding import pipeline
from training.tools import send_recv


def run(ranks: int, *extra: str) -> tuple[int, dict[int, dict]]:
    argv = [*rings.launch(ranks), sys.executable, "-m", "training.tools.send_recv", *extra]
    proc = run_launcher(argv, timeout=120)  # on a timeout, the ranks go down too
    lines = [line.split(send_recv.MARKER, 1)[1] for line in proc.stdout.splitlines()
             if send_recv.MARKER in line]
    found = {report["rank"]: report for report in map(json.loads, lines)}
    assert sorted(found) == list(range(ranks)), proc.stdout + proc.stderr
    return proc.returncode, found


@pytest.mark.parametrize("ranks", [2, 3])
def test_every_neighbouring_pair_gets_every_tensor_both_ways(ranks: int):
    code, found = run(ranks)
    assert code == 0
    heard = {(c["from"], c["to"], c["direction"]) for r in found.values() for c in r["checked"]}
    want = ({(r, r + 1, "forward") for r in range(ranks - 1)}
            | {(r + 1, r, "backward") for r in range(ranks - 1)})
    assert heard == want
    assert all(not r["mismatches"] and not r.get("error") for r in found.values())
    shapes = send_recv.tensors(2, 16, 64)
    assert all(c["tensors"] == len(shapes) for r in found.values() for c in r["checked"])


def test_a_rank_that_sends_a_wrong_value_is_named_by_both_neighbours():
    code, found = run(3, "--corrupt-rank", "1")
    assert code != 0
    wrong = [m for r in found.values() for m in r["mismatches"]]
    assert {(m["from"], m["to"], m["direction"]) for m in wrong} == {(1, 2, "forward"), (1, 0, "backward")}
    assert all(m["tensor"] == 1 and m["wrong"] == 1 and m["got"] == m["expected"] + 1 for m in wrong)


def test_the_shapes_are_a_pipeline_s():
    assert send_recv.WIRE_DTYPES == pipeline.WIRE_DTYPES
    shapes = send_recv.tensors(4, 32, 128)
    assert shapes[0] == ((2,), send_recv.mx.int32)  # agree_on_wires' header
    assert {dtype for _, dtype in shapes[1:4]} == set(pipeline.WIRE_DTYPES)
    assert len({shape for shape, _ in shapes}) == 4  # back to back, of different shapes


def test_values_are_exact_in_every_wire_dtype():
    exact = send_recv.expected(5, 1, 3, (2, 16, 64), send_recv.mx.float32)
    for dtype in send_recv.WIRE_DTYPES:
        assert send_recv.compare(send_recv.expected(5, 1, 3, (2, 16, 64), dtype), exact) is None
    assert send_recv.compare(send_recv.expected(0, 0, 0, (8,), send_recv.mx.float32),
                             send_recv.expected(1, 0, 0, (8,), send_recv.mx.float32))["wrong"] == 8


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="at least 1"):
        send_recv.tensors(0, 16, 64)
