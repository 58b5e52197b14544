"""bench.rehearsal's verdict: what a rehearsal that went wrong says, each a line."""

from __future__ import annotations

from typing import Any

from mlxcluster.bench import rehearsal


def passed(nodes: int = 4) -> dict[str, Any]:
    return {"nodes": nodes, "provision": {"changed_second_run": 0}, "doctor": {"green": True},
            "train": {"ok": True, "world_size": nodes},
            "train_mpi": {"ok": False, "said": "Error: ... no cable joins node1 <-> node3 "
                                               "(use --backend ring, or add those cables)"},
            "tensor": {"ok": True, "max_train_loss_difference": 2e-6, "max_val_loss_difference": 0.0}}


def test_a_rehearsal_that_went_through_has_nothing_wrong_and_mpi_may_train_on_a_mesh():
    assert rehearsal.verdict(passed()) == []
    assert rehearsal.verdict(passed() | {"train_mpi": {"ok": True}}) == []


def test_each_failure_is_named():
    result = passed() | {"provision": {"changed_second_run": 3}, "doctor": {"green": False, "red": ["x"]},
                         "train": {"ok": True, "world_size": 3},
                         "train_mpi": {"ok": False, "said": "Traceback"},
                         "tensor": {"ok": True, "max_train_loss_difference": 0.5,
                                    "max_val_loss_difference": 0.0}}
    wrong = rehearsal.verdict(result)
    assert [line.split(":")[0] for line in wrong] == [
        "a second provision changed 3 tasks", "doctor is red", "invoke train did not train on 4 ranks",
        "--backend mpi failed without its reason", "tensor parallelism did not give one process's losses"]
    unmeasured = passed() | {"tensor": {"ok": True, "max_train_loss_difference": None,
                                        "max_val_loss_difference": 0.0}}
    assert len(rehearsal.verdict(unmeasured)) == 1
