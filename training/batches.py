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

import numpy as np
from mlx_lm.tuner import trainer


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
