"""`python -m training.serve` on a tiny llama with two adapters (a LoRA and a DoRA, as mlx-lm writes
them), one process and two tensor-parallel ranks on MLX's ring backend whose heads the ranks do not
divide: real clients (the openai package and curl, streaming and not) get, with greedy decoding,
stock `mlx_lm generate --adapter-path`'s answer for each adapter and for the base; bad requests get a
4xx and the server goes on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from mlx_lm import load, stream_generate

from tests.unit import rings
from training.model import stand_in
from training.serve import READY
from training.serve import adapters as served_adapters

# 6 query heads in 3 key-value groups: 2 ranks take 2 groups and 1 (training/sharding/head_groups.py).
SHAPE = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 128,
         "max_position_embeddings": 2048}
CONTEXT = SHAPE["max_position_embeddings"]
PROMPT = "Who are you?"
TOKENS = 12
ADAPTERS = {"pirate": ("lora", 4, None), "dory": ("dora", 2, ["self_attn.q_proj", "self_attn.v_proj",
                                                              "mlp.down_proj"])}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("serve")
    stand_in.make(root / "model", seed=2, **SHAPE)  # a seed whose adapters each answer otherwise
    for seed, (name, (kind, rank, keys)) in enumerate(ADAPTERS.items()):
        stand_in.adapter(root / "model", root / name, kind, rank, keys, seed)
    return root


@dataclass(frozen=True)
class Answer:
    text: str  # what the `mlx_lm generate` command prints
    tokens: list[int]  # the token ids it generates (its own load and stream_generate, as it runs them)


def stock_answer(model_dir: Path, adapter: Path | None, prompt: str = PROMPT,
                 max_tokens: int = TOKENS) -> Answer:
    """What `mlx_lm generate` answers, greedily, with the adapters in `adapter` (None: the base)."""
    command = [sys.executable, "-m", "mlx_lm", "generate", "--model", str(model_dir),
               "--prompt", prompt, "--max-tokens", str(max_tokens), "--verbose", "False",
               *(["--adapter-path", str(adapter)] if adapter else [])]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True,
                            stdin=subprocess.DEVNULL)
    model, tokenizer = load(str(model_dir), adapter_path=str(adapter) if adapter else None)
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)  # as the command encodes a templated prompt
    tokens = [step.token for step in stream_generate(model, tokenizer, ids, max_tokens=max_tokens)]
    return Answer(result.stdout.removesuffix("\n"), [t for t in tokens if t not in tokenizer.eos_token_ids])


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log: Path
    root: Path  # the model and adapters it serves

    def output(self) -> str:
        return self.log.read_text()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(root: Path, ranks: int, *extra: str) -> Server:
    port = free_port()
    program = [sys.executable, "-m", "training.serve", "--model", str(root / "model"), "--port", str(port),
               *[f"--adapter={name}={root / name}" for name in ADAPTERS], *extra]
    if ranks > 1:
        program = [*rings.launch(ranks), *program, "--expected-world-size", str(ranks)]
    log = root / f"server-{ranks}-{port}.log"
    with log.open("w") as out:  # the server writes on; this process's copy closes
        # No stdin: no rank reads this one (mlx.launch set a shared one non-blocking, and
        # ansible-playbook, later, refused it).
        process = subprocess.Popen(program, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    deadline = time.monotonic() + 180
    while READY not in log.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            stop(process)
            pytest.fail(f"the server did not start:\n{log.read_text()}")
        time.sleep(0.2)
    return Server(f"http://127.0.0.1:{port}/v1", process, log, root)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module", params=[1, 2], ids=["one-process", "two-tensor-ranks"])
def server(request: pytest.FixtureRequest, inputs: Path) -> Iterator[Server]:
    running = start(inputs, request.param)
    yield running
    stop(running.process)


@pytest.fixture(scope="module")
def stock(inputs: Path) -> dict[str | None, Answer]:
    return {name: stock_answer(inputs / "model", inputs / name if name else None)
            for name in (None, *ADAPTERS)}


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def chat(server: Server, model: str, stream: bool = False) -> str:
    messages = [{"role": "user", "content": PROMPT}]
    asked = client(server).chat.completions.create(model=model, messages=messages, max_tokens=TOKENS,
                                                   temperature=0, stream=stream)
    if stream:
        return "".join(chunk.choices[0].delta.content or "" for chunk in asked if chunk.choices)
    return asked.choices[0].message.content


def chat_tokens(server: Server, model: str, key: str | None = None, prompt: str = PROMPT) -> list[int]:
    """The token ids of the server's greedy answer (its logprobs carry them)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": TOKENS,
            "temperature": 0, "logprobs": True}
    code, text = curl(server, "/chat/completions", body, *([f"Authorization: Bearer {key}"] if key else []))
    assert code == 200, text
    return [entry["id"] for entry in json.loads(text)["choices"][0]["logprobs"]["content"]]


def said(stock: dict[str | None, Answer], name: str) -> Answer:
    return stock[None if name == "model" else name]


def curl(server: Server, path: str, body: dict | str, *headers: str) -> tuple[int, str]:
    data = body if isinstance(body, str) else json.dumps(body)
    result = subprocess.run(["curl", "-sN", "-w", "\n%{http_code}", "-H", "Content-Type: application/json",
                             *[arg for h in headers for arg in ("-H", h)], "-d", data, f"{server.url}{path}"],
                            capture_output=True, text=True, timeout=60, check=True)
    text, _, code = result.stdout.rpartition("\n")
    return int(code), text


def test_each_adapter_and_the_base_answer_as_mlx_lm_generate_does(server: Server, stock: dict):
    names = [model.id for model in client(server).models.list().data]
    assert names == ["model", *ADAPTERS]
    assert len({tuple(answer.tokens) for answer in stock.values()}) == 3  # the adapters change the answer
    for name in (*ADAPTERS, "dory", "model", "pirate"):  # switching back and forth
        expected = said(stock, name)
        eos = served_eos(server)
        assert [t for t in chat_tokens(server, name) if t not in eos] == expected.tokens, name
        assert chat(server, name) == expected.text, name
        assert chat(server, name, stream=True) == expected.text, name


def error_of(text: str) -> str:
    """The message of an error as OpenAI writes it."""
    error = json.loads(text)["error"]
    assert error["type"] in ("invalid_request_error", "authentication_error"), error
    return error["message"]


def served_eos(server: Server) -> set[int]:
    return set(stand_in.tokenizer().convert_tokens_to_ids(["<|im_end|>"]))


def test_curl_streams_server_sent_events_and_completes_text(server: Server, stock: dict):
    body = {"model": "pirate", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": TOKENS,
            "temperature": 0, "stream": True}
    code, text = curl(server, "/chat/completions", body)
    assert code == 200
    events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    said = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert said == stock["pirate"].text
    code, text = curl(server, "/completions", {"model": "dory", "prompt": "Ahoy", "max_tokens": 4})
    assert code == 200 and json.loads(text)["usage"]["completion_tokens"] <= 4
    # No model field: the first adapter answers, and the answer says so.
    code, text = curl(server, "/chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                                                    "max_tokens": TOKENS, "temperature": 0})
    assert code == 200 and json.loads(text)["model"] == "pirate"
    assert json.loads(text)["choices"][0]["message"]["content"] == stock["pirate"].text


def test_requests_for_different_adapters_at_once_each_get_their_own_answer(server: Server, stock: dict):
    asked = ["pirate", "dory", "model", "pirate", "dory"]
    with ThreadPoolExecutor(len(asked)) as pool:
        answers = list(pool.map(lambda name: chat(server, name), asked))
    assert answers == [said(stock, name).text for name in asked]


def test_a_request_for_another_adapter_is_answered_while_a_long_one_streams(server: Server, stock: dict):
    """Batched together, not queued: the short request does not wait for the long one to end."""
    messages = [{"role": "user", "content": PROMPT}]
    _, text = curl(server, "/chat/completions", {"model": "pirate", "messages": messages, "max_tokens": 1})
    prompt = json.loads(text)["usage"]["prompt_tokens"]
    no_end = {str(token): -100 for token in served_eos(server)}  # the long answer runs to max_tokens
    # mlx-lm looks at new requests between time slices of 0.5 s (TimeBudget): the long answer must take
    # several of them, or a queued request and a batched one are answered at the same moment.
    long = client(server).chat.completions.create(model="pirate", messages=messages, temperature=0,
                                                  max_tokens=CONTEXT - prompt, stream=True, logit_bias=no_end)
    chunks = iter(long)
    next(chunk for chunk in chunks if chunk.choices and chunk.choices[0].delta.content)
    answered: list[float] = []

    def streams_on_after_the_answer() -> bool:
        return any(answered and time.monotonic() > answered[0] for _ in chunks)

    with ThreadPoolExecutor(1) as pool:
        went_on = pool.submit(streams_on_after_the_answer)
        assert chat(server, "dory") == stock["dory"].text
        answered.append(time.monotonic())
        went_on = went_on.result()
    long.close()  # the server stops a request whose client has gone
    assert went_on, "the dory request waited for the long pirate one to end"


def test_requests_for_one_adapter_at_once_are_batched_and_each_is_mlx_lm_generate_s(server: Server):
    prompts = ["Who are you?", "Ahoy", "Where is the treasure buried, matey?", "Hi"]
    expected = [stock_answer(server.root / "model", server.root / "pirate", prompt).tokens
                for prompt in prompts]
    eos = served_eos(server)
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda prompt: chat_tokens(server, "pirate", prompt=prompt), prompts))
    # The tokens: a batch's text leaves out a last incomplete character that mlx_lm generate prints as U+FFFD.
    assert [[t for t in answer if t not in eos] for answer in answers] == expected


def test_bad_requests_get_a_4xx_that_says_why_and_the_server_goes_on(server: Server, stock: dict):
    code, text = curl(server, "/chat/completions", {"model": "nobody", "messages": [{"role": "user",
                                                                                     "content": "hi"}]})
    assert code == 400 and "pick one of: model, pirate, dory" in error_of(text)
    code, text = curl(server, "/chat/completions", "{not json")
    assert code == 400 and "Invalid JSON" in error_of(text)
    code, text = curl(server, "/chat/completions", {"model": "pirate", "max_tokens": "many",
                                                    "messages": [{"role": "user", "content": "hi"}]})
    assert code == 400 and "max_tokens" in error_of(text)
    code, text = curl(server, "/chat/completions", {"model": "pirate", "max_tokens": CONTEXT - 10,
                                                    "messages": [{"role": "user", "content": "x" * 80}]})
    assert code == 400 and f"over the context of {CONTEXT} tokens this server takes" in error_of(text)
    code, text = curl(server, "/chat/completions", {"model": "pirate", "adapters": "/elsewhere",
                                                    "messages": [{"role": "user", "content": "hi"}]})
    assert code == 400 and "adapters field is not taken" in error_of(text)
    with pytest.raises(openai.BadRequestError, match="not served here"):
        chat(server, "gpt-4")
    assert chat(server, "pirate") == stock["pirate"].text  # still serving
    assert server.process.poll() is None


def test_an_api_key_when_set_is_asked_of_every_request(inputs: Path, stock: dict):
    key = inputs / "key"
    key.write_text("s3cret\n")
    # This server answers one request at a time (--no-batch): the exact mode, mlx_lm generate's answers.
    running = start(inputs, 1, "--api-key-file", str(key), "--no-batch")
    try:
        code, text = curl(running, "/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert code == 401 and "API key" in error_of(text)
        with pytest.raises(openai.AuthenticationError):
            chat(running, "pirate")
        keyed = openai.OpenAI(base_url=running.url, api_key="s3cret", max_retries=0, timeout=60)
        answer = keyed.chat.completions.create(model="pirate", max_tokens=TOKENS, temperature=0,
                                               messages=[{"role": "user", "content": PROMPT}])
        assert answer.choices[0].message.content == stock["pirate"].text
        assert [t for t in chat_tokens(running, "dory", "s3cret") if t not in served_eos(running)] == \
            stock["dory"].tokens
    finally:
        stop(running.process)


def test_the_ready_line_names_the_models_and_each_adapter_s_memory(server: Server):
    line = next(line for line in server.output().splitlines() if READY in line)
    assert "models: model, pirate, dory (a request without one gets pirate)" in line
    assert "adapters per rank: pirate" in line and "dory" in line


def test_a_folder_that_is_not_an_adapter_is_refused_with_what_to_fix(tmp_path: Path, inputs: Path):
    with pytest.raises(served_adapters.AdapterError, match=r"adapter_config\.json is missing"):
        served_adapters.parse([f"x={tmp_path}"])
    (tmp_path / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "full", "num_layers": 2,
                                                               "lora_parameters": {"rank": 8}}))
    (tmp_path / "adapters.safetensors").write_bytes(b"")
    with pytest.raises(served_adapters.AdapterError, match="serve that with --model"):
        served_adapters.parse([f"x={tmp_path}"])
    with pytest.raises(served_adapters.AdapterError, match="names must differ: pirate"):
        served_adapters.parse([f"pirate={inputs / 'pirate'}", f"pirate={inputs / 'dory'}"])
    assert [a.name for a in served_adapters.parse([str(inputs / "dory")])] == ["dory"]
