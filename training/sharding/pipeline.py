"""Pipeline-parallel training: each rank a stage of whole layers, the batch through them in
micro-batches, only neighbours talking.

mlx-lm slices a model by layers for inference only (`models/pipeline.py`, in a few model files);
MLX's send and recv have no gradient. Here, for any mlx-lm model whose body is a list of layers:

1. `load` reads the model lazily, puts the trainable layers on the whole model (the same layers
   and random draws as one process), then keeps this stage's run of layers (`stage_layers`:
   uneven runs, in rank order). The model's own `__call__` still runs the stage: on a stage
   after the first its embeddings give a placeholder that its first layer swaps for the
   activations received from the stage before, and on a stage before the last its last layer's
   output is what goes on. Whatever the model does around its layers (masks, scaled embeddings,
   positions, a tied head) is its own code. Weights outside the stage are never read: they stay
   lazy, unevaluated.
2. `PipelineStep` runs one batch (GPipe): the batch's rows in micro-batches forward through the
   stages, then their gradients backward in reverse order, each stage recomputing its forward
   from the activations it received (so it keeps one input per micro-batch, not every layer's
   activations). Traffic goes one way at a time, so no two neighbours ever send to each other at
   once. It stands in for mlx-lm's `value_and_grad` in mlx-lm's own trainer, which keeps its
   loop, accumulation, optimizer, reports and validation.
3. training/sharding/stage_layout.py's `PipelineLayout` is the stages' `Layout`: their files as one
   process's, and the replicas of the stages (pipeline and data together) averaging a stage's
   gradients among themselves.

Ranks and stages: rank = replica x stages + stage, so a replica's stages are consecutive ranks and a
stage's neighbours are rank - 1 and rank + 1, its ring neighbours.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from training.config import ConfigError
from training.data.shares import ShareError, split

# Metal's GPU watchdog ends a command buffer that runs past about 45-60 s and the process with it
# (mlx #3402). A stage evaluates each micro-batch's forward, and each one's backward, on its own (and
# every recv apart, on the CPU stream, so an idle stage never waits inside GPU work); one of them
# taking longer than this is said once, with what makes them shorter.
WATCHDOG_WARN_SECONDS = 20.0

# The dtypes an activation may cross the link in, by a code the stages agree on once.
WIRE_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def stage_layers(total: int, stages: int, weights: Sequence[float] | None = None,
                 counts: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """Each stage's run of layers [start, stop), in rank order: `counts` as given, else in
    proportion to `weights` (each stage's memory, say), else as equal as can be; at least one each."""
    if counts is not None:
        counts = list(counts)
        whole = all(isinstance(c, int) and c >= 1 for c in counts)
        if len(counts) != stages or not whole or sum(counts) != total:
            raise ConfigError(f"pipeline_layers {counts}: give {stages} whole numbers of at least 1, one per "
                              f"stage, that add up to the model's {total} layers")
    else:
        if stages > total:
            raise ConfigError(f"parallel pipeline on {stages} ranks: the model has only {total} layers, and "
                              f"each stage holds at least one; use at most {total} ranks")
        try:
            counts = split(total, list(weights) if weights is not None else [1.0] * stages)
        except ShareError as error:
            raise ConfigError(f"pipeline stages: {error}") from None
    runs, start = [], 0
    for count in counts:
        runs.append((start, start + count))
        start += count
    return runs


# --- a stage of the model ---------------------------------------------------------------------------


class _Boundary:
    """What a stage's edge layers exchange with `StageModel.forward` during one call."""

    def __init__(self) -> None:
        self.incoming: mx.array | None = None
        self.outgoing: mx.array | None = None


def _retyped(module: nn.Module, name: str, namespace: dict[str, Any]) -> None:
    """Give this one module (not its class's other instances) other methods: its parameters and
    their names stay as they are, and so the files' names."""
    base = type(module)
    module.__class__ = type(f"{name}{base.__name__}", (base,), namespace)


def _make_entry(layer: nn.Module, boundary: _Boundary) -> None:
    base = type(layer)

    def __call__(self: nn.Module, x: mx.array, *args: Any, **kwargs: Any) -> Any:
        return base.__call__(self, boundary.incoming, *args, **kwargs)

    _retyped(layer, "StageEntry", {"__call__": __call__})


def _make_exit(layer: nn.Module, boundary: _Boundary) -> None:
    base = type(layer)

    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        out = base.__call__(self, *args, **kwargs)
        boundary.outgoing = out
        return out

    _retyped(layer, "StageExit", {"__call__": __call__})


def _make_placeholder(embedding: nn.Module) -> None:
    """An embedding on a stage after the first: its lookup gives zeros the first layer never reads
    (its weight stays for a tied head's `as_linear` on the last stage, unread elsewhere)."""

    def __call__(self: nn.Module, inputs: mx.array) -> mx.array:
        return mx.zeros((*inputs.shape, 1), dtype=mx.float32)

    _retyped(embedding, "StagePlaceholder", {"__call__": __call__})


def layers_owner(model: nn.Module) -> tuple[nn.Module, str]:
    """The module whose `layers` list is the model's body, and that list's path in the model."""
    for path, module in [("", model), *model.named_modules()]:
        layers = module.get("layers") if isinstance(module, dict) else None
        if isinstance(layers, list) and layers and all(isinstance(layer, nn.Module) for layer in layers):
            return module, f"{path}.layers" if path else "layers"
    raise ConfigError("parallel pipeline needs a model whose body is a list of layers (model.layers); "
                      "this one has none: train it with parallel data or tensor")


@dataclass
class StageModel:
    """This rank's stage of the model: layers [start, stop) of `total`, in place in the model."""

    model: nn.Module
    stage: int
    stages: int
    start: int
    stop: int
    total: int
    prefix: str  # the layers' path in parameter names, e.g. "model.layers"
    boundary: _Boundary = field(default_factory=_Boundary)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def forward(self, inputs: mx.array, incoming: mx.array | None) -> mx.array:
        """This stage's output for a micro-batch of token rows: the logits on the last stage, the
        activations for the next stage on the others (`incoming`: those of the stage before)."""
        self.boundary.incoming = incoming
        out = self.model(inputs)
        return out if self.last else self.boundary.outgoing

    def global_name(self, name: str) -> str:
        """A parameter's name in one process's model (this stage numbers its layers from 0)."""
        return _renumbered(name, self.prefix, self.start)

    def local_name(self, name: str) -> str | None:
        """A whole model's parameter name on this stage; None for another stage's layer."""
        match = re.match(rf"{re.escape(self.prefix)}\.(\d+)\.", name)
        if match is None:
            return name
        index = int(match.group(1))
        return _renumbered(name, self.prefix, -self.start) if self.start <= index < self.stop else None


def _renumbered(name: str, prefix: str, offset: int) -> str:
    return re.sub(rf"^({re.escape(prefix)})\.(\d+)\.", lambda m: f"{m.group(1)}.{int(m.group(2)) + offset}.",
                  name)


def make_stage(model: nn.Module, stage: int, runs: Sequence[tuple[int, int]]) -> StageModel:
    """Keep layers runs[stage] of `model` and make its edges a stage's (see the module's docstring)."""
    owner, prefix = layers_owner(model)
    layers = owner["layers"]
    start, stop = runs[stage]
    if runs[-1][1] != len(layers):
        raise ConfigError(f"pipeline stages cover {runs[-1][1]} layers; the model has {len(layers)}")
    held = StageModel(model, stage, len(runs), start, stop, len(layers), prefix)
    kept = layers[start:stop]
    if not held.first:
        _make_entry(kept[0], held.boundary)
        for path, module in model.named_modules():
            if isinstance(module, nn.Embedding | nn.QuantizedEmbedding) and not path.startswith(prefix + "."):
                _make_placeholder(module)
    if not held.last:
        _make_exit(kept[-1], held.boundary)
    owner["layers"] = kept
    return held


# --- the wire -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Wire:
    """What crosses the link between two stages for a micro-batch of `rows` x `width` tokens."""

    width: int  # the activations' last dimension
    dtype: Any

    def shape(self, inputs: mx.array) -> tuple[int, ...]:
        return (*inputs.shape, self.width)


def probed_wire(stage: StageModel, incoming: Wire | None, what: str, use: str) -> Wire:
    """The form of this stage's output for what the stage before sends: its forward for one token,
    built and never evaluated (only its shape and dtype are read). A ConfigError names `what` and its
    `use` when it is not a dtype that crosses the link."""
    tokens = mx.zeros((1, 1), dtype=mx.int32)
    probe = None if incoming is None else mx.zeros(incoming.shape(tokens), dtype=incoming.dtype)
    out = stage.forward(tokens, probe)
    if out.dtype not in WIRE_DTYPES:
        raise ConfigError(f"{what} are {out.dtype}: {use} float32, float16 or bfloat16 ones")
    return Wire(out.shape[-1], out.dtype)


def agree_on_wires(stage: StageModel, group: Any) -> tuple[Wire | None, Wire | None]:
    """The activations' form into this stage and out of it, found once before training: each stage
    builds (and never evaluates) its forward for one token from what the stage before sends, and
    tells the next stage its output's width and dtype."""
    incoming = None
    if not stage.first:
        code = mx.distributed.recv((2,), mx.int32, group.rank() - 1, group=group, stream=mx.cpu)
        width, dtype = code.tolist()
        incoming = Wire(width, WIRE_DTYPES[dtype])
    outgoing = None
    if not stage.last:
        outgoing = probed_wire(stage, incoming, "the activations between stages",
                               "parallel pipeline sends")
        code = mx.array([outgoing.width, WIRE_DTYPES.index(outgoing.dtype)], dtype=mx.int32)
        mx.eval(mx.distributed.send(code, group.rank() + 1, group=group, stream=mx.cpu))
    return incoming, outgoing


# --- one batch through the stages ----------------------------------------------------------------------


def micro_rows(rows: int, micro: int) -> list[tuple[int, int]]:
    """The batch's rows [start, stop) of each micro-batch: at most `micro` of them, none empty."""
    count = max(1, min(micro, rows))
    runs, start = [], 0
    for index in range(count):
        stop = start + rows // count + (index < rows % count)
        runs.append((start, stop))
        start = stop
    return runs


def summed_cross_entropy(cross_entropy: Callable[[mx.array, mx.array], mx.array], logits: mx.array,
                         targets: mx.array, lengths: mx.array) -> tuple[mx.array, mx.array]:
    """The sum of the target tokens' losses, and their count, as training.data.batches' loss masks them."""
    steps = mx.arange(1, targets.shape[1] + 1)
    mask = mx.logical_and(steps >= lengths[:, 0:1], steps <= lengths[:, 1:])
    return (cross_entropy(logits, targets) * mask).astype(mx.float32).sum(), mask.sum()


class PipelineStep:
    """One batch's loss and this stage's gradients, for mlx-lm's trainer (`value_and_grad`), and its
    loss alone (validation), through every stage in `micro` micro-batches."""

    def __init__(self, stage: StageModel, group: Any, micro: int,
                 cross_entropy: Callable[[mx.array, mx.array], mx.array] = nn.losses.cross_entropy,
                 warn_seconds: float = WATCHDOG_WARN_SECONDS):
        self.stage, self.group, self.micro, self.cross_entropy = stage, group, micro, cross_entropy
        self.warn_seconds, self._warned = warn_seconds, False
        self.incoming, self.outgoing = agree_on_wires(stage, group)
        # What the training steps did (validation is not counted), for the run's summary.json: seconds
        # blocked in recv, bytes sent to each rank, micro-batches and steps, and the seconds of the steps;
        # and the longest evaluation of one micro-batch's work (validation's too: the watchdog's).
        self.counters: dict[str, Any] = {"steps": 0, "micro_batches": 0, "step_seconds": 0.0,
                                         "recv_wait_seconds": 0.0, "bytes_sent_to": {},
                                         "longest_eval_seconds": 0.0,
                                         "layers": [stage.start, stage.stop], "total_layers": stage.total,
                                         "stages": stage.stages}
        self._counting = False

    # mlx-lm's trainer: `nn.value_and_grad(model, loss)(model, *batch)`.
    def value_and_grad(self, model: nn.Module, loss: Any) -> Callable[..., Any]:
        return self.loss_and_gradients

    def _recv(self, shape: tuple[int, ...], wire: Wire, source: int) -> mx.array:
        received = mx.distributed.recv(shape, wire.dtype, source, group=self.group, stream=mx.cpu)
        tic = time.perf_counter()
        mx.eval(received)
        if self._counting:
            self.counters["recv_wait_seconds"] += time.perf_counter() - tic
        return received

    def _evaluated(self, *values: Any) -> None:
        """One micro-batch's work on this stage, evaluated at once and timed (see
        WATCHDOG_WARN_SECONDS): the longest is counted, and one past the limit said once."""
        tic = time.perf_counter()
        mx.eval(*values)
        seconds = time.perf_counter() - tic
        self.counters["longest_eval_seconds"] = max(self.counters["longest_eval_seconds"], seconds)
        if seconds > self.warn_seconds and not self._warned:
            self._warned = True
            print(f"rank {self.group.rank()}: warning: one micro-batch's work on this stage (layers "
                  f"{self.stage.start + 1}-{self.stage.stop}) took {seconds:.0f} s at once; on a Mac, "
                  "Metal's GPU watchdog ends work that runs past about 45-60 s (mlx #3402): make the "
                  "micro-batches smaller (a larger pipeline_micro_batches) or give this stage fewer "
                  "layers (pipeline_layers)", flush=True)

    def _received(self, inputs: mx.array) -> mx.array | None:
        """The stage before's activations for these token rows (None on the first stage)."""
        if self.stage.first:
            return None
        return self._recv(self.incoming.shape(inputs), self.incoming, self.group.rank() - 1)

    def _send(self, value: mx.array, destination: int) -> None:
        mx.eval(mx.distributed.send(value, destination, group=self.group, stream=mx.cpu))
        if self._counting:
            sent = self.counters["bytes_sent_to"]
            sent[str(destination)] = sent.get(str(destination), 0) + value.nbytes

    def _inputs(self, batch: mx.array, lengths: mx.array) -> list[tuple[mx.array, mx.array, mx.array]]:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        return [(inputs[a:b], targets[a:b], lengths[a:b]) for a, b in micro_rows(batch.shape[0], self.micro)]

    def _counted(self, total: mx.array, tokens: mx.array) -> tuple[mx.array, mx.array]:
        """The batch's loss and tokens as mlx-lm's trainer sums them over every rank and divides by
        them: each replica's last stage counts its share of the batch (times the stages, one
        replica's ranks), the others nothing."""
        if self.stage.last:
            return total * self.stage.stages, tokens
        return mx.array(0.0), mx.array(0)

    def loss_and_gradients(self, model: nn.Module, batch: mx.array, lengths: mx.array,
                           scale: mx.array) -> tuple[tuple[mx.array, mx.array], Any]:
        """One training step, counted (`counters`)."""
        tic, self._counting = time.perf_counter(), True
        try:
            return self._step(model, batch, lengths, scale)
        finally:
            self._counting = False
            self.counters["steps"] += 1
            self.counters["micro_batches"] += len(micro_rows(batch.shape[0], self.micro))
            self.counters["step_seconds"] += time.perf_counter() - tic

    def _step(self, model: nn.Module, batch: mx.array, lengths: mx.array,
              scale: mx.array) -> tuple[tuple[mx.array, mx.array], Any]:
        stage, here = self.stage, self.group.rank()
        parts = self._inputs(batch, lengths)
        received: list[mx.array | None] = []
        # The random key each micro-batch's forward starts from: its recomputation draws the same
        # dropout masks.
        keys = []
        for inputs, _, _ in parts:  # forward: every micro-batch on to the next stage
            incoming = self._received(inputs)
            received.append(incoming)
            keys.append(_random_key())
            if not stage.last:
                out = stage.forward(inputs, incoming).astype(self.outgoing.dtype)
                self._evaluated(out)
                self._send(out, here + 1)
        after_forward = _random_key()
        params = model.trainable_parameters()
        gradients, total, tokens = None, mx.array(0.0), mx.array(0)
        # backward, the last micro-batch first: each stage recomputes its forward from what it received
        for (inputs, targets, part_lengths), incoming, key in reversed(list(zip(parts, received, keys,
                                                                                 strict=True))):
            primals = [params] if stage.first else [params, incoming]
            _set_random_key(key)

            def run(trainable: Any, activations: mx.array | None = None,
                    inputs: mx.array = inputs) -> mx.array:
                model.update(trainable)
                return stage.forward(inputs, activations)

            if stage.last:
                def loss(*primal: Any, targets: mx.array = targets, lengths: mx.array = part_lengths,
                         run: Callable[..., mx.array] = run) -> tuple[mx.array, mx.array]:
                    summed, count = summed_cross_entropy(self.cross_entropy, run(*primal), targets, lengths)
                    return summed * scale, count

                (value, count), grads = mx.value_and_grad(loss, argnums=list(range(len(primals))))(*primals)
                grads = grads if len(primals) > 1 else (grads,)  # one argnum: MLX gives it bare
                total, tokens = total + value, tokens + count
            else:
                cotangent = self._recv(self.outgoing.shape(inputs), self.outgoing, here + 1)
                grads = _vjp(run, primals, cotangent)
            gradients = grads[0] if gradients is None else tree_map(mx.add, gradients, grads[0])
            back = [grads[1].astype(self.incoming.dtype)] if not stage.first else []
            self._evaluated(gradients, total, tokens, *back)
            if back:
                self._send(back[0], here - 1)
        model.update(params)
        _set_random_key(after_forward)
        return self._counted(total, tokens), gradients

    def loss(self, model: nn.Module, batch: mx.array, lengths: mx.array,
             scale: mx.array) -> tuple[mx.array, mx.array]:
        """A batch's loss (validation): forward through the stages; the last stage's counted."""
        stage, here = self.stage, self.group.rank()
        total, tokens = mx.array(0.0), mx.array(0)
        for inputs, targets, part_lengths in self._inputs(batch, lengths):
            incoming = self._received(inputs)
            out = stage.forward(inputs, incoming)
            if stage.last:
                summed, count = summed_cross_entropy(self.cross_entropy, out, targets, part_lengths)
                total, tokens = total + summed * scale, tokens + count
                self._evaluated(total, tokens)
            else:
                out = out.astype(self.outgoing.dtype)
                self._evaluated(out)
                self._send(out, here + 1)
        if not stage.last:
            return mx.array(0.0), mx.array(0)
        return total, tokens


def _vjp(run: Callable[..., mx.array], primals: list[Any], cotangent: mx.array) -> list[Any]:
    """`run(parameters[, activations])`'s vector-Jacobian product with `cotangent`: the parameters'
    gradients as their tree, then (given activations) the activations'. mx.vjp takes flat arrays."""
    names, values = zip(*tree_flatten(primals[0]), strict=True) if tree_flatten(primals[0]) else ((), ())

    def tree(arrays: Sequence[mx.array]) -> Any:
        # A stage with no trained layer has no parameter: an empty dict, as the optimizer's state is
        # one (tree_unflatten gives an empty list, which the optimizer would index as its state).
        return tree_unflatten(list(zip(names, arrays, strict=True))) if names else {}

    def flat(*arrays: mx.array) -> list[mx.array]:
        return [run(tree(arrays[:len(names)]), *arrays[len(names):])]

    _, grads = mx.vjp(flat, [*values, *primals[1:]], [cotangent])
    return [tree(grads[:len(names)]), *grads[len(names):]]


def _random_key() -> int:
    high, low = mx.random.state[0].tolist()
    return (high << 32) | low


def _set_random_key(key: int) -> None:
    mx.random.seed(key)  # MLX's key for a seed s is [s >> 32, s & 0xFFFFFFFF]


class TrainerNN:
    """mlx.nn as mlx-lm's trainer sees it during a pipeline run: its `value_and_grad` is the stages'."""

    def __init__(self, step: PipelineStep):
        self.value_and_grad = step.value_and_grad

    def __getattr__(self, name: str) -> Any:
        return getattr(nn, name)
