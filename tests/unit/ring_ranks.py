"""`python -m tests.unit.ring_ranks -n N --starting-port P -- PROGRAM...`: the tests' ranks of MLX's ring
backend on this machine (rings.launch), started as `mlx.launch --backend ring -n N` starts them (each
with MLX_RANK and MLX_HOSTFILE, a ring of local ports from P up), without its polling.

mlx.launch copies its ranks' output through threads that select() on each rank's stdin pipe, which is
always writable, and a main loop that select()s on its own stdin, which /dev/null always makes
readable: it kept a core busy for as long as its ranks ran (process accounting over one CI run: 25
launches, 275 s of CPU). Here the ranks write to this process's stdout and stderr themselves, and it
sleeps in wait(). As mlx.launch does, the first rank that fails stops the others; unlike it, this
exits with that rank's status (mlx.launch can exit 0 after a rank failed).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path


def ring_hostfile(ranks: int, starting_port: int) -> str:
    """What mlx.launch writes to MLX_HOSTFILE for `ranks` local ranks: one port each (none for one)."""
    return json.dumps([[f"127.0.0.1:{starting_port + rank}"] for rank in range(ranks)]) if ranks > 1 else ""


def exit_status(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code  # killed by a signal: as a shell reports it


def run(ranks: int, starting_port: int, program: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="ring-ranks-") as folder:
        hostfile = Path(folder) / "hosts.json"
        hostfile.write_text(ring_hostfile(ranks, starting_port) + "\n")
        started = {}
        for rank in range(ranks):
            env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
            process = subprocess.Popen(program, env=env, stdin=subprocess.DEVNULL)
            started[process.pid] = process

        def stop() -> None:
            for process in started.values():
                if process.returncode is None:
                    process.terminate()

        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda received, _: (stop(), sys.exit(128 + received)))
        failed = 0
        while any(process.returncode is None for process in started.values()):
            pid, status = os.wait()
            if pid not in started:
                continue
            started[pid].returncode = exit_status(status)
            if started[pid].returncode and not failed:
                failed = started[pid].returncode
                stop()
        return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.unit.ring_ranks")
    parser.add_argument("-n", dest="ranks", type=int, required=True)
    parser.add_argument("--starting-port", type=int, required=True)
    parser.add_argument("program", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        parser.error("give the program after --")
    return run(args.ranks, args.starting_port, program)


if __name__ == "__main__":
    sys.exit(main())
