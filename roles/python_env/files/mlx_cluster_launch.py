"""The cluster's launcher for MLX's own backends (ring, jaccl, jaccl-ring), installed into the venv
as bin/mlx-cluster-launch and run by the venv's python on the launcher node:

    python mlx-cluster-launch --hostfile HOSTS.json [--backend B] [--cwd DIR] [--env K=V]...
                              [--starting-port P] -- COMMAND...

It reads MLX's hosts file and starts every rank as `mlx.launch` does (ssh -tt per host, or a shell
for 127.0.0.1; MLX_RANK, and MLX_HOSTFILE or JACCL's MLX_IBV_DEVICES and MLX_JACCL_COORDINATOR),
with two differences that are why it exists:
- It waits without polling. mlx.launch copies each rank's output through a thread that select()s
  on the rank's stdin pipe, which is always writable, and a main loop that select()s on its own
  stdin, which /dev/null always makes readable: it keeps a core of the launcher busy for the whole
  run. Here a thread per stream blocks in read() and the main thread in wait().
- Its exit status is the first failing rank's (mlx.launch exits 0 after a rank failed, mlx #4319).
  Each rank's end is said on stderr as `Node with rank R exited with code C` (C: 128 + N for a rank
  behind ssh killed by signal N, as its shell reports it; -N for a local one), and the ranks stopped
  because of it as `Node with rank R was stopped`.
The first rank that fails stops the others: their ssh ends, and the hang-up stops each rank's
program on its node. SIGTERM, SIGINT and SIGHUP stop every rank the same way.
Standard library only: it runs before, and without, anything the job imports.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading

LOCAL = "127.0.0.1"  # as mlx.launch: a rank there runs in a shell of this machine, not over ssh
SSH = ("ssh", "-tt", "-o", "LogLevel=QUIET")
_WRITE = threading.Lock()


def rank_files(backend: str, hosts: list[dict], starting_port: int, connections: int) -> tuple[dict, list]:
    """What every rank gets besides MLX_RANK, as mlx.launch gives it: files (their variable: their
    content) and variables (NAME=value)."""
    if backend == "ring":
        port, ring = starting_port, []
        for host in hosts:
            addresses = []
            for ip in host["ips"]:
                for _ in range(connections):
                    addresses.append(f"{ip}:{port}")
                    port += 1
            ring.append(addresses)
        return {"MLX_HOSTFILE": json.dumps(ring) if len(ring) > 1 else ""}, []
    envs = [f"MLX_JACCL_COORDINATOR={hosts[0]['ips'][0]}:{starting_port}"]
    if backend == "jaccl-ring":
        envs.append("MLX_JACCL_RING=1")
    return {"MLX_IBV_DEVICES": json.dumps([host.get("rdma") for host in hosts])}, envs


def rank_script(rank: int, cwd: str | None, envs: list[str], files: dict, command: list[str],
                remote: bool) -> str:
    """The bash line that becomes rank `rank`: its directory, variables and files, then `command`."""
    parts = ["stty -echo 2>/dev/null"] if remote else []  # the pty would echo what is typed
    if cwd:
        parts.append(f"cd {shlex.quote(cwd)} || {{ echo 'Failed to change directory to' "
                     f"{shlex.quote(cwd)} >&2; exit 1; }}")
    for env in envs:
        name, _, value = env.partition("=")
        if not name.replace("_", "a").isalnum():
            raise SystemExit(f"mlx-cluster-launch: {env!r} is not NAME=value")
        parts.append(f"export {name}={shlex.quote(value)}")
    for name, content in files.items():
        parts.append(f'f=$(mktemp) && printf "%s\\n" {shlex.quote(content)} > "$f" && export {name}="$f"')
    parts += [f"export MLX_RANK={rank}", f"exec {shlex.join(command)}"]
    return "; ".join(parts)


def remote(host: dict) -> bool:
    """Whether a host's rank runs over ssh (every host but LOCAL)."""
    return host["ssh"] != LOCAL


def copy(source, target_fd: int) -> None:
    """Pass a rank's stream on as it comes (blocking reads: no polling), whole lines at a time (up to
    a newline or a progress bar's carriage return): two ranks' lines never run into each other."""
    pending = b""
    while chunk := os.read(source.fileno(), 65536):
        pending += chunk
        cut = max(pending.rfind(b"\n"), pending.rfind(b"\r")) + 1
        if cut:
            write(pending[:cut], target_fd)
            pending = pending[cut:]
    write(pending, target_fd)


def write(data: bytes, target_fd: int) -> None:
    with _WRITE:
        while data:
            data = data[os.write(target_fd, data):]


def say(line: str) -> None:
    with _WRITE:
        os.write(2, f"[mlx-cluster-launch] {line}\n".encode())


def launch(hosts: list[dict], scripts: list[str]) -> int:
    """Start every rank, wait for them, and return the first failing rank's status (0: none)."""
    ranks: dict[int, tuple[int, subprocess.Popen]] = {}
    copies: list[threading.Thread] = []
    stopping: list[int] = []  # 128 + the signal that stopped the run

    def stop_all() -> None:
        for _, process in ranks.values():
            if process.returncode is None:
                try:
                    process.terminate()  # ssh: the hang-up stops the rank's program on its node
                except ProcessLookupError:
                    pass

    def on_signal(signum, _frame) -> None:
        stopping.append(128 + signum)
        stop_all()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    for rank, (host, script) in enumerate(zip(hosts, scripts, strict=True)):
        if stopping:
            break  # stopped while starting: the rest never start
        argv = [*SSH, host["ssh"], script] if remote(host) else ["bash", "-c", script]
        # Its own stdin, never written: ssh -tt needs one, and the rank must not read the launcher's.
        process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE)
        ranks[process.pid] = (rank, process)
        for stream, fd in ((process.stdout, 1), (process.stderr, 2)):
            copies.append(threading.Thread(target=copy, args=(stream, fd), daemon=True))
            copies[-1].start()
    failed = 0
    while any(process.returncode is None for _, process in ranks.values()):
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        if pid not in ranks:
            continue
        rank, process = ranks[pid]
        process.returncode = code = os.waitstatus_to_exitcode(status)
        if code and not failed and not stopping:
            say(f"Node with rank {rank} exited with code {code}")
            failed = code if code > 0 else 128 - code
            stop_all()
        elif failed or stopping:
            say(f"Node with rank {rank} was stopped (status {code})")
    for thread in copies:  # what the ranks wrote last (rank 0's result) is passed on too
        thread.join(timeout=10)
    return failed or (stopping[0] if stopping else 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mlx-cluster-launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hostfile", required=True, help="MLX's hosts file (JSON)")
    parser.add_argument("--backend", choices=("ring", "jaccl", "jaccl-ring"),
                        help="default: the hosts file's, else ring")
    parser.add_argument("--cwd", help="the ranks' working directory")
    parser.add_argument("--env", action="append", default=[], help="NAME=value for every rank")
    parser.add_argument("--starting-port", type=int, default=32323,
                        help="ring: the first rank's port, one more per address; JACCL: rank 0's")
    parser.add_argument("--connections-per-ip", type=int, default=1)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    try:
        with open(args.hostfile) as file:
            read = json.load(file)
        # MLX's format: {"backend", "envs", "hosts"}, or the hosts alone.
        document = read if isinstance(read, dict) else {"hosts": read}
        hosts = document["hosts"]
        backend = args.backend or document.get("backend") or "ring"
        envs = [*document.get("envs", []), *args.env]
        if not hosts or not all(isinstance(h, dict) and h.get("ssh") for h in hosts):
            raise ValueError("every host needs its ssh name")
        # A ring listens on every host's addresses; JACCL's ranks meet at rank 0's.
        if not all(h.get("ips") for h in (hosts if backend == "ring" else hosts[:1])):
            raise ValueError("ring: every host needs its ips; JACCL: the first host")
    except (OSError, ValueError, KeyError) as exc:
        parser.error(f"{args.hostfile}: not MLX's hosts file ({exc})")
    files, backend_envs = rank_files(backend, hosts, args.starting_port, args.connections_per_ip)
    columns, lines = shutil.get_terminal_size((0, 0))
    if columns > 0 and os.isatty(1) and not any(e.startswith("COLUMNS=") for e in envs):
        envs += [f"COLUMNS={columns}", f"LINES={lines}"]  # rank 0's progress bar fits the terminal
    scripts = [rank_script(rank, args.cwd, [*envs, *backend_envs], files, command, remote(host))
               for rank, host in enumerate(hosts)]
    return launch(hosts, scripts)


if __name__ == "__main__":
    sys.exit(main())
