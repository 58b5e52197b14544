"""Each rank's peak memory under a layout of the cluster: what it holds and computes in a step,
handed to the one accounting (mlxcluster/plan/memory.py).

- data: every rank holds the whole model and runs its share of each batch (at most its
  max_micro_batch rows at once);
- tensor: every rank holds 1/N of every layer (its heads, its part of the MLP and of the
  vocabulary) and runs the whole batch; the hidden state is whole on every rank;
- pipeline: a rank holds its stage's layers (the embeddings on the first, the head on the last)
  and its replica's share of each batch in micro-batches; it keeps the input of every
  micro-batch it received, to recompute its forward in the backward pass (training/sharding/
  pipeline.py), runs uncompiled (a compiled step cannot send and receive), and a stage after the
  first takes the gradient through all of its layers, trained or not, to send it back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from mlxcluster.plan import memory
from mlxcluster.plan.memory import Terms, Work
from mlxcluster.plan.model import Linear, Shape, Weights
from training.data import shares as share_rules
from training.sharding import parts

# mlx-lm pads a batch to one plus a multiple of this (training/data/batches.py says it too, but
# imports mlx-lm, which invoke's tasks must load without).
PAD_TO = 32
# A tensor-parallel linear whose inputs are split (it sums the ranks' parts): attention's output
# and the MLP's down projection, under the names mlx-lm's models give them; the others split
# their outputs.
ROW_SPLIT = ("o_proj", "down_proj", "out_proj", "c_proj", "dense", "wo", "w2", "fc2")


def padded(longest: int, max_seq_length: int) -> int:
    """The tokens the model sees per row of the batch holding the longest example (mlx-lm's
    iterate_batches: one plus a multiple of PAD_TO, at most max_seq_length, less the shifted
    token)."""
    return min(1 + PAD_TO * math.ceil(longest / PAD_TO), max_seq_length) - 1


@dataclass(frozen=True)
class Job:
    """What is trained, as the settings and the model's files say."""

    weights: Weights  # with its linears (and body, for pipeline stages)
    shape: Shape
    length: int  # tokens per row of the longest batch (padded)
    batch_size: int
    valid_length: int = 0  # the validation split's (0: none validated)
    fine_tune_type: str = "lora"
    lora_rank: int = 8
    num_layers: int = 16  # the last layers trained; -1: all
    optimizer: str = "adam"
    grad_checkpoint: bool = False
    dequantize_ranks: frozenset[int] = frozenset()
    compiled: bool = True  # the nodes compile; MLX_DISABLE_COMPILE (the unit tests) does not
    lora_keys: tuple[str, ...] | None = None  # the linears LoRA adapts (None: every one)
    mean_length: float = 0  # the training examples' mean tokens (0: as long as the longest)

    @property
    def trained(self) -> range:
        layers = self.shape.layers
        first = 0 if self.num_layers < 0 else max(layers - self.num_layers, 0)
        return range(first, layers)

    def held(self, rank: int, fraction: float) -> int:
        """The bytes of `fraction` of the model on `rank` (float where it dequantizes)."""
        whole = self.weights.dequantized if rank in self.dequantize_ranks else self.weights.stored
        return round(whole * fraction)

    def packed(self, rank: int) -> bool:
        """Whether `rank` trains on the model's quantized weights as they are packed."""
        return self.weights.quantized and rank not in self.dequantize_ranks

    @property
    def itemsize(self) -> int:
        return self.weights.float_itemsize


@dataclass(frozen=True)
class Layout:
    """How the ranks split the work."""

    parallel: str  # data, tensor or pipeline
    shares: tuple[int, ...] = ()  # examples of a batch per data rank, or per replica of the stages
    limits: tuple[int, ...] = ()  # max_micro_batch per rank (0: none)
    stages: tuple[int, ...] = ()  # a pipeline's layers per stage
    micro_batches: int = 0  # a pipeline's

    @property
    def name(self) -> str:
        if self.parallel != "pipeline":
            return self.parallel
        replicas = len(self.shares)
        return f"pipeline {','.join(map(str, self.stages))}" + (f" x {replicas}" if replicas > 1 else "")


def _tensor_linear(linear: Linear, attention: float, mlp: float) -> Linear:
    """A tensor-parallel rank's part of a linear: `attention` of an attention linear (its head
    groups), `mlp` of any other (its hidden units)."""
    kept = attention if is_attention(linear) else mlp
    if linear.path.rpartition(".")[2] in ROW_SPLIT:
        return replace(linear, inputs=max(round(linear.inputs * kept), 1))
    return replace(linear, outputs=max(round(linear.outputs * kept), 1))


def is_attention(linear: Linear) -> bool:
    return "attn" in linear.path or "attention" in linear.path


def _trainable(job: Job, linears: Sequence[Linear], trained: set[int]) -> memory.Trainable:
    return memory.trainable(linears, trained, job.fine_tune_type, job.lora_rank, job.itemsize, job.lora_keys)


def _terms(job: Job, shape: Shape, work: Work, weights: int, linears: Sequence[Linear],
           trained: set[int]) -> Terms:
    """The rank's peak: its training step's, or a validation batch's where that is higher."""
    held = _trainable(job, linears, trained)
    step = memory.peak(shape, work, weights=weights, trained=held, optimizer=job.optimizer,
                       itemsize=job.itemsize)
    if not job.valid_length:
        return step
    validation = memory.peak(shape, replace(work, length=job.valid_length, backward=False), weights=weights,
                             trained=held, optimizer=job.optimizer, itemsize=job.itemsize)
    return validation if validation.total > step.total else step


def data_ranks(job: Job, layout: Layout, world: int) -> list[Terms]:
    """Each data-parallel rank's peak: the whole model, its largest micro-batch of its share."""
    shares = layout.shares or tuple(share_rules.split(job.batch_size, [1.0] * world))
    limits = layout.limits or (0,) * len(shares)
    micro = share_rules.micro_batches(shares, limits)
    trained = set(job.trained)
    result = []
    for rank, share in enumerate(shares):
        rows = max(share_rules.cut(share, micro)[0], 1)
        work = Work(rows, job.length, job.shape.layers, len(trained), job.grad_checkpoint,
                    compiled=job.compiled, quantized=job.packed(rank))
        result.append(_terms(job, job.shape, work, job.held(rank, 1.0), job.weights.linears, trained))
    return result


def tensor_ranks(job: Job, world: int) -> list[Terms]:
    """Each tensor-parallel rank's peak: its head groups, its part of the MLP and of the vocabulary,
    split as training/sharding splits them (parts.bounds: a rank of 2 holds 2 of 3 key-value
    groups, the other 1), the weights in the same parts, and the whole batch."""
    shape = job.shape
    attention = sum(size(x) for x in job.weights.linears if is_attention(x))
    mlp = sum(size(x) for x in job.weights.linears) - attention
    vocab = shape.vocab * shape.hidden
    trained = set(job.trained)
    work = Work(job.batch_size, job.length, shape.layers, len(trained), job.grad_checkpoint,
                compiled=job.compiled, tensor=True)
    whole = attention + mlp + vocab
    cutting = VOCABULARY_CUT * _embedding_bytes(job)
    result = []
    for rank in range(world):
        groups, units, words = (part(total, world, rank)
                                for total in (max(shape.kv_heads, 1), shape.mlp, shape.vocab))
        shard = replace(shape, kv_heads=round(groups * shape.kv_heads), heads=round(groups * shape.heads),
                        mlp=round(units * shape.mlp), vocab=round(words * shape.vocab))
        linears = [_tensor_linear(linear, groups, units) for linear in job.weights.linears]
        fraction = (attention * groups + mlp * units + vocab * words) / whole if whole else 1 / world
        step = _terms(job, shard, work, job.held(rank, fraction), linears, trained)
        result.append(step if step.total >= step.weights + cutting else replace(
            step, trainable=0, gradients=0, optimizer=0, activations=0, working=cutting, logits=0,
            overhead=0, phase="cutting the vocabulary"))
    return result


# A tensor-parallel rank cuts its rows of the vocabulary from the whole embedding as the model loads
# (training/sharding/vocab_parallel.py): measured, its peak is then its own weights and about twice
# the whole embedding matrix (SmolLM2 on 2 and 3 lab nodes: 229 MB beyond the weights, the matrix
# 113 MB), above a short batch's training step.
VOCABULARY_CUT = 2


def _embedding_bytes(job: Job) -> int:
    body = job.weights.body
    return body.embeddings if body is not None else job.shape.vocab * job.shape.hidden * job.itemsize


def part(total: int, world: int, rank: int) -> float:
    start, stop = parts.bounds(total, world, rank)
    return (stop - start) / total


def size(linear: Linear) -> int:
    return linear.inputs * linear.outputs * linear.experts


def _stage_fractions(job: Job, counts: Sequence[int]) -> list[float]:
    """Each stage's share of the model's bytes: its layers and its edges (Body.edges)."""
    body = job.weights.body
    if body is None or len(body.layers) != sum(counts):
        return [count / sum(counts) for count in counts]
    whole = sum(body.layers) + body.embeddings + body.head
    return [part / whole for part in body.stage_bytes(counts)]


def pipeline_ranks(job: Job, layout: Layout) -> list[Terms]:
    """Each pipeline rank's peak: its stage's layers and edges, its replica's micro-batch, the
    inputs of every micro-batch it received."""
    counts, replicas = layout.stages, max(len(layout.shares), 1)
    shares = layout.shares or (job.batch_size,)
    micro = layout.micro_batches or min(job.batch_size, 2 * len(counts))
    fractions = _stage_fractions(job, counts)
    trained_all = set(job.trained)
    result = []
    for rank in range(len(counts) * replicas):
        stage, replica = rank % len(counts), rank // len(counts)
        start = sum(counts[:stage])
        layers = set(range(start, start + counts[stage]))
        trained = layers & trained_all
        rows = math.ceil(shares[replica] / min(micro, shares[replica]))
        held = min(micro, shares[replica]) if stage else 0  # the first stage keeps token ids only
        kept = len(trained) if stage == 0 else counts[stage]
        work = Work(rows, job.length, counts[stage], kept, job.grad_checkpoint,
                    logits=stage == len(counts) - 1, held_micro_batches=held, compiled=False)
        result.append(_terms(job, job.shape, work, job.held(rank, fractions[stage]),
                             job.weights.linears, trained))
    return result


def peaks(job: Job, layout: Layout, world: int) -> list[Terms]:
    """Each rank's peak under `layout` on `world` ranks, in rank order."""
    if layout.parallel == "tensor" and world > 1:
        return tensor_ranks(job, world)
    if layout.parallel == "pipeline" and world > 1:
        return pipeline_ranks(job, layout)
    return data_ranks(job, layout, world)
