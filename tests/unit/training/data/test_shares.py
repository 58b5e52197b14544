"""Batch shares (training/data/shares.py, training/data/batches.py): each rank's whole examples of a global
batch, its micro-batches, and the loss scale that makes an update one process's on the whole batch."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from fractions import Fraction

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.tuner import trainer

from tests.unit.training.model.test_folder import tiny_model
from training.data import shares
from training.data.batches import rank_parts, summed_loss, target_mask


@pytest.mark.parametrize(
    ("batch", "weights", "expected"),
    [
        (4, [3, 1], [3, 1]),
        (4, [1, 1], [2, 2]),
        (5, [1, 1], [3, 2]),  # the extra example to the lower rank
        (8, [1.0, 0.3], [6, 2]),
        (3, [100, 1, 1], [1, 1, 1]),  # every rank at least one, however slow
        (10, [5, 3, 2], [5, 3, 2]),
        (7, [2, 2, 2], [3, 2, 2]),
        (8, [5, 1, 1, 1], [5, 1, 1, 1]),  # exactly proportional: every rank's step takes as long
        (12, [3, 1, 1, 1], [6, 2, 2, 2]),
        (9, [1, 1, 1, 1], [3, 2, 2, 2]),
    ],
)
def test_a_batch_is_split_by_weight_into_whole_examples(batch, weights, expected):
    assert shares.split(batch, weights) == expected


def slowest(cut: Sequence[int], weights: Sequence[Fraction]) -> Fraction:
    return max(Fraction(s) / w for s, w in zip(cut, weights, strict=True))


def every_split(batch: int, ranks: int) -> Iterator[tuple[int, ...]]:
    """Every way to give `ranks` ranks at least one example each of `batch`."""
    for bars in itertools.combinations(range(1, batch), ranks - 1):
        edges = (0, *bars, batch)
        yield tuple(b - a for a, b in itertools.pairwise(edges))


@settings(max_examples=300, deadline=None)
@given(weights=st.lists(st.integers(1, 9), min_size=1, max_size=4), extra=st.integers(0, 9))
def test_the_slowest_rank_is_as_fast_as_any_split_makes_it(weights, extra):
    batch = len(weights) + extra
    cut = shares.split(batch, [float(w) for w in weights])
    exact = [Fraction(w) for w in weights]
    assert sum(cut) == batch and min(cut) >= 1
    assert slowest(cut, exact) == min(slowest(other, exact) for other in every_split(batch, len(weights)))
    # Proportional whenever the weights allow it: then every rank's part takes as long.
    if any(all(Fraction(s) / w == Fraction(batch, sum(weights)) for s, w in zip(other, exact, strict=True))
           for other in every_split(batch, len(weights))):
        assert len({Fraction(s) / w for s, w in zip(cut, exact, strict=True)}) == 1


def test_the_same_weights_give_the_same_shares_and_the_times_say_how_even_they_are():
    rng = np.random.default_rng(0)
    for _ in range(500):
        ranks = int(rng.integers(1, 9))
        weights = [float(w) for w in rng.uniform(0.05, 10, ranks)]
        batch = int(rng.integers(ranks, 300))
        cut = shares.split(batch, weights)
        assert sum(cut) == batch and min(cut) >= 1
        assert cut == shares.split(batch, list(weights))
        times = shares.step_times(cut, weights)
        assert min(times) == 1.0 and len(times) == ranks
    assert shares.step_times([6, 2], [1.0, 0.5]) == [1.5, 1.0]


@pytest.mark.parametrize(
    ("batch", "weights", "message"),
    [
        (2, [1, 1, 1], "a global batch of 2 cannot give each of 3 ranks an example"),
        (4, [1, 0], "batch shares must be positive numbers"),
        (4, [1, float("nan")], "batch shares must be positive numbers"),
        (4, [], "no ranks"),
    ],
)
def test_a_split_that_cannot_be_made_says_why(batch, weights, message):
    with pytest.raises(shares.ShareError, match=message):
        shares.split(batch, weights)


def test_per_rank_values_are_parsed_one_each_or_one_for_all():
    assert shares.parse("3,1", 2, "batch_shares") == [3, 1]
    assert shares.parse("2", 3, "max_micro_batch") == [2, 2, 2]
    with pytest.raises(shares.ShareError, match="gives 3 ranks a value, but the run has 2"):
        shares.parse("1,1,1", 2, "batch_shares")
    with pytest.raises(shares.ShareError, match="whole numbers separated by commas"):
        shares.parse("3;1", 2, "batch_shares")


def test_every_rank_runs_as_many_micro_batches_as_the_one_that_needs_most():
    assert shares.micro_batches([6, 2], [0, 0]) == 1
    assert shares.micro_batches([6, 2], [2, 0]) == 3
    assert shares.micro_batches([6, 2], [4, 1]) == 2
    assert shares.cut(5, 2) == [3, 2] and shares.cut(1, 3) == [1, 0, 0] and shares.cut(6, 3) == [2, 2, 2]


def test_equal_shares_deal_examples_as_mlx_lm_does_and_unequal_ones_spread_each_rank():
    assert shares.deal([2, 2]) == [0, 1, 0, 1]
    assert shares.deal([1, 1, 1]) == [0, 1, 2]
    dealt = shares.deal([6, 2])
    assert sorted(dealt) == [0] * 6 + [1] * 2
    # Rank 1's two examples are one from each half of the length-sorted batch.
    assert dealt.index(1) < 4 <= len(dealt) - 1 - dealt[::-1].index(1)


# --- the batches and their loss ---------------------------------------------------------------------


def padded_batch(rng: np.random.Generator, rows: int, max_seq_length: int = 80):
    """A global batch as mlx-lm pads it: sorted by length, (offset, length) per row."""
    lengths = np.sort(rng.integers(3, 100, rows))
    lengths = np.minimum(lengths, max_seq_length)
    width = min(1 + 32 * -(-int(lengths.max()) // 32), max_seq_length)
    batch = np.zeros((rows, width), np.int32)
    for i, n in enumerate(lengths):
        batch[i, :n] = rng.integers(1, 250, n)
    offsets = rng.integers(0, 3, rows)  # a masked prompt of a token or two
    return batch, np.stack([offsets, lengths], axis=1).astype(np.int32)


def test_each_ranks_micro_batches_hold_its_share_and_their_tokens_sum_to_the_batchs():
    rng = np.random.default_rng(1)
    for cut, micro in itertools.product(([3, 1], [6, 2], [1, 1, 4], [2, 2]), (1, 2, 3)):
        batch, lengths = padded_batch(rng, sum(cut))
        total = int(target_mask(batch, lengths).sum())
        seen, tokens = 0, 0
        for rank, share in enumerate(cut):
            parts = list(rank_parts(batch, lengths, cut, rank, micro, training=True))
            assert len(parts) == micro  # every rank as many, for every gradient exchange
            # An empty micro-batch is one row of length 0.
            assert sum(int((part_lengths[:, 1] > 0).sum()) for _, part_lengths, _ in parts) == share
            for part, part_lengths, scale in parts:
                assert part.shape[1] <= batch.shape[1]
                tokens += int(target_mask(part, part_lengths).sum())
                assert scale == pytest.approx(len(cut) * micro / total)
            seen += share
        # Cut to their own padding, the rows still count every target the whole batch counts.
        assert seen == sum(cut) and tokens == total


def test_the_summed_loss_is_mlx_lms_mean_loss_times_the_tokens(tmp_path):
    from mlx_lm import load

    tiny_model(tmp_path / "model")
    model, _ = load(str(tmp_path / "model"))
    batch, lengths = padded_batch(np.random.default_rng(2), 5)
    mean, count = trainer.default_loss(model, mx.array(batch), mx.array(lengths))
    summed, same_count = summed_loss(model, mx.array(batch), mx.array(lengths), mx.array(1.0))
    assert same_count.item() == count.item() == int(target_mask(batch, lengths).sum())
    assert summed.item() == pytest.approx(mean.item() * count.item(), rel=1e-5)
    # An empty micro-batch (a rank with fewer examples than micro-batches) counts nothing.
    empty = list(rank_parts(batch[:2], lengths[:2], [1, 1], 0, 3, training=True))[-1]
    loss, none = summed_loss(model, *(mx.array(a) for a in empty))
    assert none.item() == 0 and loss.item() == 0.0
