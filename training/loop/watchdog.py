"""Stop a rank that stops making progress, instead of letting it hang for ever.

A node that drops off the network mid-run leaves the other ranks waiting in an all-reduce that
never completes: TCP sees nothing wrong for many minutes, and mpirun only acts once a rank exits.
Each rank therefore exits by itself when no training step or validation batch has completed for
a while, saying so and where it was stuck, and the launcher then takes the rest of the job down.

The watchdog is a thread: MLX releases the GIL while it waits in a collective, so the thread runs
while the main one is stuck. In case something holds the GIL regardless, faulthandler's timer
(a C thread that needs no GIL) is set a little later as a backstop.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

# What a stalled rank prints; the controller recognises a stall by it.
STALL_MESSAGE = "no progress for"
BACKSTOP_DELAY = 30.0
# How long a stalled rank holds still after saying so, before it exits: the controller looks at
# every node's processes then, while the stall has not been undone by the launcher's teardown (a
# frozen rank is resumed and killed by it), to name the node where a rank was frozen.
STALL_HOLD = 3.0


def _stderr() -> TextIO:
    """A stderr faulthandler can write to: it needs a file descriptor, which a replaced
    sys.stderr (pytest's capture, a StringIO) may not have."""
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return sys.__stderr__ or sys.stderr
    return sys.stderr


class StallWatchdog:
    """Exits the process (status 1) when neither `step` nor `pet` has been called for the allowance.

    The allowance follows the run's own pace: it is the larger of `timeout` and `slack` times the
    longest step seen, so a model whose steps take minutes is not stopped for being slow. Until the
    first training step is done (loading, the first validation, compiling) it is `first_timeout`;
    until a second one is, the first step's own duration sets the pace (compiling included, so
    a slow first step only makes the allowance larger, for that one step).
    """

    def __init__(
        self,
        timeout: float,
        first_timeout: float,
        describe: Callable[[], str] = lambda: "",
        cause: str = "another rank is gone or the cluster link is down",
        slack: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        exit: Callable[[int], None] = os._exit,
        hold: float = STALL_HOLD,
    ):
        self.timeout = timeout
        self.first_timeout = first_timeout
        self.describe = describe  # where the run was, for the message: "rank 1: step 37 of 200"
        self.cause = cause  # what a stall most likely means, for the message
        self.slack = slack
        self.clock = clock
        self.exit = exit
        self.hold = hold
        self.first_step = 0.0  # how long the first training step took (from the last progress)
        self.longest_gap = 0.0  # the longest gap between progress after the first step
        self.started = 0.0
        self.stepped = False  # the first training step is done
        self.last: float | None = None
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def allowance(self) -> float:
        if not self.stepped:
            return self.first_timeout
        return max(self.timeout, self.slack * (self.longest_gap or self.first_step))

    def overdue(self) -> float | None:
        """Seconds since the last progress if that exceeds the allowance, else None."""
        since = self.clock() - (self.last if self.last is not None else self.started)
        return since if since > self.allowance() else None

    def start(self) -> None:
        self.started = self.clock()
        self._stopped.clear()
        self._thread = threading.Thread(target=self._watch, name="stall-watchdog", daemon=True)
        self._thread.start()
        self._set_backstop()

    def step(self) -> None:
        """A training step is done (then `pet` is called for it as for any progress)."""
        if not self.stepped:
            self.stepped = True
            # The first step's pace until a second step shows the usual one.
            self.first_step = self.clock() - (self.last if self.last is not None else self.started)
            self.last = None

    def pet(self) -> None:
        """Some progress (a step, a validation batch) was made."""
        now = self.clock()
        if self.last is not None and self.stepped:
            self.longest_gap = max(self.longest_gap, now - self.last)
        self.last = now
        if self._thread is not None:
            self._set_backstop()
            self._wake.set()

    def stop(self) -> None:
        if self._thread is not None:
            self._stopped.set()
            self._wake.set()
            self._thread.join()
            self._thread = None
            faulthandler.cancel_dump_traceback_later()

    def _set_backstop(self) -> None:
        faulthandler.dump_traceback_later(self.allowance() + BACKSTOP_DELAY, exit=True, file=_stderr())

    def _watch(self) -> None:
        while not self._stopped.is_set():
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            if self._stopped.is_set():
                return
            if (since := self.overdue()) is not None:
                where = self.describe()
                print(
                    f"{where}error: {STALL_MESSAGE} {since:.0f} s (allowed {self.allowance():.0f} s): "
                    f"{self.cause}; stopping\n"
                    f"{where}it was waiting here:",
                    file=sys.stderr,
                    flush=True,
                )
                faulthandler.dump_traceback(file=_stderr(), all_threads=True)
                sys.stderr.flush()
                time.sleep(self.hold)
                self.exit(1)
                return
