"""The serving plan (mlxcluster/plan/serving.py) held to a real server's peak: `python -m
training.serve` with two adapters, one process and two tensor-parallel ranks, answers a prompt
nearly as long as the context it serves, and its /health says rank 0's peak, which the plan must
meet within the issue's aims (never under by more than 5 %, never over by more than 15 %)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlxcluster.check import room
from mlxcluster.errors import UserError
from mlxcluster.jobs import serve as serving_job
from mlxcluster.plan import memory, serving
from tests.unit.training.serve.test_server import Server, start, stop
from training.model import stand_in

# Widths where the cache and the prefill weigh beside the weights: a byte-level tokenizer, a
# character a token.
SHAPE = {"hidden_size": 192, "num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 512,
         "num_hidden_layers": 3, "vocab_size": 1000, "max_position_embeddings": 8192}
ADAPTER_RANKS = {"pirate": 4, "dory": 2}
CONTEXT = 2600
UNDER, OVER = 0.05, 0.15


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("serve-plan")
    stand_in.make(root / "model", **SHAPE)
    for seed, (name, rank) in enumerate(ADAPTER_RANKS.items()):
        stand_in.adapter(root / "model", root / name, "lora" if name == "pirate" else "dora", rank, seed=seed)
    return root


@pytest.fixture(scope="module", params=[1, 2], ids=["one-process", "two-tensor-ranks"])
def served(request: pytest.FixtureRequest, inputs: Path) -> Iterator[tuple[Server, int]]:
    running = start(inputs, request.param, "--context", str(CONTEXT))
    yield running, request.param
    stop(running.process)


def health(server: Server) -> dict:
    with urllib.request.urlopen(server.url.removesuffix("/v1") + "/health", timeout=30) as answer:
        return json.loads(answer.read())


def complete(server: Server, prompt: str, max_tokens: int) -> tuple[int, dict]:
    body = json.dumps({"model": "model", "prompt": prompt, "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(server.url + "/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_a_server_s_peak_at_its_longest_request_is_planned_within_the_aims(served, inputs: Path):
    server, ranks = served
    status, _ = complete(server, "the quick brown fox " * ((CONTEXT - 40) // 20), 16)
    assert status == 200
    peak = health(server)["peak_memory_bytes"]
    plan = serving.for_server(inputs / "model", "tensor" if ranks > 1 else "single", world=ranks,
                              context=CONTEXT, adapters=[inputs / name for name in ADAPTER_RANKS])
    assert plan is not None and plan.context == CONTEXT
    assert -UNDER <= plan.ranks[0].total / peak - 1 <= OVER, (peak, plan.ranks[0])
    # The cache and the prefill are what a long request adds: without them the plan falls short.
    assert plan.ranks[0].total - plan.ranks[0].kv_cache - plan.ranks[0].prefill < (1 - UNDER) * peak


def test_a_request_longer_than_the_served_context_is_refused(served):
    server, _ = served
    status, answer = complete(server, "x" * CONTEXT, 8)
    assert status == 400 and "context of 2600 tokens" in json.dumps(answer)


def test_the_cache_grows_with_the_context_and_splits_with_the_heads(inputs: Path):
    one = serving.for_server(inputs / "model", "single", world=1, context=1024)
    longer = serving.for_server(inputs / "model", "single", world=1, context=4096)
    two = serving.for_server(inputs / "model", "tensor", world=2, context=4096)
    staged = serving.for_server(inputs / "model", "pipeline", world=3, context=4096)
    assert one and longer and two and staged
    assert longer.ranks[0].kv_cache == 4 * one.ranks[0].kv_cache
    assert two.ranks[0].kv_cache + two.ranks[1].kv_cache == longer.ranks[0].kv_cache  # 2 and 1 of 3 groups
    assert [t.kv_cache for t in staged.ranks] == [longer.ranks[0].kv_cache // 3] * 3  # a layer each
    assert serving.for_server(inputs / "model", "single", world=1, context=None).context == 8192


def test_a_context_past_the_model_s_own_is_refused_with_what_to_give(inputs: Path):
    with pytest.raises(UserError, match=r"reads at most 8192 tokens.*--context 8192 or less"):
        serving_job.check_context(9000, inputs / "model")
    serving_job.check_context(8192, inputs / "model")


def test_the_prompt_cache_keeps_what_the_tightest_node_holds_beyond_the_request_in_flight(inputs: Path):
    from tests.unit.mlxcluster.launch.test_stages import layout as cluster_of

    cluster = cluster_of({"node1": 1, "node2": 1})
    server = serving.for_server(inputs / "model", "tensor", world=2, context=4096)
    assert server is not None
    need = [t.total + memory.PROCESS_BYTES for t in server.ranks]
    cache = [t.kv_cache for t in server.ranks]  # rank 0 holds 2 of 3 key-value groups
    free = {"node1": need[0] + 3 * cache[0] + 1, "node2": need[1] + 5 * cache[1]}
    assert serving.kept_prompts(server, cluster, free) == 3
    assert serving.kept_prompts(server, cluster, {"node1": None, "node2": None}) == serving.STOCK_PROMPT_CACHE
    assert serving.kept_prompts(server, cluster, {"node1": need[0] - 1, "node2": None}) == 0
    assert serving.kept_prompts(None, cluster, free) == serving.STOCK_PROMPT_CACHE


def test_a_node_that_cannot_hold_one_request_is_told_to_serve_a_shorter_context(inputs: Path):
    from tests.unit.mlxcluster.launch.test_stages import layout as cluster_of

    need = room.for_server(cluster_of({"node1": 1}), inputs / "model", "single", context=8192,
                        adapters=[inputs / name for name in ADAPTER_RANKS])
    assert need is not None
    assert need.held["node1"] == "the whole model on 1 rank, a request of 8,192 tokens"
    assert need.fix.startswith("serve a shorter context: --context (now 8,192 tokens")


def test_the_plan_and_the_server_read_the_context_from_the_same_keys():
    from mlxcluster.plan import model as model_files
    from training.serve import server

    base = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}
    for key in model_files.CONTEXT_KEYS:
        shape = model_files.Shape.of(base | {key: 1234})
        assert shape is not None and shape.positions == 1234 == server.context_length({key: 1234}), key
    assert server.context_length({"max_positions": 1234}) is None  # a name neither reads
