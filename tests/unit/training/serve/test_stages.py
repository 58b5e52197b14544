"""`python -m training.serve --parallel pipeline` on a tiny llama of 4 layers with two adapters (a
LoRA over 3 layers, a DoRA over 2, so both cross a stage's edge), on 2 and 3 ring ranks in uneven
stages: with greedy decoding each adapter and the base answer as stock `mlx_lm generate
--adapter-path` does, alone and in one batch; a model the stages cannot take is refused with what
to do."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.nn as nn
import pytest
from mlx_lm import load

from tests.unit.training.serve.test_server import (
    ADAPTERS,
    SHAPE,
    Answer,
    Server,
    chat,
    chat_tokens,
    served_eos,
    start,
    stock_answer,
    stop,
)
from training.config import ConfigError
from training.model import stand_in
from training.serve import READY
from training.serve.stages import stage_runs

LAYERS = 4
ADAPTER_LAYERS = {"pirate": 3, "dory": 2}  # each crosses a stage's edge in every split below


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stages")
    stand_in.make(root / "model", seed=2, **SHAPE, num_hidden_layers=LAYERS)
    for seed, (name, (kind, rank, keys)) in enumerate(ADAPTERS.items()):
        stand_in.adapter(root / "model", root / name, kind, rank, keys, seed, layers=ADAPTER_LAYERS[name])
    return root


@pytest.fixture(scope="module")
def stock(inputs: Path) -> dict[str, Answer]:
    return {name: stock_answer(inputs / "model", inputs / name if name != "model" else None)
            for name in ("model", *ADAPTERS)}


@pytest.fixture(scope="module", params=[(2, "1,3"), (3, "1,2,1")],
                ids=["two-stages-1-3", "three-stages-1-2-1"])
def server(request: pytest.FixtureRequest, inputs: Path) -> Iterator[Server]:
    ranks, layers = request.param
    running = start(inputs, ranks, "--parallel", "pipeline", "--pipeline-layers", layers)
    yield running
    stop(running.process)


def answer_tokens(server: Server, name: str) -> list[int]:
    eos = served_eos(server)
    return [t for t in chat_tokens(server, name) if t not in eos]


def test_each_adapter_and_the_base_answer_through_the_stages_as_mlx_lm_generate(server: Server,
                                                                                  stock: dict[str, Answer]):
    assert len({tuple(answer.tokens) for answer in stock.values()}) == 3  # the adapters change the answer
    for name in ("pirate", "dory", "model", "pirate"):  # switching back and forth
        assert answer_tokens(server, name) == stock[name].tokens, name
        assert chat(server, name) == stock[name].text, name
        assert chat(server, name, stream=True) == stock[name].text, name


def test_requests_for_different_adapters_at_once_go_through_the_stages_in_one_batch(
        server: Server, stock: dict[str, Answer]):
    asked = ["pirate", "dory", "model", "dory", "pirate"]
    with ThreadPoolExecutor(len(asked)) as pool:
        answers = list(pool.map(lambda name: answer_tokens(server, name), asked))
    assert answers == [stock[name].tokens for name in asked]
    assert server.process.poll() is None


def test_the_ready_line_names_the_stages(server: Server):
    line = next(line for line in server.output().splitlines() if READY in line)
    assert "models: model, pirate, dory" in line
    assert any(f"on {ranks} rank(s) in pipeline stages of {layers} layers" in line
               for ranks, layers in ((2, "1,3"), (3, "1,2,1")))


def test_more_ranks_than_layers_or_no_list_of_layers_is_refused_with_what_to_do(inputs: Path):
    model, _ = load(str(inputs / "model"), lazy=True)
    assert stage_runs(model, "tiny", 3, None) == [(0, 2), (2, 3), (3, 4)]
    assert stage_runs(model, "tiny", 2, [1, 3]) == [(0, 1), (1, 4)]
    with pytest.raises(ConfigError, match=r"on 5 ranks: it has 4 layers.*at most 4 ranks, or with "
                                          r"--parallel single or tensor"):
        stage_runs(model, "tiny", 5, None)
    with pytest.raises(ConfigError, match="pipeline_layers"):
        stage_runs(model, "tiny", 2, [2, 3])

    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(4, 4)

    with pytest.raises(ConfigError, match=r"flat in pipeline stages: its body is not a list of layers.*"
                                          r"--parallel single or tensor"):
        stage_runs(Flat(), "flat", 2, None)


def test_one_request_at_a_time_in_equal_stages_is_mlx_lm_generate_s(inputs: Path, stock: dict[str, Answer]):
    running = start(inputs, 2, "--parallel", "pipeline", "--no-batch")  # no --pipeline-layers: 2,2
    try:
        assert "in pipeline stages of 2,2 layers" in running.output()
        for name in ("dory", "model", "pirate"):
            assert answer_tokens(running, name) == stock[name].tokens, name
    finally:
        stop(running.process)
