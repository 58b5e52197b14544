"""A launch's output passed through as it comes, and the launch stopped when it must be.

`relay` runs the controller's launch command (ssh to the launcher) and copies its output to this
terminal as it arrives, progress bars included, keeping the tail from which a failure is described.
It notices a rank that reported a stall (training/loop/watchdog.py), can give up after a timeout, can
hold back lines a benchmark prints for the controller, and can time-stamp lines as they arrive.
`supervise` adds what every caller needs: the job is stopped on its launcher (every rank with it)
after a stall, a timeout or Ctrl-C; `terminated_as_interrupted` makes SIGTERM a Ctrl-C.
"""

from __future__ import annotations

import contextlib
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from mlxcluster.describe.cluster import Cluster
from mlxcluster.launch import builder
from mlxcluster.launch.liveness import Liveness, Stuck
from mlxcluster.paths import REPO

# What a rank's watchdog prints when it stops itself (training/loop/watchdog.py).
STALL_MESSAGE = b"error: no progress for"
# How long the launcher gets to exit after a rank stalled. mpirun waits for ever for the node
# daemon of a node that dropped off the link, so then the run is stopped from here.
STALL_GRACE = 10.0


@dataclass
class Relayed:
    code: int | None  # the launch command's exit status; None: it timed out and was killed
    output: str  # the tail of everything it printed (stdout and stderr)
    held_back: list[str] = field(default_factory=list)  # whole lines holding `hide`
    stamped: list[tuple[float, str]] = field(default_factory=list)  # (time.monotonic(), line)
    frozen: list[str] = field(default_factory=list)  # nodes where a rank was stopped at a stall
    stuck: Stuck | None = None  # the ranks' beats said the run was stuck (liveness.py)
    examined: list[object] = field(default_factory=list)  # what `examine` found then (red checks)


@dataclass
class _Stream:
    keep: int
    hide: bytes | None
    stamp: bool
    on_line: Callable[[str], None] | None = None
    tail: bytes = b""
    pending: bytes = b""  # the start of a line not yet complete
    relayed: Relayed = field(default_factory=lambda: Relayed(None, ""))

    def take(self, chunk: bytes, out: object) -> None:
        """Pass `chunk` on to `out` (a binary file) and remember what is needed of it."""
        self.tail = (self.tail + chunk)[-self.keep:]
        if self.hide is None and not self.stamp and self.on_line is None:
            out.write(chunk)  # type: ignore[attr-defined]
            return
        now = time.monotonic()
        *lines, self.pending = (self.pending + chunk).split(b"\n")
        shown = []
        for raw in lines:
            line = raw.decode(errors="replace")
            if self.stamp:
                self.relayed.stamped.append((now, line))
            if self.on_line is not None:
                self.on_line(line)
            if self.hide is not None and self.hide in raw:
                self.relayed.held_back.append(line)
            else:
                shown.append(raw + b"\n")
        out.write(b"".join(shown) if self.hide is not None else chunk)  # type: ignore[attr-defined]


def relay(cmd: Sequence[str], *, keep: int = 1 << 16, on_stall: Callable[[], None] | None = None,
          timeout: float | None = None, hide: str | None = None, stamp: bool = False,
          stdin: int | None = None, on_line: Callable[[str], None] | None = None,
          on_stalled: Callable[[], None] | None = None, stderr: int | None = subprocess.STDOUT,
          liveness: Liveness | None = None, on_stuck: Callable[[Stuck], None] | None = None) -> Relayed:
    """Run `cmd` with its output passed through as it comes.

    on_stalled is called once as soon as a rank reports a stall (the rank holds still a few
    seconds then: watchdog.STALL_HOLD); on_stall once if cmd is still running STALL_GRACE
    seconds later; after `timeout` seconds cmd is killed (code None). Lines holding `hide` are
    not shown but returned; with `stamp`, every line is returned with the time it arrived;
    `on_line` is called with each whole line as it arrives.
    liveness: reads the ranks' beats out of the output (they are not shown); on_stuck is called
    once when it says the run is stuck, and on_stall STALL_GRACE seconds later as after a stall.
    stdin: the command's (default: this one's, so that ssh -tt passes Ctrl-C on at a terminal).
    stderr: where the command's goes (default: with its output; None: this one's, as it comes,
    and the tail holds the output alone).
    """
    stream = _Stream(keep, hide.encode() if hide else None, stamp, on_line)
    deadline = None if timeout is None else time.monotonic() + timeout
    out = sys.stdout.buffer
    stalled_at: float | None = None
    timed_out = False
    with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, stdin=stdin) as proc:
        assert proc.stdout is not None
        try:
            while deadline is None or time.monotonic() < deadline:
                if select.select([proc.stdout], [], [], 1.0)[0]:
                    if not (chunk := proc.stdout.read1(4096)):
                        break
                    if liveness is not None:
                        chunk = liveness.take(chunk)
                    if stalled_at is None and STALL_MESSAGE in stream.tail[-len(STALL_MESSAGE):] + chunk:
                        stalled_at = time.monotonic()
                        if on_stalled is not None:
                            on_stalled()
                    stream.take(chunk, out)
                    out.flush()
                if stalled_at is None and liveness is not None and (stuck := liveness.verdict()):
                    stream.relayed.stuck = stuck
                    if on_stuck is not None:
                        on_stuck(stuck)
                    stalled_at = time.monotonic()  # the launcher's grace counts from the stop
                if stalled_at is not None and on_stall and time.monotonic() - stalled_at > STALL_GRACE:
                    on_stall()
                    on_stall = None
            else:  # the deadline passed before the output ended
                proc.kill()
                timed_out = True
        except Exception:
            # An error of on_line's (or on_stall's): Popen's exit would wait for the launch for ever
            # (it waits only on Ctrl-C); supervise stops the job on the launcher.
            proc.kill()
            raise
        code = proc.wait()
    if liveness is not None and (rest := liveness.rest()):
        stream.take(rest, out)
    stream.relayed.code = None if timed_out else code
    stream.relayed.output = stream.tail.decode(errors="replace")
    return stream.relayed


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def terminated_as_interrupted() -> Iterator[None]:
    """SIGTERM (a service manager's, a `kill`) raises KeyboardInterrupt within: a supervised job
    is then stopped on every rank as on Ctrl-C. Main thread only, as any signal handler."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def supervise(cluster: Cluster, cmd: Sequence[str], marker: str, *, liveness: Liveness | None = None,
              examine: Callable[[], list[object]] | None = None, **options: object) -> Relayed:
    """`relay` a job's launch command; the job is stopped on its launcher (`marker` names its
    processes) after a stall, on a timeout, and on Ctrl-C, which is then raised again.

    With `liveness` (a training run's beats), a stuck run is stopped on every node at once, after
    the nodes were looked at while every rank is still there: a frozen rank's, and `examine`'s
    findings (the links tested at that moment: a link that stays up and carries nothing)."""

    looked: list[threading.Thread] = []
    frozen: list[str] = []
    examined: list[object] = []

    def stop_stuck(stuck: Stuck) -> None:
        print(f"==> stuck: {stuck.line()}; looking at the nodes and links, then stopping every rank",
              flush=True)
        # A frozen rank is seen before the stop ends it; the links are tested while every rank is
        # being stopped (the test needs no rank: its figure is the failure's, not the stop's).
        frozen.extend(builder.frozen_nodes(cluster, marker))
        with ThreadPoolExecutor(max_workers=2) as pool:
            tested = pool.submit(examine) if examine is not None else None
            pool.submit(builder.stop_everywhere, cluster, marker).result()
            examined.extend(tested.result() if tested is not None else [])

    def look_for_frozen_ranks() -> None:
        # In a thread: the output keeps flowing while every node is asked.
        looked.append(threading.Thread(target=lambda: frozen.extend(builder.frozen_nodes(cluster, marker)),
                                       name="frozen-ranks", daemon=True))
        looked[0].start()

    def stop_stalled() -> None:
        print(f"==> a rank stalled and the launcher has not exited after {STALL_GRACE:.0f} s: "
              f"stopping {marker} on {cluster.head.name}", flush=True)
        builder.stop(cluster, marker)

    try:
        relayed = relay(cmd, on_stall=stop_stalled, on_stalled=look_for_frozen_ranks, liveness=liveness,
                        on_stuck=stop_stuck, **options)  # type: ignore[arg-type]
    except (KeyboardInterrupt, Exception):
        builder.stop(cluster, marker)
        raise
    if relayed.code is None:
        builder.stop(cluster, marker)
    for thread in looked:
        thread.join(timeout=30)
    relayed.frozen = list(frozen)
    relayed.examined = examined
    return relayed
