"""What one rank's memory holds at its peak in a training step, term by term: the one accounting of
memory in the project (the memory preflight, `invoke doctor` and `invoke plan` all ask it).

The peak of a step is MLX's own (`mx.get_peak_memory()`, what summary.json reports per rank): the
arrays alive at once, at the moment the backward pass starts. Its terms:

- weights: the base as this rank holds it (whole, its tensor-parallel shard or its pipeline stage;
  packed, or float where it dequantizes);
- trainable weights, their gradients and the optimizer's state for them: LoRA's two matrices per
  adapted linear layer in float32 (DoRA's magnitudes too; a full fine-tune trains the base's own
  weights, counted once); Adam and AdamW keep two states per weight, SGD and Muon one, Adafactor
  a row and a column per matrix; the gradients are made as the backward pass frees the
  activations, so they count only where they outgrow them (a full fine-tune of a short batch);
- activations: what the backward pass needs of each trained layer's forward, per token of the
  micro-batch (its rows times the longest example, padded as mlx-lm pads it), in widths of the
  hidden state, of the MLP and of the attention's scores (heads times the sequence: the attention
  of the CPU and of the vjp is not a fused kernel); with grad checkpointing each trained layer
  keeps only its input, and one layer is recomputed whole at a time;
- the working set: one layer's forward in flight (its MLP and its attention scores, which every
  layer makes, trained or not);
- logits: the head's output for every token and their loss's gradient, over the vocabulary this
  rank holds (vocab-parallel under tensor parallelism), on the rank that computes the loss;
- MLX's own: the batch, the random state, the loss's scalars.

A validation batch (the forward pass alone, at the validation split's longest example) peaks
higher than a training step where that split's examples are longer: the rank's peak is the larger.

The coefficients below (elements per token of each width) were fitted on real runs: 44 stand-in
models of 4 layers (hidden 128-384, MLP 256-1024, 2-8 heads, vocabularies of 260-16384, 1-4 rows
of 128-512 tokens, 1, 2 or all layers trained, with and without grad checkpointing), each trained
two steps by `python -m training.finetune` with its peak read from summary.json, compiled as the
nodes run and not compiled as the unit tests run, and checked on SmolLM2-135M; the unit tests
(tests/unit/mlxcluster/plan/test_memory.py) measure each term again on models none of those were.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields, replace

from mlxcluster.plan.model import Linear, Shape

# What a rank's process holds beside MLX's arrays, which its peak (MLX's) does not count but its
# node must give: Python, MLX, mlx-lm, transformers and the tokenizer (113 MB resident after the
# imports on Linux), the data and the buffers of the launcher and of MPI.
PROCESS_BYTES = 256 * 2**20
LORA_ITEMSIZE = 4  # mlx-lm makes the LoRA matrices (and DoRA's magnitudes) in float32
# Optimizer states per trainable weight (mlx.optimizers' init_single): Adafactor is per matrix.
STATES = {"adam": 2, "adamw": 2, "sgd": 1, "muon": 1, "adafactor": 0}


@dataclass(frozen=True)
class Coefficients:
    """Elements per token of each width, fitted on measured peaks (the module's docstring)."""

    saved_hidden: float  # per trained layer: the hidden state's widths the backward pass keeps
    saved_mlp: float  # per trained layer: the MLP's
    saved_scores: float  # per trained layer: the attention's, per head and token of the sequence
    kept_hidden: float  # per trained layer under grad checkpointing: its input
    working_hidden: float  # one layer in flight
    working_mlp: float
    working_scores: float
    logits: float  # per token and word of the vocabulary
    overhead: int  # bytes: MLX's own


# Fitted (least squares on the relative error, no coefficient below 0), then raised together until
# no measured peak was under by more than 4 % (compiled: x1.035, 36 runs from -3.7 % to +9.9 %;
# not compiled: x1.05, 46 runs from -6.2 % to +11.9 %, the three below -5 % toy models of a
# 260-word vocabulary, where a few MB outside these terms show).
COMPILED = Coefficients(12.147, 2.133, 0.601, 2.973, 9.485, 11.041, 1.064, 4.094, 408_000)
UNCOMPILED = Coefficients(8.690, 5.761, 0.618, 2.391, 8.957, 4.750, 1.067, 4.013, 129_000)
# A compiled tensor-parallel rank's activations, working set and logits, in its shard's widths, are
# this much of what the coefficients give a whole model of those widths: measured on 12 runs of 2
# ring ranks (stand-ins of hidden 192-384, vocabularies of 3000-12000, 2-4 rows of 320-640 tokens,
# with and without grad checkpointing), where the coefficients alone were 22-33 % over; one scale
# for the three puts all within -1.6 % to +8.4 %, and SmolLM2-135M on 2 lab nodes at -0.1 % and
# +2.5 %. Uncompiled (the unit tests), the coefficients alone are 4-9 % over: no scale.
TENSOR_SCALE = 0.79
# A compiled rank that trains on quantized weights (QLoRA) keeps more for the backward pass than the
# coefficients give a float model of its widths: SmolLM2-135M 4-bit (group 64) on 2 and 4 rows of
# 128 tokens, every layer trained, kept 12 % more (the plan was 5.7-6.0 % under the peak); 8 of 30
# layers trained, 6 % more. One scale brings all three within -0.2 % to +2 %, grad checkpointing
# to +13 %.
QUANTIZED_KEPT = 1.13


@dataclass(frozen=True)
class Work:
    """What one rank computes in a step."""

    rows: int  # examples in one micro-batch
    length: int  # tokens of each (the longest example, padded as mlx-lm pads it)
    layers: int  # the layers this rank runs
    trained_layers: int  # of those, the ones whose activations the backward pass keeps
    grad_checkpoint: bool
    logits: bool = True  # the rank computes the loss (a pipeline's last stage, every other rank)
    held_micro_batches: int = 0  # a pipeline stage's: the inputs of the micro-batches it keeps
    compiled: bool = True  # MLX_DISABLE_COMPILE unset, as on the nodes
    backward: bool = True  # False: a validation batch, the forward pass alone
    tensor: bool = False  # a tensor-parallel shard's (TENSOR_SCALE)
    quantized: bool = False  # the rank trains on packed (quantized) weights (QUANTIZED_KEPT)

    @property
    def tokens(self) -> int:
        return self.rows * self.length


@dataclass(frozen=True)
class Terms:
    """One rank's peak, term by term, in bytes."""

    weights: int
    trainable: int
    gradients: int
    optimizer: int
    activations: int
    working: int
    logits: int
    overhead: int
    phase: str = "training step"  # or "validation", where a validation batch peaks higher

    @property
    def total(self) -> int:
        return sum(value for _, value in self.named())

    def named(self) -> list[tuple[str, int]]:
        """The terms in bytes, by name."""
        return [(f.name, getattr(self, f.name)) for f in fields(self) if f.name != "phase"]


@dataclass(frozen=True)
class Trainable:
    """The trainable weights of a rank, in bytes."""

    held: int  # held beside the base weights: LoRA's matrices (a full fine-tune trains the base's own)
    size: int  # the weights trained: their gradients' bytes, and each optimizer state's
    factored: int  # Adafactor's state: a row and a column per matrix
    adapted: int = 0  # DoRA: the float bytes of the adapted weights, which its forward makes whole


# DoRA's forward makes each adapted weight whole (the base plus LoRA's product) to take its norm,
# and the backward pass keeps it: copies of the adapted layers' float weights alive at the peak
# (measured: tests/unit/mlxcluster/plan/test_memory.py, DoRA beside LoRA).
DORA_COPIES = 3


def trainable(linears: Iterable[Linear], trained: set[int], fine_tune_type: str, rank: int,
              weights_itemsize: int, keys: Iterable[str] | None = None) -> Trainable:
    """The trainable weights: LoRA's `rank` x (inputs + outputs) per adapted linear of the trained
    layers (those `keys` name, or every one), DoRA's magnitudes (one per output) beside them, or
    the trained linears' own weights for a full fine-tune."""
    held = size = factored = adapted = 0
    names = set(keys) if keys is not None else None
    for linear in linears:
        if linear.layer not in trained or (names is not None and linear.path not in names):
            continue
        if fine_tune_type == "full":
            size += linear.experts * linear.inputs * linear.outputs * weights_itemsize
            factored += linear.experts * (linear.inputs + linear.outputs) * weights_itemsize
            continue
        lora = linear.experts * rank * (linear.inputs + linear.outputs) * LORA_ITEMSIZE
        factored += linear.experts * (2 * rank + linear.inputs + linear.outputs) * LORA_ITEMSIZE
        if fine_tune_type == "dora":
            lora += linear.outputs * LORA_ITEMSIZE
            adapted += linear.experts * linear.inputs * linear.outputs * weights_itemsize
        held, size = held + lora, size + lora
    return Trainable(held, size, factored, adapted)


def optimizer_state(optimizer: str, weights: Trainable) -> int:
    """The optimizer's state for these weights: Adafactor's factored rows and columns, the others
    a copy per state."""
    if optimizer == "adafactor":
        return weights.factored
    return STATES.get(optimizer, 2) * weights.size


def activations(shape: Shape, work: Work, itemsize: int) -> tuple[int, int, int]:
    """(activations kept for the backward pass, the working set, the logits) in bytes, for this
    rank's shape (its heads, MLP and vocabulary: a tensor-parallel shard's) and work."""
    c = COMPILED if work.compiled else UNCOMPILED
    tokens, scores = work.tokens, shape.heads * work.length
    layer = c.saved_hidden * shape.hidden + c.saved_mlp * shape.mlp + c.saved_scores * scores
    logits = c.logits * shape.vocab if work.logits else 0
    if work.grad_checkpoint:
        # Each trained layer keeps its input; the step peaks either at the loss (the logits alive) or
        # at a layer recomputed in the backward pass (its saved widths alive), whichever is larger.
        kept = work.trained_layers * c.kept_hidden * shape.hidden
        if work.trained_layers and layer > logits:
            kept, logits = kept + layer, 0
    else:
        kept = work.trained_layers * layer
    if work.quantized and work.compiled:
        kept *= QUANTIZED_KEPT
    # A pipeline stage keeps the input of every micro-batch it has sent on, to recompute it.
    inputs = work.held_micro_batches * tokens * shape.hidden
    working = c.working_hidden * shape.hidden + c.working_mlp * shape.mlp + c.working_scores * scores
    scale = TENSOR_SCALE if work.tensor and work.compiled else 1.0
    return (round((kept * tokens + inputs) * itemsize * scale), round(working * tokens * itemsize * scale),
            round(logits * tokens * itemsize * scale))


def peak(shape: Shape, work: Work, *, weights: int, trained: Trainable, optimizer: str,
         itemsize: int) -> Terms:
    """One rank's peak, term by term: `weights` as it holds them, its `trained` weights, activations
    in `itemsize` bytes."""
    kept, working, logits = activations(shape, work, itemsize) if work.backward else (
        0, *activations(shape, replace(work, trained_layers=0, held_micro_batches=0), itemsize)[1:])
    kept += DORA_COPIES * trained.adapted if work.backward else 0
    overhead = (COMPILED if work.compiled else UNCOMPILED).overhead
    # The backward pass makes the gradients as it frees the activations they come from: the peak
    # holds whichever is larger, so the gradients count only what they add beyond them.
    gradients = max(0, trained.size - (kept + working + logits)) if work.backward else 0
    return Terms(weights, trained.held, gradients, optimizer_state(optimizer, trained),
                 kept, working, logits, overhead, "training step" if work.backward else "validation")
