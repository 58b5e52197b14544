"""Each rank's work and weights under a layout (mlxcluster/plan/ranks.py): a data rank's micro-batch
of its share, a tensor rank's shard of every width, a pipeline stage's layers, edges and held
micro-batches, and a validation batch that peaks higher than a step."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mlxcluster.launch.stages import Body
from mlxcluster.plan import memory, ranks
from mlxcluster.plan.model import Linear, Shape, Weights
from mlxcluster.plan.ranks import Job, Layout, padded

GB = 2**30
SHAPE = Shape(hidden=1024, layers=8, mlp=4096, heads=16, kv_heads=4, head_dim=64, vocab=32000)
LINEARS = tuple(Linear(layer, path, i, o) for layer in range(8) for path, i, o in
                (("self_attn.q_proj", 1024, 1024), ("self_attn.o_proj", 1024, 1024),
                 ("mlp.up_proj", 1024, 4096), ("mlp.down_proj", 4096, 1024)))
BODY = Body((GB,) * 8, 2 * GB, 2 * GB, tied=False)
JOB = Job(Weights(12 * GB, 12 * GB, False, BODY, LINEARS, 2), SHAPE, length=512, batch_size=8,
          num_layers=4)


def test_mlx_lm_pads_a_batch_to_a_multiple_of_32_and_shifts_a_token():
    assert padded(159, 2048) == 160 and padded(160, 2048) == 160 and padded(161, 2048) == 192
    assert padded(5000, 2048) == 2047


def test_a_data_rank_holds_the_whole_model_and_its_micro_batch_of_its_share():
    even = ranks.peaks(JOB, Layout("data"), 2)
    assert [t.weights for t in even] == [12 * GB, 12 * GB] and even[0] == even[1]
    uneven = ranks.peaks(JOB, Layout("data", (6, 2)), 2)
    assert uneven[0].activations == 3 * uneven[1].activations  # 6 rows against 2
    # At most 2 rows at once on rank 0: 3 micro-batches, which every rank runs (rank 1: 1 row each).
    capped = ranks.peaks(JOB, Layout("data", (6, 2), (2, 0)), 2)
    assert capped[0].activations == uneven[1].activations == 2 * capped[1].activations


def test_a_tensor_rank_holds_a_shard_of_every_width_but_the_hidden_state():
    # Its step's peak; the vocabulary's cut as the model loads is the next test's.
    job = replace(JOB, weights=replace(JOB.weights, body=None))
    whole, shard = ranks.peaks(job, Layout("data"), 1)[0], ranks.peaks(job, Layout("tensor"), 4)[0]
    assert shard.weights == 3 * GB
    # A quarter of the vocabulary, the whole batch on each, at a compiled shard's measured scale.
    assert shard.logits * 4 == pytest.approx(whole.logits * memory.TENSOR_SCALE, rel=1e-6)
    uncompiled = replace(job, compiled=False)
    assert ranks.peaks(uncompiled, Layout("tensor"), 4)[0].logits * 4 == ranks.peaks(
        uncompiled, Layout("data"), 1)[0].logits
    # LoRA of a split linear: one of its two matrices is split.
    assert whole.trainable / 4 < shard.trainable < whole.trainable


def test_a_tensor_rank_peaks_as_it_cuts_its_rows_of_the_vocabulary_where_that_is_higher():
    # The body's 2 GB of embeddings: each rank's weights and twice the whole matrix, as it loads.
    cut = ranks.peaks(JOB, Layout("tensor"), 4)[0]
    assert cut.phase == "cutting the vocabulary" and cut.working == 2 * 2 * GB
    assert cut.total == cut.weights + 4 * GB
    longer = ranks.peaks(replace(JOB, batch_size=64), Layout("tensor"), 4)[0]
    assert longer.phase == "training step" and longer.total > cut.weights + 4 * GB


def test_tensor_ranks_hold_the_head_groups_and_hidden_units_training_gives_them_unevenly_too():
    # 4 key-value groups on 3 ranks: 2, 1 and 1 (training/sharding/parts.bounds), the MLP's 4096
    # units 1366, 1365, 1365, the vocabulary's 32000 10667, 10667, 10666.
    first, second, third = ranks.peaks(JOB, Layout("tensor"), 3)
    assert first.total > second.total > third.total  # the third holds one word less
    assert first.weights > 4 * GB > second.weights
    attention = 8 * 2 * 1024 * 1024  # q and o, of which the first rank holds half, the others a quarter
    mlp, vocab = 8 * 2 * 1024 * 4096, 32000 * 1024
    share = (attention / 2 + mlp * 1366 / 4096 + vocab * 10667 / 32000) / (attention + mlp + vocab)
    assert first.weights == round(12 * GB * share)
    even = ranks.peaks(JOB, Layout("tensor"), 2)
    assert even[0] == even[1] and even[0].weights == 6 * GB


def test_a_pipeline_stage_holds_its_layers_its_edges_and_its_micro_batches_inputs():
    layout = Layout("pipeline", stages=(3, 5), micro_batches=4)
    first, last = ranks.peaks(JOB, layout, 2)
    assert (first.weights, last.weights) == (5 * GB, 7 * GB)  # embeddings first, head last
    assert first.logits == 0 < last.logits
    assert first.trainable == 0 < last.trainable  # the last 4 layers are all on the last stage
    # Every stage but the first keeps the hidden state of each of its 4 micro-batches of 2 rows.
    inputs = 4 * 2 * 512 * SHAPE.hidden * 2
    assert last.activations > inputs > 0
    assert first.activations == 0  # no trained layer, and token ids in: nothing kept for a backward pass


def test_replicas_of_the_stages_split_the_batch():
    layout = Layout("pipeline", shares=(6, 2), stages=(4, 4), micro_batches=2)
    peaks = ranks.peaks(JOB, layout, 4)
    assert peaks[0].weights == peaks[2].weights and peaks[1].weights == peaks[3].weights
    assert peaks[1].logits == 3 * peaks[3].logits


def test_a_longer_validation_split_is_the_peak_when_it_outgrows_a_step():
    step = ranks.peaks(JOB, Layout("data"), 1)[0]
    longer = ranks.peaks(replace(JOB, valid_length=4096), Layout("data"), 1)[0]
    assert step.phase == "training step" and longer.phase == "validation"
    assert longer.activations == 0 and longer.gradients == 0 and longer.total > step.total
    shorter = ranks.peaks(replace(JOB, valid_length=64), Layout("data"), 1)[0]
    assert shorter == step
