"""mlx-lm's batching, with a batch order that depends on the seed alone, so a run can resume mid-way.

mlx-lm's `iterate_batches` shuffles with numpy's global RNG: the training order then depends on
every other draw from it, and each validation draws from it too. A run resumed at step k, which
has validated at other moments than the interrupted run, would see other batches after step k.
Here each call of the iterator gets a private numpy RNG (the global one is swapped in only while
mlx-lm's generator runs), so step n always trains on the same batch, whatever happened before it.
The batches themselves (sorting by length, each rank's share, padding) are mlx-lm's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.tuner import trainer

from training.data.shares import cut as cut_counts
from training.data.shares import deal as shares_deal


def _with_private_rng(batches: Iterator[Any], seed: int) -> Iterator[Any]:
    rng = np.random.RandomState(seed).get_state()
    while True:
        outside = np.random.get_state()
        np.random.set_state(rng)
        try:
            batch = next(batches)
        except StopIteration:
            return
        finally:
            rng = np.random.get_state()
            np.random.set_state(outside)
        yield batch


def seeded_iterate_batches(order_seed: int, skip: int = 0) -> Callable[..., Iterator[Any]]:
    """An `iterate_batches` for `trainer.train` (and the `trainer.evaluate` it calls).

    Training (loop=True) walks the epochs in the order `order_seed` gives, starting after the first
    `skip` batches: the ones a resumed run trained on before its checkpoint. Validation (loop=False)
    starts from the same order every time, so every validation sees the same batches and the
    losses are comparable from one to the next (mlx-lm would draw another subset each time).
    """

    def iterate_batches(
        dataset: Any,
        batch_size: int,
        max_seq_length: int,
        loop: bool = False,
        seed: int | None = None,  # mlx-lm's signature; the order's seed is ours
        comm_group: Any = None,
    ) -> Iterator[Any]:
        inner = trainer.iterate_batches(
            dataset=dataset,
            batch_size=batch_size,
            max_seq_length=max_seq_length,
            loop=loop,
            comm_group=comm_group,
        )
        batches = _with_private_rng(inner, order_seed)
        if loop:
            for _ in range(skip):
                next(batches)
        return batches

    return iterate_batches


# --- each rank's share of a global batch -----------------------------------------------------------
#
# mlx-lm gives every rank batch_size / world size examples and averages the ranks' mean losses'
# gradients: exact only when every rank's examples hold as many tokens. Here the global batch is
# cut by the shares (training/data/shares.py), and every micro-batch's loss is the SUM of its token
# losses times `scale` = world size x micro-batches / the global batch's tokens. mlx-lm then
# divides the accumulated gradients by the micro-batches and its average by the world size, so an
# update is the gradient of the global batch's token-mean loss: one process's, on the same batch,
# whatever the shares, the micro-batches and the examples' lengths. (The reported loss is that
# mean too.) Validation micro-batches get scale = 1 / their own tokens: mlx-lm's evaluate weighs
# each by its tokens, which makes the mean exact again.

PAD_TO = 32  # mlx-lm pads a batch to one plus a multiple of this


def target_mask(batch: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The targets a batch's loss counts, as mlx-lm's default_loss masks them: (rows, width - 1)."""
    steps = np.arange(1, batch.shape[1])
    return (steps >= lengths[:, 0:1]) & (steps <= lengths[:, 1:])


def summed_loss_with(
    cross_entropy: Callable[[Any, Any], Any] = nn.losses.cross_entropy, counted: bool = True
) -> Callable[..., tuple[Any, Any]]:
    """`summed_loss` with another per-token cross-entropy (a vocabulary split across ranks:
    training/sharding/vocab_parallel.py), counting no tokens when not `counted`: for the ranks that compute
    a batch another rank counts (tensor parallelism), so that the trainer's sums across ranks
    count each token once."""

    def loss(model: Any, batch: Any, lengths: Any, scale: Any) -> tuple[Any, Any]:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = model(inputs)
        steps = mx.arange(1, targets.shape[1] + 1)
        mask = mx.logical_and(steps >= lengths[:, 0:1], steps <= lengths[:, 1:])
        ce = (cross_entropy(logits, targets) * mask).astype(mx.float32).sum()
        return ce * scale, mask.sum() if counted else mask.sum() * 0

    return loss


# mlx-lm's default_loss as a sum over the target tokens, times `scale`; and the token count.
summed_loss = summed_loss_with()


def _rows(batch: np.ndarray, lengths: np.ndarray, rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Some rows of a padded batch, cut to the padding mlx-lm would give them alone (their
    targets are the same); none: one empty row, which no target counts."""
    if not rows:
        return np.zeros((1, 2), np.int32), np.zeros((1, 2), np.int32)
    longest = int(lengths[rows, 1].max())
    width = min(1 + PAD_TO * -(-longest // PAD_TO), batch.shape[1])
    return batch[rows, :width], lengths[rows]


def rank_parts(batch: np.ndarray, lengths: np.ndarray, shares: list[int], rank: int, micro: int,
               training: bool) -> Iterator[tuple[np.ndarray, np.ndarray, float]]:
    """This rank's micro-batches of one global batch, each with the scale of its summed loss."""
    mine = [i for i, owner in enumerate(shares_deal(shares)) if owner == rank]
    tokens = int(target_mask(batch, lengths).sum())
    start = 0
    for count in cut_counts(len(mine), micro):
        part, part_lengths = _rows(batch, lengths, mine[start:start + count])
        start += count
        if training:
            scale = len(shares) * micro / max(tokens, 1)
        else:
            own = int(target_mask(part, part_lengths).sum())
            scale = 1 / own if own else 0.0
        yield part, part_lengths, scale


class SharedBatches:
    """An `iterate_batches` for `trainer.train`, with `summed_loss` as its loss: mlx-lm's global
    batches (sorted by length, padded, in the seed's order; see `seeded_iterate_batches`), each
    cut into this rank's share (`shares`: examples per rank, summing to the batch size) and that
    into `micro` micro-batches. Every global batch gives every rank `micro` batches.
    `trained_tokens` counts the target tokens this rank has been given to train on.
    `data_group`: the ranks that split the batch (None: the trainer's, all of them)."""

    def __init__(self, order_seed: int, shares: list[int], micro: int = 1, skip: int = 0,
                 data_group: Any = None):
        self.order_seed, self.shares, self.micro, self.skip = order_seed, shares, micro, skip
        self.data_group = data_group
        self.trained_tokens = 0

    def __call__(
        self,
        dataset: Any,
        batch_size: int,
        max_seq_length: int,
        loop: bool = False,
        seed: int | None = None,  # mlx-lm's signature; the order's seed is ours
        comm_group: Any = None,
    ) -> Iterator[Any]:
        group = self.data_group or comm_group
        rank = group.rank() if group is not None else 0
        whole = seeded_iterate_batches(self.order_seed, self.skip)(
            dataset, batch_size, max_seq_length, loop=loop, comm_group=None)
        for batch, lengths in whole:
            for part, part_lengths, scale in rank_parts(np.array(batch), np.array(lengths), self.shares,
                                                        rank, self.micro, training=loop):
                if loop:
                    self.trained_tokens += int(target_mask(part, part_lengths).sum())
                yield mx.array(part), mx.array(part_lengths), mx.array(scale, dtype=mx.float32)
