"""Property tests: generated inventories and data rows thrown at validation, rendering and
data.prepare. Whatever comes in, the answer is a refusal that names the host or the row, or an
accepted input rendered right; never a traceback, never a partial or overwritten file.

The cases are derandomized (the same ones every run, so CI is repeatable); HYPOTHESIS_SEED or a
local profile can widen them. The numbers of cases are in MAX_EXAMPLES."""

from __future__ import annotations

import io
import ipaddress
import json
import shlex
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from rich.console import Console

from mlxcluster.describe.cluster import Cluster
from mlxcluster.describe.inventory import (
    MAX_SLOTS,
    cluster_root_error,
    connection_errors,
    inventory_errors,
    training_hosts,
)
from mlxcluster.jobs import train as training
from mlxcluster.jobs.request import Request
from tests.unit import fake_inputs
from tests.unit.mlxcluster.jobs.test_train import lab_layout
from training.data import prepare as tp

MAX_EXAMPLES = {"inventory": 2000, "prepare": 600, "rsync": 300}

# --- inventories ------------------------------------------------------------------------

GOOD_NAMES = st.from_regex(r"[a-z][a-z0-9-]{0,8}[a-z0-9]", fullmatch=True)
ODD_NAMES = st.sampled_from(["bad name", "bad\nname", "-x", "a;b", "ünï", "a_b"])
NAMES = st.one_of(GOOD_NAMES, GOOD_NAMES, ODD_NAMES)
ADDRESSES = st.one_of(
    st.builds(lambda i: str(ipaddress.IPv4Address("192.168.200.0") + i), st.integers(0, 300)),
    st.ip_addresses(v=4).map(str),
    st.sampled_from(["127.0.0.1", "224.0.0.1", "0.0.0.0", " 192.168.200.9", "fe80::1", "{{ x }}"]),
    st.text(max_size=16), st.integers(), st.none())
JUNK = st.one_of(st.text(max_size=6), st.booleans(), st.none(), st.floats(allow_nan=True))
HOST_VARS = st.fixed_dictionaries({}, optional={
    "thunderbolt_ip": ADDRESSES,
    "thunderbolt_prefix": st.one_of(st.integers(0, 40), st.just(24), JUNK),
    "thunderbolt_mtu": st.one_of(st.sampled_from([1500, 9000, "9000", "jumbo"]),
                                 st.integers(-1, 70000), JUNK),
    "thunderbolt_interface": st.one_of(st.sampled_from(["bridge0", "thunderbolt0", "en0;x", "br\n0"]),
                                       st.text(max_size=18), st.none()),
    "mpi_slots": st.one_of(st.integers(-2, 3), st.integers(-10**13, 10**13),
                           st.sampled_from(["2", "²", " 3 ", "two"]), JUNK),
    "ansible_host": st.one_of(st.sampled_from(["10.0.0.2", "-oProxyCommand=x", "a b", ""]),
                              st.text(max_size=10)),
    "ansible_user": st.one_of(st.sampled_from(["ada", "-l", ""]), st.text(max_size=8)),
})


HOST_VARS_SAMPLES = {
    "thunderbolt_ip": ADDRESSES, "mpi_slots": st.one_of(st.integers(-2, 2000), JUNK),
    "thunderbolt_interface": st.one_of(st.text(max_size=18), st.none()),
    "ansible_host": st.text(max_size=10), "ansible_user": st.text(max_size=8),
    "thunderbolt_mtu": st.one_of(st.integers(-1, 70000), JUNK),
}


@st.composite
def inventories(draw: st.DrawFn) -> tuple[dict[str, list[str]], dict[str, dict[str, Any]]]:
    names = draw(st.lists(NAMES, max_size=5, unique=True))
    hostvars = {name: draw(HOST_VARS) for name in names}
    in_cluster = [n for n in names if draw(st.integers(0, 9)) > 0]
    macs = [n for n in in_cluster if draw(st.booleans())]
    linux = [n for n in in_cluster if n not in macs or draw(st.integers(0, 9)) == 0]
    launcher = draw(st.lists(st.sampled_from(names), max_size=2, unique=True)) if names else []
    return {"cluster": in_cluster, "macs": macs, "linux": linux, "launcher": launcher}, hostvars


@st.composite
def good_inventories(draw: st.DrawFn) -> tuple[dict[str, list[str]], dict[str, dict[str, Any]]]:
    """Mostly right inventories, one setting at a time perhaps wrong: the accepted side is covered."""
    names = draw(st.lists(GOOD_NAMES, min_size=1, max_size=5, unique=True))
    base = ipaddress.IPv4Address(draw(st.sampled_from(["192.168.200.0", "10.0.0.0", "172.16.5.0"])))
    hostvars: dict[str, dict[str, Any]] = {
        name: {"thunderbolt_ip": str(base + index + 1), "thunderbolt_interface": "bridge0",
               "mpi_slots": draw(st.integers(0, 4)) if index else draw(st.integers(1, 4))}
        for index, name in enumerate(names)}
    if draw(st.booleans()):
        victim = draw(st.sampled_from(names))
        key = draw(st.sampled_from(sorted(HOST_VARS_SAMPLES)))
        value = draw(HOST_VARS_SAMPLES[key])
        hostvars[victim][key] = value
    macs = [n for n in names if draw(st.booleans())]
    return ({"cluster": names, "macs": macs, "linux": [n for n in names if n not in macs],
             "launcher": [names[0]]}, hostvars)


@settings(max_examples=MAX_EXAMPLES["inventory"], derandomize=True, deadline=None)
@given(st.one_of(inventories(), good_inventories()))
def test_an_inventory_is_refused_naming_a_host_or_accepted_and_rendered_right(inventory):
    groups, hostvars = inventory
    errors = inventory_errors(groups, hostvars)  # never raises
    event("refused" if errors else "accepted")  # --hypothesis-show-statistics shows the share
    if errors:
        named = [*hostvars, "cluster", "launcher", "thunderbolt"]
        assert all(isinstance(e, str) and any(n and (n in e or repr(n) in e) for n in named)
                   for e in errors), errors
        return
    ranks = training_hosts(groups, hostvars)
    assert ranks and ranks[0][0] == groups["launcher"][0]
    addresses = [ip for _, ip, _ in ranks]
    assert len(set(addresses)) == len(addresses)
    for host, ip, slots in ranks:
        assert str(ipaddress.IPv4Address(ip)) == ip  # what the hostfile gets: a bare address
        assert 1 <= slots <= MAX_SLOTS
        assert connection_errors(host, hostvars[host]) == []
        assert shlex.quote(host) == host  # a name ssh, /etc/hosts and shells take as it is


# --- data.prepare -----------------------------------------------------------------------

ODD_TEXT = st.sampled_from(["\ud800", "\u2028", "\x85", "\n", "\r", "\t", "", " ", "\"", "\\", "☠"])
TEXT = st.one_of(st.text(max_size=20), ODD_TEXT,
                 st.lists(st.one_of(st.text(max_size=5), ODD_TEXT), max_size=4).map("".join))
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": TEXT},
    optional={"name": TEXT})
GOOD_ROWS = st.lists(
    st.builds(lambda i, extra: {"instruction": f"question {i}?{extra}", "response": f"answer {i}.{extra}"},
              st.integers(0, 10**6), st.sampled_from(["", "\u2028", "\x85", " ☠", "\t", "\"q\""])),
    min_size=2, max_size=14)
ROWS = st.one_of(
    st.fixed_dictionaries({"instruction": TEXT, "response": TEXT}, optional={"context": TEXT}),
    st.fixed_dictionaries({"instruction": TEXT, "output": TEXT}, optional={"input": TEXT}),
    st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=4)}),
    st.builds(lambda i: {"instruction": f"q{i}?", "response": f"a{i}."}, st.integers(0, 10**6)),
    st.one_of(st.integers(), st.text(max_size=5), st.lists(st.integers(), max_size=2)),
    st.builds(lambda inside, around: RawLine(around.format(inside)), st.one_of(
        st.integers(0, 100_000).map(lambda depth: "[" * depth + "]" * depth),
        st.sampled_from([4300, 4301, 5000]).map(lambda digits: "9" * digits)), st.sampled_from(
        ["{}", '{{"messages": {}}}', '{{"instruction": "q", "response": "a", "id": {}}}'])))


class RawLine(str):
    """A line written as it is: json.dumps cannot write nesting past json's recursion limit or an
    int past Python's 4300 digits, which json.loads then fails on in its own ways."""


def encoded(rows: list[Any], ascii_only: bool) -> bytes:
    lines = "".join((row if isinstance(row, RawLine) else json.dumps(row, ensure_ascii=ascii_only)) + "\n"
                    for row in rows)
    return lines.encode("utf-8", errors="surrogatepass")  # a lone surrogate: invalid UTF-8


@settings(max_examples=MAX_EXAMPLES["prepare"], derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(rows=st.one_of(st.lists(ROWS, max_size=14), GOOD_ROWS), ascii_only=st.booleans(),
       output_exists=st.booleans())
def test_prepare_refuses_naming_the_row_or_writes_every_split_whole(tmp_path_factory, rows, ascii_only,
                                                                   output_exists):
    tmp = tmp_path_factory.mktemp("prop")
    source = tmp / "in.jsonl"
    source.write_bytes(encoded(rows, ascii_only))
    before = source.read_bytes()
    output = tmp / "out"
    if output_exists:
        output.mkdir()
        (output / "train.jsonl").write_text("earlier\n")
    try:
        summary = tp.prepare(source, output, console=Console(file=io.StringIO()))
    except tp.DataError as error:
        event("refused")
        assert str(source) in str(error)
        assert source.read_bytes() == before
        # Nothing half-written: the output is as it was.
        if output_exists:
            assert sorted(p.name for p in output.iterdir()) == ["train.jsonl"]
            assert (output / "train.jsonl").read_text() == "earlier\n"
        else:
            assert not output.exists()
        assert [p.name for p in tmp.iterdir() if p.name.startswith(".")] == []
        return
    event("accepted")
    assert source.read_bytes() == before
    counts = {}
    for name in ("train", "valid"):
        lines = (output / f"{name}.jsonl").read_text(encoding="utf-8").split("\n")
        assert lines[-1] == ""
        rows_out = [json.loads(line) for line in lines[:-1]]
        assert all(row["messages"][-1]["role"] == "assistant" for row in rows_out)
        counts[name] = len(rows_out)
    assert counts == {"train": summary.train, "valid": summary.valid}
    assert summary.train + summary.valid == summary.kept <= summary.rows_read
    assert json.loads((output / "summary.json").read_text())["kept"] == summary.kept



# --- rsync remote paths -----------------------------------------------------------------

PLAIN = st.from_regex(r"[A-Za-z0-9_+@=,-][A-Za-z0-9._+@=,-]{0,12}", fullmatch=True)
ROOTS = st.from_regex(r"/[A-Za-z0-9._+@=,/-]{1,30}", fullmatch=True).filter(
    lambda root: cluster_root_error("node1", root) is None)


def remote_paths(argv: list[str]) -> list[str]:
    """The paths of an rsync command line that a remote shell may see (old rsync hands them over):
    host:path operands and the --rsync-path command, also inside an ssh-wrapped rsync."""
    if argv[0] == "ssh":  # the fan-out: rsync run on the launcher, as one shell line
        return remote_paths(shlex.split(argv[-1]))
    if argv[0] != "rsync":
        return []
    paths = [arg.split(":", 1)[1] for arg in argv[1:] if not arg.startswith("-") and ":" in arg]
    paths += [arg.removeprefix("--rsync-path=") for arg in argv if arg.startswith("--rsync-path=")]
    return paths


@settings(max_examples=MAX_EXAMPLES["rsync"], derandomize=True, deadline=None)
@given(root=ROOTS, data=PLAIN, model=PLAIN, config=PLAIN)
def test_every_rsync_remote_path_of_an_accepted_run_needs_no_quoting(root, data, model, config):
    layout = lab_layout()
    layout["nodes"] = [dict(node, cluster_root=root) for node in layout["nodes"]]
    request = Request(fake_inputs.dataset(f"/d/{data}"), fake_inputs.model(f"/m/{model}"),
                      fake_inputs.config(f"/c/{config}"), interactive=False)
    the_plan = training.plan(Cluster.from_json(layout), request, run_id="r1")
    remote = [path for _, cmd in the_plan.steps if cmd for path in remote_paths(cmd)]  # not WAIT
    assert len(remote) >= 6  # code, data, config, model, fan-out... each checked
    for path in remote:
        # The --rsync-path is a command line: each of its words must be shell-inert.
        assert all(shlex.quote(word) == word for word in path.replace(" && ", " ").split()), path
