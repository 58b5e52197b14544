"""What one serving rank holds at its peak (`invoke serve`), term by term, in the accounting of a
training rank's (mlxcluster/plan/memory.py): its weights as it holds them, the key-value cache of
one request as long as the served context, and the prefill of that request's largest chunk.

- weights: the whole base, a tensor-parallel rank's shard (its heads and MLP units, split as
  training splits them, and the vocabulary whole) or a pipeline stage's layers and edges;
  each adapter's LoRA matrices beside them;
- the key-value cache: mlx-lm's KVCache keeps each layer's keys and values of every token so far,
  in the activations' dtype, grown 256 tokens at a time; a rank caches the layers it runs and the
  key-value heads it holds;
- the prefill: mlx-lm reads a prompt in chunks of 2048 tokens (prefill_step_size), each chunk one
  layer at a time, attending to every token up to its end: the largest chunk's working set, in
  widths of the hidden state, of the MLP and of the scores (heads times the keys so far), with
  coefficients of its own (a forward pass with no backward to keep, measured on the server). Only
  the last token's logits are made.

The rule a server is held to is vLLM's: it must hold at least one request as long as the context
it serves (a prompt and its max_tokens; the server refuses longer ones). Requests served at once
share what memory is left beyond that one; `invoke serve --context` serves a shorter context where
a model's own (128k tokens for many) would not fit.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

from mlxcluster.describe.cluster import Cluster
from mlxcluster.plan import memory, ranks
from mlxcluster.plan import model as model_files
from mlxcluster.plan.model import Shape, Weights
from training.data import shares as share_rules

KV_STEP = 256  # mlx_lm.models.cache.KVCache grows its keys and values this many tokens at a time
PREFILL_STEP = 2048  # mlx_lm.server's prefill_step_size: the tokens of a prompt read at once
LORA_BYTES = memory.LORA_ITEMSIZE
# Elements per token of a prefill chunk, in widths of the hidden state, of the MLP and of the
# attention's scores (heads times the keys so far: the CPU's attention is not a fused kernel), fitted
# on `python -m training.serve`'s /health peaks: two stand-ins (hidden 192 and 384, MLP 512 and 768,
# 6 and 4 heads, vocabularies of 1000 and 8000) at prompts of 600-4000 tokens; one layer's forward at
# a time, the vocabulary's logits for the last token only. SmolLM2-135M read by mlx-lm's
# stream_generate at 300-2100 tokens peaked 3-9 % under what these give.
PREFILL_HIDDEN, PREFILL_MLP, PREFILL_SCORES = 6.8, 4.7, 1.0
# A tensor-parallel rank's chunk holds more of the whole hidden state: its linears' partial outputs
# and their sums across the ranks (rank 0 of 2 on the stand-in of hidden 192: 4.3 widths more).
PREFILL_TENSOR_HIDDEN = 5.0
STOCK_PROMPT_CACHE = 10  # mlx_lm.server's prompt_cache_size: the prompts whose caches it keeps
DEFAULT_LORA_RANK = 8  # mlx-lm's, where an adapter's config does not say
DEFAULT_CONTEXT = 4096  # a model whose config.json does not say its context


@dataclass(frozen=True)
class Terms:
    """One serving rank's peak, term by term, in bytes."""

    weights: int
    adapters: int
    kv_cache: int
    prefill: int
    overhead: int

    @property
    def total(self) -> int:
        return sum(value for _, value in self.named())

    def named(self) -> list[tuple[str, int]]:
        return [(f.name, getattr(self, f.name)) for f in fields(self)]


def kv_cache_bytes(shape: Shape, layers: int, tokens: int, itemsize: int) -> int:
    """The keys and values of `tokens` tokens over `layers` layers of `shape` (its key-value heads:
    a tensor-parallel shard's), as mlx-lm's KVCache allocates them (in steps of KV_STEP)."""
    allocated = math.ceil(tokens / KV_STEP) * KV_STEP
    return 2 * layers * shape.kv_heads * shape.head_dim * allocated * itemsize


def prefill_bytes(shape: Shape, context: int, itemsize: int, tensor: bool = False) -> int:
    """The working set of a prompt of `context` tokens read in chunks of PREFILL_STEP: the largest
    chunk's, each chunk's tokens attending to every token up to its end (`tensor`: a
    tensor-parallel shard's)."""
    hidden = PREFILL_HIDDEN + (PREFILL_TENSOR_HIDDEN if tensor else 0)
    largest, start = 0, 0
    while start < context:
        chunk = min(PREFILL_STEP, context - start)
        start += chunk
        per_token = hidden * shape.hidden + PREFILL_MLP * shape.mlp + PREFILL_SCORES * shape.heads * start
        largest = max(largest, round(chunk * per_token * itemsize))
    return largest


def rank_peak(shape: Shape, *, weights: int, adapters: int, layers: int, context: int,
              itemsize: int, tensor: bool = False) -> Terms:
    """A rank of `shape` (a shard's widths) that holds `weights` and `adapters` bytes and runs
    `layers` layers, reading a prompt of `context` tokens."""
    return Terms(weights, adapters, kv_cache_bytes(shape, layers, context, itemsize),
                 prefill_bytes(shape, context, itemsize, tensor), memory.UNCOMPILED.overhead)


def adapter_bytes(model: Weights, ranks: Sequence[int], fraction: float) -> int:
    """LoRA matrices of rank `ranks[i]` on every linear the model has, one adapter each, in
    `fraction` of the model (a shard's or a stage's): the most each adapter can hold."""
    per_rank = sum(linear.experts * (linear.inputs + linear.outputs) for linear in model.linears)
    return round(sum(ranks) * per_rank * LORA_BYTES * fraction)


def peaks(model: Weights, shape: Shape, *, mode: str, world: int, context: int,
          adapter_ranks: Sequence[int] = (), stages: Sequence[int] | None = None) -> list[Terms]:
    """Each serving rank's peak in rank order: `mode` single (one rank, the whole model), tensor or
    pipeline (`stages`: each rank's layers, None: as equal as can be) over `world` ranks, serving
    requests of up to `context` tokens with adapters of these LoRA ranks."""
    itemsize = model.float_itemsize
    if mode == "tensor" and world > 1:
        return [_tensor_rank(model, shape, world, rank, context, adapter_ranks) for rank in range(world)]
    if mode == "pipeline" and world > 1:
        counts = list(stages) if stages else share_rules.split(shape.layers, [1.0] * world)
        body = model.body
        held = body.stage_bytes(counts) if body and len(body.layers) == sum(counts) else [
            round(model.stored * count / sum(counts)) for count in counts]
        return [rank_peak(shape, weights=bytes_held, layers=count, context=context, itemsize=itemsize,
                          adapters=adapter_bytes(model, adapter_ranks, count / sum(counts)))
                for bytes_held, count in zip(held, counts, strict=True)]
    return [rank_peak(shape, weights=model.stored, adapters=adapter_bytes(model, adapter_ranks, 1.0),
                      layers=shape.layers, context=context, itemsize=itemsize)]


def _tensor_rank(model: Weights, shape: Shape, world: int, rank: int, context: int,
                 adapter_ranks: Sequence[int]) -> Terms:
    """A tensor-parallel serving rank: its head groups and MLP units of every layer (split as
    training/sharding splits them), the vocabulary whole (training/serve/model.py keeps it whole on
    every rank, as mlx-lm's shard() does)."""
    groups = ranks.part(max(shape.kv_heads, 1), world, rank)
    units = ranks.part(shape.mlp, world, rank)
    attention = sum(ranks.size(x) for x in model.linears if ranks.is_attention(x))
    mlp = sum(ranks.size(x) for x in model.linears) - attention
    fraction = (attention * groups + mlp * units) / (attention + mlp) if attention + mlp else 1 / world
    body = model.body
    edges = body.embeddings + body.head if body else 0
    weights = edges + round((model.stored - edges) * fraction)
    shard = replace(shape, kv_heads=max(round(groups * shape.kv_heads), 1),
                    heads=max(round(groups * shape.heads), 1), mlp=max(round(units * shape.mlp), 1))
    return rank_peak(shard, weights=weights, adapters=adapter_bytes(model, adapter_ranks, fraction),
                     layers=shape.layers, context=context, itemsize=model.float_itemsize, tensor=True)


def longest_context(shape: Shape, free: int, peak: Terms, itemsize: int, layers: int) -> int:
    """The longest context (tokens, a multiple of KV_STEP) whose one request's cache fits in `free`
    bytes beside what `peak` holds without a cache (0: not one step)."""
    per_step = kv_cache_bytes(shape, layers, KV_STEP, itemsize)
    room = free - (peak.total - peak.kv_cache)
    return max(room // per_step, 0) * KV_STEP if per_step else 0


@dataclass(frozen=True)
class Server:
    """A server's plan: each rank's peak, at the context it serves."""

    ranks: tuple[Terms, ...]
    context: int  # the longest request served, in tokens


def adapter_rank(run: Path) -> int:
    """The LoRA rank of a run's adapter (its adapter_config.json; mlx-lm's default 8 where unsaid)."""
    try:
        config = json.loads((run / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return DEFAULT_LORA_RANK
    lora = config.get("lora_parameters") if isinstance(config, dict) else None
    rank = lora.get("rank") if isinstance(lora, dict) else None
    return rank if isinstance(rank, int) and rank > 0 else DEFAULT_LORA_RANK


def for_server(model_dir: Path, mode: str, *, world: int, context: int | None,
               adapters: Sequence[Path] = (), stages: Sequence[int] | None = None) -> Server | None:
    """The plan of serving the model in `model_dir` in `mode` (single, tensor or pipeline) on
    `world` ranks, with the adapters of these runs, requests of up to `context` tokens (None: the
    model's own context, else DEFAULT_CONTEXT); None: its files do not say its widths."""
    found = model_files.weights(model_dir, by_layer=True, linears=True)
    shape = model_files.Shape.of(model_files.read_config(model_dir))
    if found is None or shape is None:
        return None
    served = context or shape.positions or DEFAULT_CONTEXT
    spread = world if mode in ("tensor", "pipeline") else 1
    return Server(tuple(peaks(found, shape, mode=mode, world=spread, context=served, stages=stages,
                              adapter_ranks=[adapter_rank(run) for run in adapters])), served)


def fix(server: Server) -> str:
    """What to do when a node cannot hold its serving ranks."""
    cache = max(t.kv_cache for t in server.ranks)
    return (f"serve a shorter context: --context (now {server.context:,} tokens, whose one request's "
            f"cache is ~{cache / 1e9:.2f} GB a rank); or spread the base over more nodes with --parallel "
            "tensor or pipeline; or close other programs")


def kept_prompts(server: Server | None, cluster: Cluster, free: Mapping[str, int | None]) -> int:
    """How many prompts' caches the server keeps (mlx-lm's prompt cache, for a later request with
    the same beginning): as many whole requests' caches as each node holds beyond its ranks' peaks
    and processes, at most mlx-lm's own STOCK_PROMPT_CACHE (so where memory is not known)."""
    if server is None:
        return STOCK_PROMPT_CACHE
    ranks_of: dict[str, list[int]] = {}
    for rank, name in enumerate(cluster.rank_nodes()[:len(server.ranks)]):
        ranks_of.setdefault(name, []).append(rank)
    kept = STOCK_PROMPT_CACHE
    for name, held in ranks_of.items():
        if (available := free.get(name)) is None:
            continue
        spare = available - sum(server.ranks[r].total + memory.PROCESS_BYTES for r in held)
        cache = sum(server.ranks[r].kv_cache for r in held)
        kept = min(kept, max(spare // cache, 0) if cache else kept)
    return kept

