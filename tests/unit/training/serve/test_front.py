"""The server's front (training/serve/front.py) on two real tensor-parallel ranks (MLX's ring backend):
when a rank dies, the clients waiting on an answer, streamed or not, are told why by the front, and
the front is gone once rank 0 is; a port already taken is refused with the reason."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import openai
import pytest

from training.model import stand_in
from training.serve.front import STOPPED

from .test_server import ADAPTERS, PROMPT, SHAPE, free_port, start, stop

LONG = 3000  # tokens: an answer that is still under way when the rank is killed


@pytest.fixture(scope="module")
def long_context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("front")
    stand_in.make(root / "model", seed=2, **{**SHAPE, "max_position_embeddings": 4 * LONG})
    for seed, (name, (kind, rank, keys)) in enumerate(ADAPTERS.items()):
        stand_in.adapter(root / "model", root / name, kind, rank, keys, seed)
    return root


def processes(tag: str) -> dict[int, list[str]]:
    """Every process on this machine whose command line holds `tag`: pid -> its arguments."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().decode().split("\0")
            except OSError:
                continue
            if tag in argv:
                found[int(entry.name)] = argv
    return found


def test_a_rank_that_dies_tells_the_waiting_clients_why_and_leaves_nothing(long_context: Path):
    tag = f"front-test-{free_port()}"
    server = start(long_context, 2, "--tag", tag)
    try:
        ranks = processes(tag)
        front = next(pid for pid, argv in ranks.items() if "training.serve.front" in argv)
        rank0 = int(ranks[front][ranks[front].index("--rank0") + 1])
        rank1 = next(pid for pid, argv in ranks.items()  # not the launcher: its argv has the tag too
                     if pid not in (front, rank0) and argv[1:3] == ["-m", "training.serve"])
        api = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
        ends = {str(len(stand_in.BYTES) + i): -100 for i in range(len(stand_in.SPECIALS))}  # no early end
        ask = {"model": "pirate", "max_tokens": LONG, "temperature": 0, "logit_bias": ends,
               "messages": [{"role": "user", "content": PROMPT}]}

        stream = api.chat.completions.create(stream=True, **ask)  # under way: its headers came
        waiting: list[BaseException] = []

        def ask_whole() -> None:
            try:
                api.chat.completions.create(**ask)
            except Exception as error:
                waiting.append(error)

        whole = threading.Thread(target=ask_whole)
        whole.start()
        time.sleep(2.0)  # in the server's queue or batch
        os.kill(rank1, signal.SIGSTOP)  # frozen first: no answer can end before the rank dies
        os.kill(rank1, signal.SIGKILL)

        with pytest.raises(openai.APIError, match="the server stopped before answering") as broke:
            for _ in stream:
                pass
        assert "console names the node" in str(broke.value)
        whole.join(timeout=60)
        assert len(waiting) == 1 and isinstance(waiting[0], openai.InternalServerError), waiting
        assert waiting[0].status_code == 503 and STOPPED in str(waiting[0])

        deadline = time.monotonic() + 30
        while processes(tag) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert processes(tag) == {}, "the front or a rank is still running"
        server.process.wait(timeout=30)  # its status unchecked: invoke serve reads the launcher's log
    finally:
        stop(server.process)


def test_a_port_already_taken_is_refused_with_the_reason(long_context: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        from training.serve import front

        with pytest.raises(front.FrontError, match=f"cannot listen on 127.0.0.1:{port}"):
            front.start("127.0.0.1", port, free_port(), None)


def test_a_broken_off_answer_waits_for_the_controller_to_name_the_node():
    """In-process: rank 0's port answers nothing (it is gone), the controller posts which rank and
    node (mlxcluster.jobs.serve.tell_front, as invoke serve does), and the waiting client hears it."""
    from mlxcluster.jobs.serve import tell_front
    from training.serve import front

    server = front.Front(("127.0.0.1", 0), upstream=free_port(), await_reason=20)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    api = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
    try:
        waiting: list[BaseException] = []

        def ask() -> None:
            try:
                api.models.list()
            except openai.APIError as error:
                waiting.append(error)

        asked = threading.Thread(target=ask)
        started = time.monotonic()
        asked.start()
        time.sleep(0.5)
        assert asked.is_alive(), "answered before the controller said why"
        assert tell_front(url, "rank 1 on node2 was killed by signal 9")
        # The front holds a broken-off answer up to await_reason (20 s) for the controller's word:
        # the message below is that word, whenever a loaded runner lets it come.
        asked.join(timeout=120)
        assert not asked.is_alive(), "the waiting client was not told"
        print(f"the waiting client was told in {time.monotonic() - started:.1f} s")
        assert len(waiting) == 1 and isinstance(waiting[0], openai.InternalServerError), waiting
        said = "the server stopped before answering: rank 1 on node2 was killed by signal 9"
        assert waiting[0].status_code == 503 and said in str(waiting[0])
        with pytest.raises(openai.InternalServerError, match="rank 1 on node2"):  # later ones too, at once
            api.models.list()
    finally:
        server.shutdown()
        server.server_close()
    assert not tell_front(url, "again"), "nobody is there to tell"
