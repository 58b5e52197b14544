"""Property tests: every flag of `invoke train` and every key of a config file, fuzzed (wrong
type, sign, size, shell characters, paths that climb, point at /etc or ~, links). Whatever comes
in, the task either launches, having planned to send only the files the job reads, or refuses in
one line naming the value, before anything is sent; never a traceback.

The task runs in-process against a recorded two-node layout; the two steps that would reach a
host (the node checks and the run itself) are replaced by a stand-in that records the plan."""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from invoke.context import Context
from invoke.exceptions import Exit

from mlxcluster import paths
from mlxcluster.check import doctor
from mlxcluster.jobs import request
from mlxcluster.jobs import train as training
from mlxcluster.launch import runs
from tests.unit import fake_inputs
from tests.unit.mlxcluster.jobs.test_train import lab_layout
from training.config import CONFIG_KEYS

REPO = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(REPO))
import tasks  # noqa: E402  (the repository's tasks.py, as invoke loads it)

MAX_EXAMPLES = {"flags": 400, "keys": 400}
SPLITS = {"train.jsonl", "valid.jsonl", "test.jsonl"}
MODEL_FILES = {"config.json", "model.safetensors", "tokenizer.json", "manifest.json"}


class Launched(Exception):
    """The task got as far as running its plan."""

    def __init__(self, plan: training.Plan):
        self.plan = plan


@pytest.fixture(scope="module")
def inventory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An inventory whose recorded layout is the two lab nodes (build/<name>/, removed after)."""
    inventory = tmp_path_factory.mktemp("inv") / f"fuzz-{os.getpid()}" / "inventory" / "hosts.yml"
    inventory.parent.mkdir(parents=True)
    inventory.write_text("cluster: {}\n")
    build = paths.build_dir_for(inventory)
    build.mkdir(parents=True, exist_ok=True)
    (build / "cluster.json").write_text(json.dumps(lab_layout()))
    (build / "hostfile").write_text("10.78.5.11 slots=1\n10.78.5.12 slots=1\n")
    yield inventory
    for f in build.iterdir():
        f.unlink()
    build.rmdir()


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Folders and files a user might name: good ones, a home with secrets, links out, /etc."""
    tmp = tmp_path_factory.mktemp("places")
    home = tmp / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("SECRET")
    (home / "train.jsonl").write_text("{}\n")
    (tmp / "to-etc").symlink_to("/etc")
    (tmp / "to-ssh").symlink_to(home / ".ssh")
    leaky = fake_inputs.dataset(tmp / "leaky")
    (leaky / "test.jsonl").symlink_to(home / ".ssh" / "id_ed25519")
    return {"data": str(fake_inputs.dataset(tmp / "data")), "model": str(fake_inputs.model(tmp / "model")),
            "config": str(fake_inputs.config(tmp / "good.yaml")), "home": str(home), "leaky": str(leaky),
            "to-etc": str(tmp / "to-etc"), "to-ssh": str(tmp / "to-ssh"), "missing": str(tmp / "nowhere")}


SHELL = st.sampled_from(["$(touch /tmp/pwned)", "`id`", "a;b", "a b", "x\ny", "'", '"', "-rf", "*", "~"])
NUMBERS = st.one_of(st.integers(-3, 40).map(str), st.integers(-10**30, 10**30).map(str),
                    st.sampled_from(["many", "1e3", " 5", "5 ", "0x10", "٣", "9" * 5000, "", "1.5"]), SHELL)
PATHS = st.one_of(st.sampled_from(["data", "model", "config", "home", "leaky", "to-etc", "to-ssh",
                                   "missing"]).map(lambda key: f"@{key}"),
                  st.sampled_from(["/etc", "/", "~", "~/.ssh", "../../etc", ".", "..", "/proc/self",
                                   "/dev/zero", "runs"]), SHELL)
EXTRA = st.one_of(
    st.lists(st.sampled_from(["--learning-rate 2e-4", "--num-layers 2", "--seed 3", "--adapter-path /etc",
                              "--model /etc", "--data ~", "--config /etc/passwd", "--resume", "--help",
                              "--lora-rnk 8", "--iters -1", "--iters x", "--batch-size 1", "'", "8",
                              "--expected-world-size 1", "--lora-dropout 2", "--parallel pipeline"]),
             max_size=3).map(" ".join),
    SHELL)


def flag_values(draw: st.DrawFn) -> dict[str, Any]:
    values: dict[str, Any] = {"data": "@data", "model": "@model"}
    for name, strategy in (("data", PATHS), ("model", PATHS), ("config", PATHS), ("iters", NUMBERS),
                           ("batch_size", NUMBERS), ("threads", NUMBERS), ("btl_tcp_links", NUMBERS),
                           ("extra", EXTRA),
                           ("backend", st.one_of(st.sampled_from(["auto", "mpi", "ring", "jaccl", "nccl"]),
                                                 SHELL)),
                           ("interface", st.one_of(st.sampled_from(["bridge0", "10.78.5.0/24", "en2,en3",
                                                                    "10.78.5.11", "a" * 16]), SHELL)),
                           ("parallel", st.sampled_from(["data", "tensor", "pipeline", "", "DATA"])),
                           ("resume", st.one_of(st.just(True), st.sampled_from(["../../etc", "x", "2026"])))):
        if draw(st.integers(0, 3)) == 0:
            values[name] = draw(strategy)
    return values


def run_task(inventory: Path, places: dict[str, str], values: dict[str, Any],
             monkeypatch: pytest.MonkeyPatch) -> str | training.Plan:
    """invoke train with these values: its plan when it would launch, else its one-line refusal."""
    given = {k: places[v[1:]] if isinstance(v, str) and v.startswith("@") else v for k, v in values.items()}

    def launched(plan: training.Plan) -> Path:
        raise Launched(plan)

    monkeypatch.setattr(training, "execute", launched)
    # --resume looks for runs in an empty runs/ of the test's, never the repository's.
    monkeypatch.setattr(training, "RUNS", Path(places["missing"]) / "runs")
    monkeypatch.setattr(request, "RUNS", Path(places["missing"]) / "runs")
    monkeypatch.setattr(runs, "RUNS", Path(places["missing"]) / "runs")
    monkeypatch.setattr(doctor, "preflight", lambda *a, **k: None)
    try:
        tasks.train(Context(), inventory=str(inventory), **given)
    except Launched as done:
        return done.plan
    except Exit as refused:
        return str(refused.message)
    raise AssertionError("invoke train neither launched nor refused")


def check_outcome(outcome: str | training.Plan, values: dict[str, Any]) -> None:
    event("refused" if isinstance(outcome, str) else "launched")
    if isinstance(outcome, str):
        assert outcome and "Traceback" not in outcome
        assert len(outcome.splitlines()) == 1, outcome
        return
    # It launches: the only files it sends of the user's folders are the job's.
    for label, cmd in outcome.steps:
        if label.startswith(("sync data", "copy the model")):
            words = shlex.split(cmd[-1]) if cmd[0] == "ssh" else cmd
            included = {w.removeprefix("--include=/") for w in words if w.startswith("--include=")}
            assert included <= (SPLITS if label.startswith("sync data") else MODEL_FILES), (label, included)
            assert "--exclude=*" in words
        if label.startswith("sync config"):
            assert Path(cmd[-2]).is_file()


@settings(max_examples=MAX_EXAMPLES["flags"], derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_flag_of_invoke_train_launches_only_the_jobs_files_or_is_refused_in_one_line(
        inventory, places, monkeypatch, data):
    values = flag_values(data.draw)
    check_outcome(run_task(inventory, places, values, monkeypatch), values)


JUNK = st.one_of(st.integers(-10**6, 10**6), st.integers(-10**40, 10**40), st.just(10**5000),
                 st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
                 st.text(max_size=12), SHELL, st.sampled_from(["/etc", "~", "../..", "-1", "1e-4", "cosine"]),
                 st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(),
                                                                      max_size=2))


@settings(max_examples=MAX_EXAMPLES["keys"], derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.one_of(st.sampled_from(CONFIG_KEYS), st.text(max_size=10)), value=JUNK)
def test_every_key_of_a_config_file_launches_or_is_refused_in_one_line_naming_it(
        inventory, places, monkeypatch, tmp_path_factory, key, value):
    config = tmp_path_factory.mktemp("cfg") / "fuzzed.yaml"
    try:
        config.write_text(yaml.safe_dump({key: value}))
    except (ValueError, yaml.YAMLError):  # not writable as YAML (a 5000-digit number)
        config.write_text(f"{key}: {'9' * 5000}\n")
    outcome = run_task(inventory, places, {"data": "@data", "model": "@model", "config": str(config)},
                       monkeypatch)
    check_outcome(outcome, {})
    if isinstance(outcome, str):
        # Named by its key, or, when the file as a whole cannot be read, by the file.
        assert str(key) in outcome or repr(key) in outcome or str(config) in outcome, outcome
