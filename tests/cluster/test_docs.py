"""Every `invoke` command the docs show (README.md, docs/*.md), run on a provisioned lab cluster
where it touches nothing.

tests/unit/test_docs.py extracts the commands and parses them; here they run, each ending with
exit 0, on the two nodes test_train.py trains on (`provisioned`, just before it):
- a task that takes `--dry-run` runs with it added: it plans and prints, and touches no host;
- a task that only reads (or writes only a folder of this test's) runs as written;
- any other task is in ELSEWHERE, which says which test runs it or why it is only parsed; a
  documented task in no class fails test_every_documented_task_is_run_here_or_elsewhere, so a new
  doc command must be classified.
A command that fails although its doc says what should be (a bug in the code) is in KNOWN_BROKEN,
expected to fail, strictly: once fixed, it fails the test until its entry goes.

The docs' stand-ins for a user's own things (an inventory under inventory/<name>/, `my.jsonl`,
`./my-model`, run ids such as 20261125-101010, ...) become the lab's inventory and files and runs
this test makes: PLACEHOLDERS. The commands run in this process through invoke's own Program, as
the `invoke` program runs them (its loader finding tasks.py from the working directory, the same
parser, config and tasks): starting Python and importing mlx and mlx-lm again for each of the
docs' commands would cost the suite two seconds or more each on this machine's two cores.
"""

from __future__ import annotations

import inspect
import re
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import invoke
import pytest
from invoke import Program
from invoke.exceptions import ParseError

from mlxcluster.launch import runs
from tests.cluster.conftest import LabCluster
from tests.unit.test_docs import COMMANDS, Documented, parse

REPO = Path(__file__).resolve().parents[2]
INVOKE = str(Path(sys.executable).parent / "invoke")

# Tasks that only read, or write only where this test points them: run as the docs write them.
AS_WRITTEN = {
    "hostfile": "renders the hostfiles into build/<inventory>/, touching no host",
    "doctor": "reads every node and pair of nodes",
    "plan": "reads the model's files, the data and every node's free memory",
    "generate": "reads a run and answers on the controller",
    "data.prepare": "writes only its --output, a folder of this test's",
}

# Documented tasks that neither take --dry-run nor only read: where each runs, or why it is only
# parsed (tests/unit/test_docs.py).
ELSEWHERE = {
    "provision": "changes the nodes: tests/cluster/test_site.py runs site.yml as it does (check mode "
                 "on fresh nodes, first and second run, --tags, --limit), and the `provisioned` fixture "
                 "provisions the cluster this test runs on",
    "test": "is the whole suite: .ci/run runs the README's test command "
            "(tests/unit/test_docs.py::test_the_readme_test_command_is_the_one_ci_runs)",
    "topology": "asks Macs (system_profiler, networksetup), which lab hosts are not: "
                "tests/contract/test_darwin_topology_contract.py runs it against stand-ins",
    "lab.up": "would bring up a lab beside this session's: the lab fixtures run the same code "
              "(mlxcluster/lab/hosts.py, from tests/cluster/conftest.py)",
    "lab.down": "would take this session's lab down: the lab fixtures run the same code at the end",
    "lab.limit": "slows a node down: tests/cluster/test_train.py::"
                 "test_auto_shares_are_the_ones_a_slower_node_s_calibration_gives limits one the same way",
    "bench.provision": "provisions fresh labs of 2 to 8 nodes (minutes): parsed only; its arithmetic "
                       "is tests/unit/mlxcluster/bench/test_provision.py",
    "bench.rehearsal": "takes a fresh lab of 4 or 8 nodes from nothing to training (minutes): parsed "
                       "only; its verdict is tests/unit/mlxcluster/bench/test_rehearsal.py",
    "bench.train": "provisions a lab of its own: its parts run, briefly, in invoke test --benches "
                   "(tests/cluster/test_benches.py::test_every_part_of_bench_train_runs_and_reports)",
    "bench.overhead": "trains for minutes: parsed only; tests/unit/mlxcluster/bench/test_overhead.py "
                      "runs its comparison, both programs, on a tiny model",
    "bench.links": "a measurement: invoke test --benches runs it (tests/cluster/test_benches.py::"
                   "test_bench_links_measures_every_node_pair_and_all_reduce_on_both_backends)",
    "bench.scaling": "a measurement: invoke test --benches runs it (tests/cluster/test_benches.py::"
                     "test_bench_scaling_runs_on_one_node_and_on_all_and_reports_the_speedup)",
    "bench.calibrate": "tests/cluster/test_train.py::"
                       "test_auto_shares_are_the_ones_a_slower_node_s_calibration_gives",
    "bench.shares": "a calibration and two runs of every node (minutes): parsed only; its calibration "
                    "and shared runs are test_auto_shares_are_the_ones_a_slower_node_s_calibration_gives's",
    "bench.tensor": "two runs and a comparison (minutes): parsed only; the comparison is "
                    "tests/unit/mlxcluster/bench/test_tensor.py, tensor-parallel runs on the lab are "
                    "tests/cluster/test_train.py's",
    "bench.pipeline": "eleven runs on 2, 3 and 4 nodes (minutes): parsed only; its report is "
                      "tests/unit/mlxcluster/bench/test_pipeline.py's, from real pipeline, tensor and "
                      "data runs on local ranks; pipeline runs on the lab are tests/cluster/test_train.py's",
    "bench.plan": "a calibration and a run per cell of its grid (hours): parsed only; its judgement, "
                  "table and PNG are tests/unit/mlxcluster/bench/test_plan.py's, each run's planned and "
                  "measured ranks tests/cluster/test_plan.py's",
    "bench.serve": "starts servers round after round (minutes): parsed only; its measures are "
                   "tests/unit/mlxcluster/bench/test_serve.py's, against a real server",
    "bench.faults": "a fresh lab and six runs (minutes): parsed only; its figures and verdict are "
                    "tests/unit/mlxcluster/bench/test_faults.py's, the restart it measures runs in "
                    "tests/cluster/test_train.py::test_a_node_killed_mid_run_is_left_out_and_the_run_"
                    "ends_on_the_other_as_if_uninterrupted",
}

# Documented commands that fail today although the docs are right: the code is to be fixed (then
# the command passes, and its xfail, strict, fails until its entry is removed here).
KNOWN_BROKEN: dict[tuple[str, ...], str] = {}

# Tasks that read a finished run: they wait for the one this test trains.
READ_A_RUN = {"serve", "fuse", "generate"}

# The docs' stand-ins for a user's own things (whole words of a command, or the value of a
# --flag=value), and the attribute of Made that stands for each here. Any inventory the docs name
# (inventory/studio/, /srv/mlx-lab/lab8/...) is the lab's, and so is the default where a command
# names none (the embedded default, this machine, which the tests do not provision).
PLACEHOLDERS = {
    "my.jsonl": "raw_data",  # instruction data to prepare: the bundled pirate rows
    "build/data/mine": "data",  # prepared data: those rows, prepared
    "my-lora.yaml": "config",  # an mlx_lm lora config of one's own
    "lora.yaml": "config",
    "./my-model": "model",  # a model folder: the session's tiny llama
    "./job.py": "job",  # a script of one's own
    "~/project": "project",  # a folder of one's own, with the train.py it runs
    "models/pirate-135m": "fused",  # where fuse writes: a folder of this test's (nothing is written)
    "<timestamp>": "run",  # a finished run: the one this test trains
    "20261125-101010": "run",
    "20261125-215850": "run",
    "runs/<timestamp>": "run_dir",
    "runs/20261125-101010": "run_dir",
    "20261125-121212": "second_run",  # another finished run: a copy of the first
    "20261122-233703": "unfinished",  # a run to resume: the first, as if stopped before its end
}
# What would be a stand-in left unreplaced (a placeholder added to a doc but not here).
LOOKS_LIKE_A_PLACEHOLDER = re.compile(r"<\w+>|(^|/)\d{8}-\d{6}$|^(\./)?my[-.]")


def task_names(command: Documented) -> list[str]:
    """The tasks a command names; none when invoke would refuse it (tests/unit/test_docs.py says why)."""
    try:
        return [context.name for context in parse(command)]
    except (ParseError, ValueError):
        return []


def takes_dry_run(task: str) -> bool:
    import tasks

    return "dry_run" in inspect.signature(tasks.ns[task].body).parameters


def how(task: str) -> str:
    """The class of a documented task: dry run, as written, or elsewhere (KeyError: none)."""
    if takes_dry_run(task):
        return "dry run"
    if task in AS_WRITTEN:
        return "as written"
    return "elsewhere: " + ELSEWHERE[task]


def runs_here(command: Documented) -> bool:
    try:
        names = task_names(command)
        return bool(names) and all(not how(task).startswith("elsewhere") for task in names)
    except KeyError:  # a task in no class: test_every_documented_task_is_run_here_or_elsewhere says so
        return False


# --- the classification: no lab --------------------------------------------------------------


def test_every_documented_task_is_run_here_or_elsewhere():
    """A task a doc shows is run here (it takes --dry-run, or it only reads) or named in ELSEWHERE;
    and the tables name only tasks the docs show, in one class each."""
    documented = {task for command in COMMANDS for task in task_names(command)}
    unclassified = []
    for task in sorted(documented):
        try:
            how(task)
        except KeyError:
            unclassified.append(task)
    assert unclassified == [], ("documented tasks in no class: add each to AS_WRITTEN (it only reads) "
                                "or to ELSEWHERE (which test runs it, or why it is parsed only): "
                                f"{unclassified}")
    assert set(AS_WRITTEN) | set(ELSEWHERE) <= documented, "the tables name tasks no doc shows"
    assert not set(AS_WRITTEN) & set(ELSEWHERE)
    assert not any(takes_dry_run(task) for task in [*AS_WRITTEN, *ELSEWHERE])
    assert set(KNOWN_BROKEN) <= {c.argv for c in COMMANDS}, "KNOWN_BROKEN names a command no doc shows"


def test_the_tests_elsewhere_exist():
    """Each test ELSEWHERE names is there: a renamed test would leave a command run by nothing."""
    missing = []
    for reason in ELSEWHERE.values():
        for path, name in re.findall(r"(tests/[\w/]+\.py)(?:::(\w+))?", reason):
            if not (REPO / path).is_file() or (name and f"def {name}(" not in (REPO / path).read_text()):
                missing.append(f"{path}::{name}" if name else path)
    assert missing == []


# --- on the lab ---------------------------------------------------------------------------------


@dataclass
class Made:
    """What stands for the docs' placeholders: files of this test's, and runs it trains (lazily:
    a command that reads a run waits for it)."""

    inventory: str
    raw_data: str
    data: str
    config: str
    model: str
    job: str
    project: str
    fused: str
    training: subprocess.Popen[str]
    made_runs: list[Path]

    def _runs(self) -> list[Path]:
        if not self.made_runs:
            stdout, stderr = self.training.communicate(timeout=600)
            assert self.training.returncode == 0, stdout[-3000:] + stderr[-3000:]
            first = runs.named_in(stdout)
            assert first is not None, stdout[-3000:]
            second, unfinished = first.with_name(first.name + "-b"), first.with_name(first.name + "-u")
            shutil.copytree(first, second)
            shutil.copytree(first, unfinished)
            (unfinished / "summary.json").unlink()  # as a run stopped before its last step leaves it
            self.made_runs += [first, second, unfinished]
        return self.made_runs

    @property
    def run(self) -> str:
        return self._runs()[0].name

    @property
    def run_dir(self) -> str:
        return f"runs/{self.run}"

    @property
    def second_run(self) -> str:
        return self._runs()[1].name

    @property
    def unfinished(self) -> str:
        return self._runs()[2].name


@pytest.fixture(scope="module")
def made(provisioned: LabCluster, tiny_inputs: tuple[Path, Path], tiny_quantized_model: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Made]:
    from training.data.prepare import prepare

    model_dir, data_dir = tiny_inputs
    tmp = tmp_path_factory.mktemp("docs")
    raw = tmp / "my.jsonl"
    shutil.copyfile(REPO / "training/data/pirate.jsonl", raw)
    prepare(raw, tmp / "mine")
    config = tmp / "my-lora.yaml"
    config.write_text("fine_tune_type: lora\nnum_layers: 2\nbatch_size: 2\niters: 4\nlearning_rate: 1e-4\n"
                      "max_seq_length: 256\n")
    job = tmp / "job.py"
    job.write_text("import sys\nprint(sys.argv)\n")
    (tmp / "project").mkdir()
    (tmp / "project" / "train.py").write_text("print('trained')\n")
    # The run the docs' run ids stand for, trained meanwhile: a few steps of QLoRA on the tiny 4-bit
    # model, whose base `invoke fuse --dequantize` can dequantize (a float one it refuses).
    training = subprocess.Popen(
        [INVOKE, "train", "-i", str(provisioned.inventory), "--model", str(tiny_quantized_model),
         "--data", str(data_dir), "--iters", "2", "--batch-size", "2", "--extra",
         "--steps-per-report 1 --steps-per-eval 2 --val-batches 1 --max-seq-length 128 --num-layers 1 "
         "--save-every 1"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    here = Made(str(provisioned.inventory), str(raw), str(tmp / "mine"), str(config), str(model_dir),
                str(job), str(tmp / "project"), str(tmp / "fused"), training, [])
    try:
        yield here
    finally:
        if training.poll() is None:
            training.kill()
            training.communicate()
        for run in here.made_runs:
            shutil.rmtree(run, ignore_errors=True)
            (REPO / "build" / "resume" / f"{run.name}.yaml").unlink(missing_ok=True)


def as_run_here(command: Documented, made: Made) -> list[str]:
    """The command's words with the lab's inventory, this test's stand-ins, and --dry-run."""
    [task] = task_names(command)  # every command that runs here names one task
    words = list(command.argv)
    end = words.index("--") if "--" in words else len(words)  # after --: the user's program's words
    unknown = []
    for n, word in enumerate(words):
        flag, _, value = word.partition("=")
        if n < end and n and words[n - 1] in ("-i", "--inventory"):
            words[n] = made.inventory
        elif word in PLACEHOLDERS:
            words[n] = getattr(made, PLACEHOLDERS[word])
        elif n < end and flag.startswith("--") and value in PLACEHOLDERS:
            words[n] = f"{flag}={getattr(made, PLACEHOLDERS[value])}"
        elif LOOKS_LIKE_A_PLACEHOLDER.search(value or word):
            unknown.append(word)
    assert unknown == [], f"{command}: stand-ins with no substitute (add them to PLACEHOLDERS): {unknown}"
    if "-i" not in words[:end] and "--inventory" not in words[:end] and \
            any("inventory" in a.names for a in parse(command)[0].args.values()):
        words[1:1] = ["-i", made.inventory]
        end += 2
    if how(task) == "dry run" and "--dry-run" not in words[:end]:
        words.insert(end, "--dry-run")
    return words


def invoke_here(words: list[str], monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
                ) -> tuple[int, str]:
    """`invoke WORDS` as the invoke program runs it, in this process: its exit status and output."""
    monkeypatch.chdir(REPO)  # where the loader finds tasks.py, as from a shell in the repository
    monkeypatch.setattr(sys, "argv", [INVOKE, *words])  # invoke run reads the words after -- here
    capfd.readouterr()
    # Python's own warning filters, as the invoke program has them (pytest's config makes warnings
    # errors, which a user's invoke would only print).
    with warnings.catch_warnings():
        warnings.resetwarnings()
        try:
            Program(name="Invoke", binary="inv[oke]", version=invoke.__version__).run([INVOKE, *words])
            code = 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else int(done.code is not None)
    out, err = capfd.readouterr()
    return code, out + err


def order(command: Documented) -> int:
    """data.prepare first (its --output is what train's --data reads), the commands that read the
    run last (they wait for its training), the rest meanwhile."""
    tasks_of = task_names(command)
    reads_run = bool(READ_A_RUN & set(tasks_of)) or any(w.startswith("--resume") for w in command.argv)
    return 0 if "data.prepare" in tasks_of else 2 if reads_run else 1


def commands_run_here() -> list[Documented]:
    """Each documented command that runs here, once (several docs show the same command)."""
    seen: set[tuple[str, ...]] = set()
    unique = []
    for command in COMMANDS:
        if runs_here(command) and command.argv not in seen:
            seen.add(command.argv)
            unique.append(command)
    return sorted(unique, key=order)


def with_known_failures(commands: list[Documented]) -> list[Any]:
    """The commands, those of KNOWN_BROKEN expected to fail (strictly: fixed, they fail the test)."""
    return [pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=KNOWN_BROKEN[c.argv]))
            if c.argv in KNOWN_BROKEN else c for c in commands]


@pytest.mark.cluster
@pytest.mark.parametrize("command", with_known_failures(commands_run_here()), ids=str)
def test_a_documented_command_runs_on_the_lab(command: Documented, made: Made,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capfd: pytest.CaptureFixture[str]):
    words = as_run_here(command, made)
    code, output = invoke_here(words, monkeypatch, capfd)
    assert code == 0, f"{command}\n  ran as: invoke {' '.join(words)}\n  exit {code}:\n{output[-4000:]}"
