"""What stopped a training run: one cause, the node it happened on, and what to do about it.

A failed launch's output, the nodes' out-of-memory counts read before and after, the nodes where
a rank was found frozen, and (when nothing else names a node) the node checks, are read into a
`Fault`. Five causes are told apart, because each asks for something else:

- out of memory: the node's count of out-of-memory kills rose (Linux's kernel, macOS's jetsam);
  the run's settings are the cause, and the nodes left would each hold more: no restart.
- killed: a rank killed by SIGKILL while its node's count did not rise (a kill -9, a supervisor,
  a shutdown): the node goes, the run can go on without it.
- frozen: a rank's process stopped (state T) while the others waited for it.
- lost: a node whose link is down or which stops answering its ssh (its checks are red).
- the run's own: a rank's error (a traceback, a setting it refused), or no node to blame: the
  same run would fail again anywhere.

A node is blamed only where the evidence names it; a fault without a node stops the run.
"""

from __future__ import annotations

import subprocess
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from mlxcluster.check.doctor import Check
from mlxcluster.describe.cluster import Cluster, Node
from mlxcluster.errors import UserError
from mlxcluster.launch import builder, remote
from mlxcluster.launch.liveness import Stuck
from mlxcluster.launch.relay import STALL_MESSAGE

OUT_OF_MEMORY, KILLED, FROZEN, LOST = "out of memory", "killed", "frozen", "lost"
# A link up that carries nothing (found by testing the pairs when the run was stuck), and a hang
# with every rank alive and every link carrying data: a collective that never completed.
DEAD_LINK, HUNG = "dead link", "hung"
# The causes a run can go on from without the node: the node's own, not the run's.
NODE_CAUSES = (KILLED, FROZEN, LOST, DEAD_LINK)


@dataclass(frozen=True)
class Fault:
    """Why a run stopped, as the failure message says it (`why`), and its cause and node when the
    evidence names one (`cause` None: the run's own failure, or one no node can be blamed for)."""

    why: str
    cause: str | None = None
    node: str | None = None

    @property
    def goes_on_without_node(self) -> bool:
        """Whether the run can go on on the other nodes: the cause was the node's, not the run's."""
        return self.node is not None and self.cause in NODE_CAUSES

    @property
    def goes_on_everywhere(self) -> bool:
        """Whether the run can go on on the same nodes: nothing was lost (a hang)."""
        return self.cause == HUNG


class TrainFailed(UserError):
    """The run failed; the message says which rank on which node, and how to go on. `fault`: its
    cause and node, for a restart without that node (mlxcluster/jobs/restarts.py)."""

    def __init__(self, message: str, code: int = 1, fault: Fault | None = None, after: str = ""):
        super().__init__(message + after, code)
        self.fault, self.message, self.after = fault, message, after

    def adding(self, words: str) -> TrainFailed:
        """The same failure with `words` said after its cause (before where its files are)."""
        return TrainFailed(f"{self.message}; {words}", self.code, self.fault, self.after)


# The count of processes killed for memory: Linux's out-of-memory killer's, else (macOS, no
# /proc) the reports jetsam leaves of its kills. (The macOS branch is untested here: no Mac.)
OOM_KILLS = ("awk '/^oom_kill /{print $2}' /proc/vmstat 2>/dev/null || "
             "ls /Library/Logs/DiagnosticReports 2>/dev/null | grep -c '^JetsamEvent' || true")


def oom_kills(cluster: Cluster, timeout: float = 20) -> dict[str, int | None]:
    """Each training node's count of out-of-memory kills (None: unknown), read at once: read
    before and after a run, a rise names the nodes that ran out of memory."""

    def count(node: Node) -> int | None:
        try:
            proc = subprocess.run(remote.ssh_command(node, OOM_KILLS, connect_timeout=5), capture_output=True,
                                  text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return None
        return int(proc.stdout) if proc.returncode == 0 and proc.stdout.strip().isdigit() else None

    nodes = cluster.training_nodes
    with ThreadPoolExecutor(max_workers=max(len(nodes), 1)) as pool:
        return dict(zip((n.name for n in nodes), pool.map(count, nodes), strict=True))


def ran_out_of_memory(before: Mapping[str, int | None], after: Mapping[str, int | None]) -> list[str]:
    """The nodes whose out-of-memory kills rose between the two readings."""
    return [name for name, was in before.items()
            if was is not None and (after.get(name) or 0) > was]


def blamed(cluster: Cluster, red: Sequence[Check]) -> str | None:
    """The one node the red checks point at (None: none, or no single one). Its own checks count
    twice a pair's (`node1 -> node2` names both ends): a node whose link is down fails its
    interface check and every pair towards it; a node gone fails its ssh, and nothing else."""
    names = {n.name for n in cluster.nodes}
    score: Counter[str] = Counter()
    for check in red:
        for end in check.nodes:
            if end in names:
                score[end] += 2 if len(check.nodes) == 1 else 1
    if not score:
        return None
    (first, most), *rest = score.most_common()
    return None if rest and rest[0][1] == most else first


def lost_line(node: str, red: Sequence[Check]) -> str:
    """What a lost node's red checks say of it, as one clause."""
    own = [c for c in red if c.nodes == [node]] or [c for c in red if node in c.nodes]
    said = "; ".join(f"{c.name}: {c.detail}" for c in own[:3])
    return (f"lost: {node} dropped off the cluster ({said}); the other ranks could not reach it. Look at "
            f"its cable and power, then invoke doctor")


def frozen_line(frozen: Sequence[str]) -> str:
    return (f"frozen: a rank's process on {', '.join(frozen)} was stopped (state T: SIGSTOP, a debugger, "
            "a suspended job) while the others waited for it; the launcher's teardown ended it. Look for "
            "what stops processes there")


def left_out_of_link(cluster: Cluster, ends: Sequence[str]) -> str:
    """The end of a dead link a run goes on without: not the launcher, else the later in rank order."""
    order = cluster.rank_nodes()
    return max((e for e in ends if e != cluster.head.name),
               key=lambda e: order.index(e) if e in order else -1, default=ends[-1])


def by_checks(cluster: Cluster, why: str, red: Sequence[Check]) -> Fault | None:
    """The fault the red node checks name after `why`: a node they point at (lost), or a pair of
    nodes whose link fails while both their own checks pass (a dead link: up, carrying nothing);
    None when they are all green."""
    if node := blamed(cluster, red):
        if any(c.nodes == [node] for c in red):  # its own checks fail: its link down, or it is gone
            return Fault(f"{why}; {lost_line(node, red)}", LOST, node)
        # Only its pairs fail, its interface up: its cable (on a bridge, its one) carries nothing.
        pairs = [c for c in red if node in c.nodes]
        return Fault(f"{why}; dead link: {node}'s cluster link is up but carries nothing ({len(pairs)} "
                     f"pairs with it fail: {pairs[0].name}: {pairs[0].detail}); look at its cable and "
                     "ports (reseat it, or try another), then invoke doctor", DEAD_LINK, node)
    if (pairs := [c for c in red if len(c.nodes) == 2]) and len(pairs) == len(red):
        ends = pairs[0].nodes
        return Fault(f"{why}; dead link: the link between {ends[0]} and {ends[1]} is up but carries "
                     f"nothing ({pairs[0].name}: {pairs[0].detail}); look at that cable and its ports "
                     "(reseat it, or try another), then invoke doctor", DEAD_LINK,
                     left_out_of_link(cluster, ends))
    if red:
        return Fault(why + "; the nodes now: " + "; ".join(f"{c.scope}: {c.name}: {c.detail}" for c in red))
    return None


def stuck_fault(cluster: Cluster, stuck: Stuck, frozen: Sequence[str], red: Sequence[Check]) -> Fault:
    """Why a run its beats said was stuck stopped: a frozen rank, a node or a link its checks (made
    at that moment) name, ranks whose beats had stopped, or (every rank alive, every link
    carrying data) a collective that never completed."""
    head = f"stuck: {stuck.line()}; every rank was stopped on every node"
    if frozen:
        return Fault(f"{head}; {frozen_line(frozen)}", FROZEN, frozen[0])
    if named := by_checks(cluster, head, red):
        return named
    silent = sorted({cluster.node_of_rank(rank) for rank in stuck.silent})
    if len(silent) == 1:
        ranks = ", ".join(map(str, stuck.silent))
        return Fault(f"{head}; lost: rank {ranks} on {silent[0]} stopped answering (its beats stopped) "
                     f"while the others waited for it, and its checks pass now: look at {silent[0]}'s "
                     "processes and logs, then invoke doctor", LOST, silent[0])
    if silent:
        return Fault(f"{head}; the ranks on {', '.join(silent)} stopped answering: look at those nodes")
    return Fault(f"{head}; hung: every rank was alive and waiting, and every link carries data: a "
                 "collective that never completed (a deadlock, as mlx #4475 reports of the ring); "
                 "nothing was lost", HUNG)


def unrecorded(cluster: Cluster, unfinished: Sequence[int], ends: Mapping[int, int | None]) -> Fault:
    """A launch that exited 0 while ranks did not say they finished (`ends`: each rank's exit
    record's code, None: none): the launcher's status is not trusted (mlx #4319)."""
    said = "; ".join(f"rank {rank} on {cluster.node_of_rank(rank)} "
                     + ("left no exit record" if ends.get(rank) is None else f"ended with code {ends[rank]}")
                     for rank in unfinished)
    return Fault(f"the launcher exited 0, but {said}: the run did not finish")


def diagnose(cluster: Cluster, output: str, code: int | None, parallel: str,
             oom: tuple[Mapping[str, int | None], Mapping[str, int | None]],
             frozen: Sequence[str], red_checks: Callable[[], list[Check]],
             stuck: tuple[Stuck, Sequence[Check]] | None = None) -> Fault:
    """The fault behind a failed launch: its `output` and exit `code`, the out-of-memory counts
    (before, after), the `frozen` nodes, and the red node checks, asked for (`red_checks`) only
    when the rest names no cause, since they take a few seconds. `stuck`: the run was stopped as
    stuck, with the red checks found at that moment."""
    before, after = oom
    out_of_memory = ran_out_of_memory(before, after)
    counted = [name for name, was in before.items() if was is not None and after.get(name) is not None]
    why = builder.describe_failure(cluster, output, code, parallel, out_of_memory, counted)
    if out_of_memory:
        return Fault(why, OUT_OF_MEMORY, out_of_memory[0])
    if stuck is not None:  # its ranks were stopped from here: their signals are not the cause
        return stuck_fault(cluster, stuck[0], frozen, stuck[1])
    if builder.killed(output, code):
        node = builder.killed_on(cluster, output, code)
        # Where the count could not be read (macOS), a SIGKILL may be for memory: no restart.
        return Fault(why, KILLED if node in counted else None, node)
    if frozen:
        # The other ranks waited for it in a collective: theirs is the stall message, its the cause.
        return Fault(f"{why}; {frozen_line(frozen)}", FROZEN, frozen[0])
    if STALL_MESSAGE.decode() in output or not builder.rank_error(output):
        # A stall, or a launcher that lost a node: a node or link gone; the node checks name it.
        return by_checks(cluster, why, red_checks()) or Fault(f"{why}; the nodes now: all checks green")
    return Fault(why)
