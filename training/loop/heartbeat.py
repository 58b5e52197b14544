"""Each rank says, every few seconds and outside MLX, that it is alive and how far it is.

A collective that never completes leaves every rank alive and waiting: the launcher sees nothing
wrong, and a rank's own watchdog (watchdog.py) only knows that it is waiting, not why. So every
rank of a run the controller launched prints a beat every BEAT_EVERY seconds, from a thread (MLX
releases the GIL while it waits in a collective): its rank, how many steps and validation batches
it has done, its step, and its phase (`train`; `save` while rank 0 writes a checkpoint, which may
take longer than any step; `finish` once training is over). The beats reach the controller through
the launcher's output (mpirun's or the ring launcher's own channel, over the management link, not
the cluster link), where mlxcluster/launch/liveness.py reads them and tells a hang from a slow
step.

At its end a rank prints its exit record (its exit code): the controller decides how a run ended
from every rank's record, never from the launcher's exit status alone (mlx.launch has printed 0
after a rank died: mlx #4319).

Both are one line each, written with a single os.write so that no other output splits them; the
controller takes them out of what it shows. They are printed only when the launch asks for them
(ENV: the beat interval), so a rank started by hand prints none.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping

# The launch sets it (mlxcluster/launch/builder.py) to the seconds between beats.
ENV = "MLX_CLUSTER_BEATS"
# What a beat and an exit record start with: mlxcluster/launch/liveness.py reads them.
WORDS = "@@mlx-cluster "
BEAT, EXIT = WORDS + "beat", WORDS + "exit"
BEAT_EVERY = 2.0


def _stdout(line: str) -> None:
    os.write(1, line.encode())


class Heartbeat:
    """A rank's beats, from `start` to `stop`, and its exit record."""

    def __init__(self, rank: int, every: float = BEAT_EVERY, write: Callable[[str], None] = _stdout):
        self.rank, self.every, self.write = rank, every, write
        self.progress = 0  # steps and validation batches done
        self.step = 0
        self.phase = "train"
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_env(cls, rank: int, environ: Mapping[str, str]) -> Heartbeat | None:
        """The beats the launch asked for (ENV: their interval); None when it asked for none."""
        try:
            every = float(environ.get(ENV, ""))
        except ValueError:
            return None
        return cls(rank, every) if every > 0 else None

    def line(self) -> str:
        return f"{BEAT} rank={self.rank} progress={self.progress} step={self.step} phase={self.phase}\n"

    def progressed(self) -> None:
        self.progress += 1

    def stepped(self, step: int) -> None:
        self.step = step

    @contextlib.contextmanager
    def busy(self, phase: str) -> Iterator[None]:
        """A phase whose length no step predicts (a checkpoint's save): beaten at its start."""
        self.phase = phase
        self._beat()
        try:
            yield
        finally:
            self.phase = "train"
            self._beat()

    def start(self) -> None:
        self._stopped.clear()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def finish(self) -> None:
        """Training is over (what is left: the checks across ranks, the summary, the plot): beaten
        as such until the process ends, so that the controller does not take its length for a hang."""
        self.phase = "finish"
        self._beat()

    def stop(self) -> None:
        if self._thread is not None:
            self._stopped.set()
            self._thread.join()
            self._thread = None

    def exit_record(self, code: int) -> None:
        self.write(f"{EXIT} rank={self.rank} code={code}\n")

    def _beat(self) -> None:
        if self._thread is not None:
            self.write(self.line())

    def _run(self) -> None:
        self.write(self.line())
        while not self._stopped.wait(self.every):
            self.write(self.line())


def hang_at(rank: int, environ: Mapping[str, str]) -> int | None:
    """The step at which this rank is to hang, as a deadlocked collective does (FAULT `hang:R:S`),
    for the lab's tests and bench.faults: the step S when R is this rank, else None."""
    kind, _, where = environ.get(FAULT, "").partition(":")
    if kind != "hang":
        return None
    fault_rank, _, step = where.partition(":")
    if not (fault_rank.isdigit() and step.isdigit()) or int(fault_rank) != rank:
        return None
    return int(step)


# A fault to inject (the launch passes it on from the controller's environment): `hang:R:S` makes
# rank R's training hold still for ever after step S of a run started afresh, every thread but its
# own left running (its beats go on): every rank alive, none progressing.
FAULT = "MLX_CLUSTER_FAULT"


def hang_for_ever() -> None:
    print("fault injected: this rank holds still for ever (MLX_CLUSTER_FAULT)", flush=True)
    while True:
        time.sleep(3600)
