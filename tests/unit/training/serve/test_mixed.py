"""A batch that mixes adapters (training/serve/mixed.py), run through mlx-lm's own BatchGenerator on a
tiny llama with a LoRA and a DoRA over different layers: every row gets, greedily, the tokens stock
mlx-lm generates with that row's adapter alone, while rows join and leave the batch."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import BatchGenerator, stream_generate
from mlx_lm.models.cache import make_prompt_cache

from training.model import stand_in
from training.serve import adapters as served_adapters
from training.serve import model as served_model
from training.serve.mixed import MIXED, ByRow, Mixing, Picks, PromptCaches, RowPicks

SHAPE = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 128}
ADAPTERS = {"pirate": ("lora", 4, None), "dory": ("dora", 2, ["self_attn.q_proj", "self_attn.v_proj",
                                                              "mlp.down_proj"])}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mixed")
    stand_in.make(root / "model", seed=2, **SHAPE)
    for seed, (name, (kind, rank, keys)) in enumerate(ADAPTERS.items()):
        stand_in.adapter(root / "model", root / name, kind, rank, keys, seed)
    return root


def stock_tokens(root: Path, name: str, prompt: list[int], max_tokens: int) -> list[int]:
    """Stock mlx-lm's greedy tokens with the adapter `name` alone (base: none)."""
    model, tokenizer = mlx_lm_load(str(root / "model"),
                                   adapter_path=None if name == served_model.BASE else str(root / name))
    tokens = [step.token for step in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)]
    return [t for t in tokens if t not in tokenizer.eos_token_ids]


def test_each_row_of_a_mixed_batch_gets_its_own_adapter_s_answer(root: Path, monkeypatch):
    ways = Counter()  # how a mixed batch's layers ran: the base once with LoRA terms, or by row groups
    by_row = ByRow.__call__

    def counted(self: ByRow, x):
        if self._grouping().inverse is not None:
            ways["loras over the base" if self._loras_over_base else "row groups"] += 1
        return by_row(self, x)

    monkeypatch.setattr(ByRow, "__call__", counted)
    served = served_model.load(str(root / "model"), [served_adapters.read(n, root / n) for n in ADAPTERS],
                               mx.distributed.init())
    picks = Picks()
    mixing = Mixing(served, picks)
    # (pick, prompt, max_tokens): different lengths, so that rows leave the batch at different steps.
    asked = [("pirate", [1, 5, 9, 13], 10), ("dory", [2, 4, 8], 6), (served_model.BASE, [3, 7], 8),
             ("dory", [11, 12, 13, 14, 15], 12)]
    eos = served.tokenizer.eos_token_ids
    generator = BatchGenerator(mixing, completion_batch_size=8, prefill_batch_size=8,
                               stop_tokens=[[t] for t in eos])
    uids = {}
    for name, prompt, max_tokens in asked:
        picks.admitting = served.names.index(name)  # as the server's generation thread admits it
        (uid,) = generator.insert([prompt], max_tokens=[max_tokens])
        uids[uid] = name
    answers: dict[int, list[int]] = {uid: [] for uid in uids}
    states, done = [], 0
    while done < len(asked):
        _, responses = generator.next()
        states.append(served.current)
        for response in responses:
            if response.token not in eos:
                answers[response.uid].append(response.token)
            done += response.finish_reason is not None
    assert MIXED in states, "the batch never mixed adapters"
    assert ways["loras over the base"] and ways["row groups"], ways  # the LoRA's own layers; the DoRA's
    assert states[-1] == "dory", "the last row alone is answered by its adapter's own layers"
    for uid, (name, prompt, max_tokens) in zip(uids, asked, strict=True):
        each = {pick: stock_tokens(root, pick, prompt, max_tokens) for pick in served.names}
        assert len({tuple(tokens) for tokens in each.values()}) == 3, "the picks answer alike: no test"
        assert answers[uid] == each[name], name


def test_a_prompt_cached_with_one_adapter_is_not_reused_for_another():
    picks = Picks()
    caches = PromptCaches(picks, max_size=4)
    caches.insert_cache("m", [1, 2, 3], [RowPicks([1])])
    picks.admitting = 2
    assert caches.fetch_nearest_cache("m", [1, 2, 3]) == (None, [1, 2, 3])
    picks.admitting = 1
    cache, rest = caches.fetch_nearest_cache("m", [1, 2, 3])
    assert rest == [] and cache[-1].rows == [1]


def test_row_picks_follow_the_rows_through_merge_filter_extend_and_extract():
    merged = RowPicks.merge([RowPicks([0]), RowPicks([2]), RowPicks([1])])
    merged.filter([0, 2])
    merged.extend(RowPicks([2]))
    assert merged.rows == [0, 1, 2] and merged.extract(1).rows == [1]


def test_the_cache_of_a_mixing_model_is_the_model_s_own_and_the_admitted_pick(root: Path):
    served = served_model.load(str(root / "model"), [served_adapters.read("pirate", root / "pirate")],
                               mx.distributed.init())
    picks = Picks()
    picks.admitting = 1
    cache = Mixing(served, picks).make_cache()
    assert len(cache) == len(make_prompt_cache(served.model)) + 1 and cache[-1].rows == [1]
