"""The library that keeps a waiting ring rank off the cores (mlxcluster/lab/ring_wait.py), built and
preloaded for real: a recv or send that would block waits for its socket a little before it says so,
and what they return is unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mlxcluster import devtools
from mlxcluster.lab import ring_wait

PROBE = r"""
import socket, time
ours, peer = socket.socketpair()
ours.setblocking(False)
start = time.perf_counter()
for _ in range(100):
    try:
        ours.recv(16)
        raise SystemExit("recv on an empty socket returned")
    except BlockingIOError:
        pass
waited = time.perf_counter() - start
peer.sendall(b"hello")
assert ours.recv(16) == b"hello"
sent = 0
try:
    while True:
        sent += ours.send(b"x" * 65536)
except BlockingIOError:
    pass
received = 0
while received < sent:
    received += len(peer.recv(1 << 20))
assert received == sent
peer.close()
assert ours.recv(16) == b""
loaded = any("ring-wait-" in line for line in open("/proc/self/maps"))
print(f"{waited:.6f} {loaded}")
"""


def probe(preload: Path | None) -> tuple[float, bool]:
    env = {**os.environ, "LD_PRELOAD": str(preload) if preload else ""}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    waited, loaded = out.stdout.split()
    return float(waited), loaded == "True"


def test_a_recv_that_would_block_waits_for_its_socket_and_returns_what_it_did(tmp_path):
    built = ring_wait.library(tmp_path)
    assert built is not None and built.parent == tmp_path
    assert ring_wait.library(tmp_path) == built and len(list(tmp_path.iterdir())) == 1  # built once
    # 100 recvs on an empty socket: each waits up to 200 us for data before EAGAIN (a lower bound,
    # which a loaded machine only makes longer), where without it they return at once.
    waited, loaded = probe(built)
    assert loaded and waited >= 0.01, waited
    _, loaded = probe(None)
    assert not loaded


def test_the_test_sessions_preload_it_after_openblas():
    env = devtools.with_quiet_rings({"LD_PRELOAD": "/first.so", "OTHER": "kept"})
    first, built = env["LD_PRELOAD"].split(":")
    assert first == "/first.so" and env["OTHER"] == "kept"
    assert Path(built).name.startswith("ring-wait-") and Path(built).is_file()
    assert devtools.with_quiet_rings({})["LD_PRELOAD"] == built
