"""`python -m training.serve.front`: the server's front on the launcher. It holds the API's address and
passes every request to rank 0's HTTP server on a loopback port, so that a client whose answer
breaks off is told why instead of seeing its connection drop.

Why a process of its own: when a rank dies, Open MPI's launcher kills every other rank at once,
rank 0 with it, before rank 0 can answer anyone; MLX's ring launcher stops them too. Rank 0 starts
the front in a session of its own, out of the launcher's reach. A request that gets no whole answer
(rank 0 gone before or while answering) gets a 503 that says what happened, or, in a stream already
under way, an error event as OpenAI's streams send one (its Python client raises it as an APIError);
the front then exits as soon as rank 0 is gone and every waiting client has been told. Everything
else (the endpoints, the API key, errors of rank 0's own) passes through unchanged.

Which rank went away, and on which node, only the launcher's output says, and the controller reads
it (`invoke serve`): it posts what it read to the front (`REASON_PATH`, from loopback only, which its
ssh tunnel is), and a front started with `--await-reason` holds a broken-off answer that long for it,
so that the client's error names the node as the console does.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

STOPPED = ("the server stopped before answering: one of its ranks went away (a node died, lost its "
           "link or was stopped) or the server was shut down; invoke serve's console names the node. "
           "Send the request again once it is served again")
STREAM_END = b"data: [DONE]"  # how mlx-lm ends every whole stream
REASON_PATH = "/_front/stopped"  # the controller posts {"reason": ...} here once it knows why
# Headers that belong to one connection, not to the request or the answer (RFC 9110, 7.6.1).
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "te",
              "trailer", "proxy-authenticate", "proxy-authorization"}
POLL_SECONDS = 0.2
DRAIN_SECONDS = 10.0  # at most this long, after rank 0 is gone, to tell the waiting clients


def error_body(message: str = STOPPED, status: int = 503) -> bytes:
    """An error as OpenAI's API writes it (and training/serve/server.py's errors)."""
    return json.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                 "code": status}}).encode()


class Front(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], upstream: int, await_reason: float = 0.0):
        family = socket.getaddrinfo(*address, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        self.address_family = family
        super().__init__(address, Relay)
        self.upstream = upstream
        self.await_reason = await_reason
        self.gone = threading.Event()  # rank 0 is gone: no request reaches it any more
        self.told = threading.Event()  # the controller said why
        self.reason = ""
        self._lock = threading.Lock()
        self.in_flight = 0

    def stopped_message(self) -> str:
        """What a client whose answer broke off is told: why, once the controller has said it
        (waited for up to `await_reason` seconds), else that the console names the node."""
        if self.told.wait(self.await_reason) and self.reason:
            return (f"the server stopped before answering: {self.reason}. Send the request again once it "
                    "is served again")
        return STOPPED

    @contextlib.contextmanager
    def counted(self) -> Iterator[None]:
        """A request in flight while inside."""
        with self._lock:
            self.in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self.in_flight -= 1

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that went away; the console is rank 0's, and may be gone


class Relay(BaseHTTPRequestHandler):
    server: Front
    protocol_version = "HTTP/1.0"  # as mlx-lm's handler: one request per connection

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        with self.server.counted():
            self._relay()

    do_POST = do_OPTIONS = do_DELETE = do_PUT = do_GET

    def _stopped(self) -> None:
        body = error_body(self.server.stopped_message())
        with contextlib.suppress(OSError):
            self.send_response(503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def _relay(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length > 0 else None
        if self.path == REASON_PATH and self.command == "POST":
            return self._told(body)
        if self.server.gone.is_set():
            return self._stopped()
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        upstream = http.client.HTTPConnection("127.0.0.1", self.server.upstream)
        try:
            try:
                upstream.request(self.command, self.path, body=body, headers=headers)
                answer = upstream.getresponse()
            except (OSError, http.client.HTTPException):
                return self._stopped()
            if "text/event-stream" in (answer.getheader("Content-Type") or ""):
                return self._stream(answer)
            try:
                # Whole before anything is sent: an answer cut off is then still a 503.
                data = answer.read()
            except (OSError, http.client.HTTPException):
                return self._stopped()
            self._head(answer)
            with contextlib.suppress(OSError):
                self.wfile.write(data)
        finally:
            upstream.close()

    def _told(self, body: bytes | None) -> None:
        """The controller's word on why the server stopped; taken from loopback only (the controller's
        ssh tunnel, or the controller on this machine)."""
        try:
            reason = json.loads(body or b"{}").get("reason")
        except (ValueError, AttributeError):
            reason = None
        if self.client_address[0] not in ("127.0.0.1", "::1") or not isinstance(reason, str):
            self.send_error(403 if isinstance(reason, str) else 400)
            return
        self.server.reason = reason[:500]
        self.server.told.set()
        # Answer once the waiting clients have been told: the controller closes its tunnel, through
        # which they may be connected, as soon as it has this answer.
        deadline = time.monotonic() + 3
        while self.server.in_flight > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        self.send_response(204)
        self.end_headers()

    def _head(self, answer: http.client.HTTPResponse) -> None:
        self.send_response_only(answer.status, answer.reason)
        for name, value in answer.getheaders():
            if name.lower() not in HOP_BY_HOP:
                self.send_header(name, value)
        with contextlib.suppress(OSError):
            self.end_headers()

    def _stream(self, answer: http.client.HTTPResponse) -> None:
        """Server-sent events as they come; a stream that ends without mlx-lm's last event broke off."""
        self._head(answer)
        tail = b""
        while True:
            try:
                chunk = answer.read1(65536)
            except (OSError, http.client.HTTPException):
                chunk = b""
            if not chunk:
                break
            tail = (tail + chunk)[-64:]
            try:
                self.wfile.write(chunk)
                self.wfile.flush()
            except OSError:
                return  # the client went away: closing the upstream tells rank 0
        if STREAM_END not in tail:
            with contextlib.suppress(OSError):
                self.wfile.write(b"data: " + error_body(self.server.stopped_message()) + b"\n\n")
                self.wfile.flush()


class FrontError(RuntimeError):
    pass


def start(host: str, port: int, upstream: int, tag: str | None,
          await_reason: float = 0.0) -> subprocess.Popen:
    """This process's front, listening on `host`:`port` and relaying to its loopback `upstream`, in a
    session of its own; FrontError with the reason when it cannot listen."""
    process = subprocess.Popen(
        [sys.executable, "-m", "training.serve.front", "--host", host, "--port", str(port),
         "--upstream", str(upstream), "--rank0", str(os.getpid()), "--await-reason", str(await_reason),
         *(["--tag", tag] if tag else [])],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert process.stdout is not None
    said = process.stdout.readline().strip()
    process.stdout.close()
    if said != "listening":
        process.wait()
        raise FrontError(said.removeprefix("error: ") or f"its front exited with {process.returncode}")
    return process


def arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m training.serve.front", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", type=int, required=True, help="Rank 0's loopback port")
    parser.add_argument("--rank0", type=int, required=True, help="Rank 0's process id (this one's parent)")
    parser.add_argument("--tag", help="Names the server's processes (the controller stops them by it)")
    parser.add_argument("--await-reason", type=float, default=0.0, metavar="SECONDS",
                        help="How long a broken-off answer waits for the controller to say why (0: it "
                             "does not say: the server was started by hand)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Listen, say so on stdout (`listening`, or `error: ...`) and close it; relay until rank 0 is
    gone, then tell the waiting clients and exit."""
    args = arguments(argv)
    try:
        front = Front((args.host, args.port), args.upstream, args.await_reason)
    except OSError as error:
        print(f"error: cannot listen on {args.host}:{args.port}: {error.strerror or error}", flush=True)
        return 2
    print("listening", flush=True)
    # Rank 0 reads that line only; from now on nothing is written where it may no longer be read.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # the controller stops the server
    threading.Thread(target=front.serve_forever, args=(POLL_SECONDS,), daemon=True).start()
    while os.getppid() == args.rank0 and not stop.is_set():
        stop.wait(POLL_SECONDS)
    front.gone.set()
    deadline = time.monotonic() + DRAIN_SECONDS
    while front.in_flight and time.monotonic() < deadline:
        time.sleep(POLL_SECONDS / 4)
    front.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
