"""Each rank alive or not, the run progressing or not, read from the ranks' beats outside MLX.

Every rank of a training run prints a beat every 2 s (training/loop/heartbeat.py): its progress
(steps and validation batches done), its step and its phase. They reach the controller in the
launch's output, through the launcher's own channel over the management link, whatever MLX's
collectives are doing. `Liveness` takes them out of the output (`take`) and keeps, per rank, when
it was last heard and when it last progressed.

A run is stuck when no rank has progressed for longer than its pace allows: `margin` (15 s) past
the slowest step so far (then the links are tested and every rank stopped: a failure within 30 s
past it), counted from each rank's second step (the first compiles). Until the run has that pace,
`first_bound` (as a rank's own first watchdog, a little earlier). While a rank is busy with a phase
no step predicts (rank 0 writing a checkpoint, the run's end) or has ended, ten slowest steps and
at least `first_bound`. The verdict says which ranks were silent (their beats stopped: a process
frozen, a node gone) and which were alive: every rank alive and none progressing is a hang (a
collective that never completes, or a link that stays up and carries nothing), which the controller
tells apart by testing the links (mlxcluster/launch/relay.py's supervise,
mlxcluster/check/faults.py).

A rank's exit record (its code) is kept too: how a run ended is decided from every rank's own
record, not from the launcher's exit status alone.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from training.loop import heartbeat

# What a rank's beat and its exit record start with, and the whole record (a pty, ssh -tt, ends
# each line with \r\n).
WORDS = heartbeat.WORDS.encode()
_BEAT, _EXIT = (words.removeprefix(heartbeat.WORDS) for words in (heartbeat.BEAT, heartbeat.EXIT))
_KINDS = f"{re.escape(_BEAT)}|{re.escape(_EXIT)}".encode()
_RECORD = re.compile(re.escape(WORDS) + rb"(" + _KINDS + rb") rank=(\d+)((?: [a-z_]+=[\w.-]+)*)\r?\n")
# The longest record: a longer run of bytes after WORDS without a newline is output, not a record.
_LONGEST = 160

# Past the run's slowest step so far: the beats come every 2 s, and the nodes are looked at, the
# links tested and every rank stopped in about 10 s more (the pairs' checks wait 5 s for a link
# that carries nothing): a hang is a failure within 30 s past the slowest step.
HANG_MARGIN = 15.0
# A rank's watchdog stops it 600 s into a run that has not stepped yet (training/finetune.py's
# first_timeout): the controller looks first, to name the cause while every rank is still there.
FIRST_BOUND = 570.0
SILENT_AFTER = 10.0  # five beats missed: the rank is not heard any more
BUSY_STEPS = 10  # a save or the run's end may take this many of its slowest steps


@dataclass
class Rank:
    """What a rank's beats said last, and when (the controller's clock)."""

    heard_at: float
    progress: int
    progressed_at: float
    step: int
    first_step: int
    phase: str = "train"
    code: int | None = None  # its exit record; None: none yet


@dataclass(frozen=True)
class Stuck:
    """No rank progressed for `idle` seconds, past the `bound` the run's pace allowed."""

    idle: float
    bound: float
    slowest: float  # the slowest step so far (0: the run had no pace yet)
    step: int  # the furthest step any rank had done
    silent: tuple[int, ...]  # ranks whose beats had stopped (the others were alive)

    def line(self) -> str:
        pace = (f"the slowest step so far took {self.slowest:.1f} s" if self.slowest
                else "the run had not made its second step")
        return (f"no rank progressed for {self.idle:.0f} s after step {self.step} ({pace}; "
                f"allowed {self.bound:.0f} s)")


class Liveness:
    """The beats of a run of `world` ranks, read out of its output as it comes."""

    def __init__(self, world: int, margin: float = HANG_MARGIN, first_bound: float = FIRST_BOUND,
                 silent_after: float = SILENT_AFTER, clock: Callable[[], float] = time.monotonic):
        self.world, self.margin, self.first_bound = world, margin, first_bound
        self.silent_after = silent_after
        self.clock = clock
        self.ranks: dict[int, Rank] = {}
        self.slowest = 0.0
        self.stuck: Stuck | None = None
        self._carry = b""

    @classmethod
    def of_run(cls, world: int, stall_timeout: float) -> Liveness:
        """A run's: its stall_timeout, when shorter, is its margin (a user who asks for a quicker
        stop gets it from here, where the cause is named, before the ranks' own)."""
        return cls(world, margin=min(HANG_MARGIN, stall_timeout))

    # --- reading the output ---------------------------------------------------------------------

    def take(self, chunk: bytes) -> bytes:
        """`chunk` of the launch's output without the records in it, which are read; a record cut
        at the chunk's end waits for the next one."""
        data, self._carry = self._carry + chunk, b""
        now = self.clock()
        kept, start = [], 0
        for match in _RECORD.finditer(data):
            kept.append(data[start:match.start()])
            self._heard(match[1].decode(), int(match[2]), match[3].decode(), now)
            start = match.end()
        rest = data[start:]
        cut = _cut_record(rest)
        kept.append(rest[:cut])
        self._carry = rest[cut:]
        return b"".join(kept)

    def rest(self) -> bytes:
        """What is held back at the output's end (a record never finished): output after all."""
        rest, self._carry = self._carry, b""
        return rest

    def _heard(self, kind: str, rank: int, words: str, now: float) -> None:
        fields = dict(word.split("=", 1) for word in words.split())
        if kind == _EXIT:
            if rank not in self.ranks:
                self.ranks[rank] = Rank(now, 0, now, 0, 0)
            self.ranks[rank].code, self.ranks[rank].progressed_at = int(fields.get("code", "1")), now
            return
        progress, step = int(fields.get("progress", 0)), int(fields.get("step", 0))
        phase = fields.get("phase", "train")
        known = self.ranks.get(rank)
        if known is None:
            self.ranks[rank] = Rank(now, progress, now, step, step, phase)
            return
        known.heard_at = now
        if progress != known.progress:
            # Steps since a beat of training (steps quicker than the beats may first show in the
            # beat that starts a save); not since a save's.
            if step >= known.first_step + 2 and known.phase == "train":
                self.slowest = max(self.slowest, now - known.progressed_at)
            known.progress, known.progressed_at, known.step = progress, now, step
        if phase != known.phase:  # a save began or ended: its length says nothing of a step's
            known.phase, known.progressed_at = phase, now

    # --- judging ----------------------------------------------------------------------------------

    def bound(self) -> float:
        """How long the run may go without progress: `margin` past its slowest step, or
        `first_bound` before it has a pace; while a rank is busy (a save, the end of the run) or
        has ended, ten slowest steps and at least `first_bound`."""
        if any(r.phase != "train" or r.code is not None for r in self.ranks.values()):
            return max(self.first_bound, BUSY_STEPS * self.slowest)
        return self.slowest + self.margin if self.slowest else self.first_bound

    def verdict(self) -> Stuck | None:
        """The run stuck, said once; None while every rank has not been heard, or some rank
        progressed (or began or ended a phase) within the bound."""
        if self.stuck is not None or len(self.ranks) < self.world:
            return None
        ranks = self.ranks.values()
        now, bound = self.clock(), self.bound()
        idle = now - max(r.progressed_at for r in ranks)
        if idle <= bound:
            return None
        silent = tuple(sorted(n for n, r in self.ranks.items()
                              if r.code is None and now - r.heard_at > self.silent_after))
        self.stuck = Stuck(idle, bound, self.slowest, max(r.step for r in ranks), silent)
        return self.stuck

    def exit_codes(self) -> dict[int, int | None]:
        """Each rank's exit record's code (None: it left none)."""
        return {rank: self.ranks[rank].code if rank in self.ranks else None for rank in range(self.world)}

    def unfinished(self) -> list[int]:
        """The ranks whose exit record does not say they finished (none, or a non-zero code)."""
        return [rank for rank in range(self.world)
                if rank not in self.ranks or self.ranks[rank].code != 0]


def _cut_record(data: bytes) -> int:
    """Where a record that `data` ends with begins (len(data): it ends with none): WORDS whole
    without its line's end, or the start of WORDS."""
    if (at := data.rfind(WORDS)) != -1 and b"\n" not in data[at:] and len(data) - at < _LONGEST:
        return at
    for size in range(min(len(WORDS) - 1, len(data)), 0, -1):
        if WORDS.startswith(data[-size:]):
            return len(data) - size
    return len(data)
