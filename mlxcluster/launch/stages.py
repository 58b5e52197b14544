"""Pipeline stages sized to each Mac: how many whole layers each rank of a `parallel: pipeline` run
holds, worked out on the controller and passed to every rank as `--pipeline-layers a,b,c`.

A Mac Studio of 192 GB beside two of 64 GB holds three times as much as either: under an equal
split the small ones fill up while the big one idles, so each rank's run of layers is sized in
proportion to what its node's memory can give (its free memory as the preflight counts it:
mlxcluster/check/room.py's `free_memory`, the control group's limit where there is one), a node's
ranks sharing it equally. Sizing by the same figure the preflight compares against means that a run
sized here is one the preflight lets through whenever the model fits the cluster at all. The
layers are dealt in ring (rank) order, so that every stage's neighbours are its ring neighbours,
by the same deal that splits a batch (training/data/shares.py), so 192, 64 and 64 GB give 18, 6
and 6 of 30 layers exactly.

With pipeline and data together (`pipeline_stages` fewer than the ranks) the ranks make replicas of
the stages, each a run of consecutive ranks; a stage is sized by the least memory among its replicas'
ranks, since every replica holds it.

Who decides, first wins: the run's settings (`pipeline_layers` in the config or a flag; a resumed
run's config.yaml keeps what the user set); a resumed run's own stages as run.json recorded them,
when it runs on as many ranks; the inventory's per-node `pipeline_layers` (each of that node's
ranks holds that many; the nodes without one share the rest); each node's free memory; equal
stages when any node's memory is not known, said so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcluster.describe.cluster import Cluster, Node
from mlxcluster.errors import UserError
from mlxcluster.launch.quantized import model_config
from training.config import FinetuneConfig
from training.data import shares
from training.parallel_rules import pipeline_stage_count, stage_problems

# Where a model's config.json says how many layers its body has: most mlx-lm architectures say
# num_hidden_layers; gpt2 and its kin n_layer; a few n_layers or num_layers. A multimodal model
# keeps its language model's under text_config (mlx-lm trains that part).
LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
NESTED_CONFIGS = ("text_config", "language_config", "llm_config")


def layer_count(config: Mapping[str, Any] | None) -> int | None:
    """The layers of a model's body, from its config.json (None: not said there)."""
    if not isinstance(config, Mapping):
        return None
    for key in LAYER_KEYS:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    for key in NESTED_CONFIGS:
        if (found := layer_count(config.get(key))) is not None:
            return found
    return None


@dataclass(frozen=True)
class Body:
    """Where a model's bytes are, by pipeline stage: each layer's, the embeddings' and the rest's
    outside the layers (the final norm and the head: the last stage's)."""

    layers: tuple[int, ...]
    embeddings: int
    head: int
    tied: bool  # no head of its own: the last stage reads the embeddings as its head

    def edges(self, stage: int, stages: int) -> int:
        """The bytes outside the layers that stage `stage` of `stages` holds: the embeddings on every
        stage but a last one with a head of its own (a stage between keeps its placeholder's weight,
        training/sharding/pipeline.py: bench.plan's 3-stage SmolLM2 runs measured it there), the
        head on the last."""
        last = stage == stages - 1
        return (self.head if last else 0) + (self.embeddings if not last or self.tied or stages == 1 else 0)

    def stage_bytes(self, counts: Sequence[int]) -> list[int]:
        """Each stage's bytes, for stages of `counts` layers in order."""
        held, start = [], 0
        for stage, count in enumerate(counts):
            held.append(sum(self.layers[start:start + count]) + self.edges(stage, len(counts)))
            start += count
        return held


def fitted(body: Body, capacities: Sequence[float]) -> list[int]:
    """Each stage's layers, in order, at least one each, that make the fullest stage as little full as
    can be: its bytes (its layers' and its edges', Body.edges) over its capacity (its free memory).
    Exact, by dynamic programming over where each stage ends."""
    layers, stages = len(body.layers), len(capacities)
    prefix = [0]
    for size in body.layers:
        prefix.append(prefix[-1] + size)

    def fullness(stage: int, start: int, stop: int) -> float:
        return (prefix[stop] - prefix[start] + body.edges(stage, stages)) / capacities[stage]

    # best[stage][stop]: the least fullest-stage of stages 0..stage holding layers [0, stop)
    best = [[math.inf] * (layers + 1) for _ in range(stages)]
    cut = [[0] * (layers + 1) for _ in range(stages)]
    for stop in range(1, layers - stages + 2):
        best[0][stop] = fullness(0, 0, stop)
    for stage in range(1, stages):
        for stop in range(stage + 1, layers - stages + stage + 2):
            for start in range(stage, stop):
                found = max(best[stage - 1][start], fullness(stage, start, stop))
                if found <= best[stage][stop]:  # a tie: the earlier stages the more, as shares.split deals
                    best[stage][stop], cut[stage][stop] = found, start
    counts, stop = [], layers
    for stage in range(stages - 1, 0, -1):
        start = cut[stage][stop]
        counts.append(stop - start)
        stop = start
    return [stop, *reversed(counts)]


@dataclass(frozen=True)
class Stages:
    """Each rank's layers, in rank order, and where the sizes come from."""

    counts: tuple[int, ...]
    why: str
    # Sized again for a resumed run whose settings set stages the ranks left cannot hold: its flags
    # then go after the user's own, and say how many stages too.
    refit: bool = False

    @property
    def args(self) -> list[str]:
        """The flags every rank gets (before the user's own, which win, unless refit)."""
        stages = ["--pipeline-stages", str(len(self.counts))] if self.refit else []
        return [*stages, "--pipeline-layers", ",".join(map(str, self.counts))]

    @property
    def line(self) -> str:
        """What the run says of its stages before it starts."""
        return f"pipeline stages {','.join(map(str, self.counts))} layers ({self.why})"


def asks_memory(settings: FinetuneConfig) -> bool:
    """Whether planning this run may size its stages from the nodes' memory (so they are asked)."""
    return settings.parallel == "pipeline" and settings.pipeline_layers is None


def _ranks(cluster: Cluster) -> list[Node]:
    return [node for node in cluster.training_nodes for _ in range(node.slots)]


def _gb(size: float) -> str:
    """Bytes in GB as people read a Mac's memory: `192`, `7.5`."""
    gb = size / 2**30
    return f"{gb:.0f}" if gb >= 10 else f"{gb:.1f}"


def rank_memory(cluster: Cluster, memory: Mapping[str, int | None] | None) -> list[float | None]:
    """Each rank's part of its node's free memory (None: not known), in rank order: a node's
    ranks share it equally, as they share its GPU."""
    weights: list[float | None] = []
    for node in _ranks(cluster):
        free = (memory or {}).get(node.name)
        weights.append(free / node.slots if free and free > 0 else None)
    return weights


def by_memory(layers: int, weights: Sequence[float | None]) -> list[int]:
    """`layers` dealt among ranks in proportion to their memory; equal when any is not known (a
    guess for one rank would skew them all)."""
    known = [w for w in weights if w is not None]
    even = len(known) < len(weights)
    try:
        return shares.split(layers, [1.0] * len(weights) if even else known)
    except shares.ShareError:
        raise UserError(f"{layers} layers cannot give each of {len(weights)} pipeline stages one: "
                        f"train on at most {layers} ranks") from None


def _memory_words(memory: Mapping[str, int | None] | None, nodes: Sequence[Node]) -> str:
    """Where memory-sized stages come from, or why they are equal instead."""
    if memory is None:
        return "equal: the nodes' free memory is not asked in a dry run; the run sizes them from it"
    unknown = [n.name for n in nodes if not (memory.get(n.name) or 0) > 0]
    if unknown:
        return f"equal: the free memory of {', '.join(unknown)} is not known"
    sizes = ", ".join(f"{n.name} {_gb(memory[n.name] or 0)}"
                      + (f" over {n.slots} ranks" if n.slots > 1 else "") for n in nodes)
    return f"from each node's free memory: {sizes} GB"


def _folded(values: Sequence[Any], stages: int) -> list[list[Any]]:
    """Per-rank values gathered per stage: stage s is ranks s, s + stages, ... (one per replica)."""
    return [list(values[stage::stages]) for stage in range(stages)]


def _stage_fixed(cluster: Cluster, ranks: Sequence[Node], stages: int) -> list[int]:
    """Each stage's layers as the inventory sets them on its ranks' nodes (0: not set); a UserError
    when the replicas of a stage sit on nodes that set different numbers."""
    fixed = []
    for stage, nodes in enumerate(_folded(ranks, stages)):
        given = {n.pipeline_layers for n in nodes if n.pipeline_layers}
        if len(given) > 1:
            named = ", ".join(f"{n.name} {n.pipeline_layers}" for n in nodes if n.pipeline_layers)
            raise UserError(f"pipeline_layers in the inventory differs between the replicas of stage "
                            f"{stage} ({named}): a stage holds the same layers in every replica; give "
                            "those nodes the same number")
        fixed.append(given.pop() if given else 0)
    return fixed


def sized(cluster: Cluster, layers: int, memory: Mapping[str, int | None] | None,
          stages: int | None = None, body: Body | None = None) -> Stages:
    """The `stages` (default: one per rank) of `layers`, from the inventory's pipeline_layers where
    a node sets it and the free memory of each stage's ranks for the rest (the least of its
    replicas'; equal when any is not known): with the model's bytes by layer (`body`, from its
    safetensors headers) each stage's edges count (Body.edges; fitted), else
    the layers are dealt in proportion. A UserError names the nodes when the inventory's numbers
    cannot add up to the model's layers."""
    ranks = _ranks(cluster)
    stages = stages or len(ranks)
    fixed = _stage_fixed(cluster, ranks, stages)
    free = [stage for stage, count in enumerate(fixed) if not count]
    by_hand = sorted({n.name for n in ranks if n.pipeline_layers})
    rest = layers - sum(fixed)
    if by_hand and (rest < len(free) or (not free and rest != 0)):
        given = ", ".join(f"{name} {cluster.node(name).pipeline_layers}" for name in by_hand)
        wanted = (f"add up to {layers}" if not free else
                  f"leave at least one layer to each of the {len(free)} other stages")
        raise UserError(f"pipeline_layers in the inventory ({given}, per stage) leaves {rest} of the "
                        f"model's {layers} layers: make them {wanted}, or leave pipeline_layers out "
                        "to size the stages from each node's memory")
    weights = [None if None in held else min(held) for held in _folded(rank_memory(cluster, memory), stages)]
    edges = (body is not None and len(body.layers) == layers and not by_hand and None not in weights
             and stages <= layers)
    if edges:
        assert body is not None
        weights = [float(w) for w in weights if w is not None]
        dealt = iter(fitted(body, weights))
    else:
        dealt = iter(by_memory(rest, [weights[stage] for stage in free]) if free else [])
    counts = tuple(count or next(dealt) for count in fixed)
    others = list({n.name: n for stage in free for n in _folded(ranks, stages)[stage]}.values())
    why = "; ".join([*([f"pipeline_layers in the inventory on {', '.join(by_hand)}"] if by_hand else []),
                     *([_memory_words(memory, others)] if others else [])])
    if edges:
        why += "; the embeddings and the head counted where they are held"
    if stages < len(ranks):
        why += f"; {len(ranks) // stages} replicas of the stages, each stage as its smallest replica"
    return Stages(counts, why)


def recorded_stages(recorded: Any, stages: int, layers: int) -> tuple[int, ...] | None:
    """A resumed run's stages as its run.json recorded them, when they still fit: as many stages
    (a fault may have left fewer ranks) and the model's layers."""
    if not isinstance(recorded, list) or len(recorded) != stages:
        return None
    whole = all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in recorded)
    return tuple(recorded) if whole and sum(recorded) == layers else None


def for_run(cluster: Cluster, settings: FinetuneConfig, model_config: Mapping[str, Any] | None,
            memory: Mapping[str, int | None] | None, recorded: Any = None,
            resumed: bool = False, body: Body | None = None) -> Stages | None:
    """The stages to give the ranks of this run (None: not a pipeline run, the settings set
    pipeline_layers themselves, or the model's layers are not known here, and the ranks split
    them equally by themselves). `memory`: each node's free memory (None: not asked, a dry run);
    `recorded`: a resumed run's pipeline_layers from its run.json; `resumed`: stages set by hand
    that the ranks of a resumed run cannot hold (a Mac lost) are sized again (`refitted`); `body`:
    the model's bytes by layer, when its headers were read (`sized`)."""
    if settings.parallel != "pipeline" or cluster.world_size < 2:
        return None
    layers = layer_count(model_config)
    if layers is None:
        return None
    if resumed and (refit := refitted(cluster, settings, layers, memory, body)):
        return refit
    if not asks_memory(settings):
        return None
    count = pipeline_stage_count(settings, cluster.world_size)
    if kept := recorded_stages(recorded, count, layers):
        return Stages(kept, "as this run recorded them when it started")
    return sized(cluster, layers, memory, count, body)


def for_doctor(cluster: Cluster, model_dir: Path, parallel: str, memory: Mapping[str, int | None],
               body: Body | None = None) -> tuple[int, ...] | None:
    """The stages `invoke train --parallel pipeline` would size from this free memory (and the
    model's bytes by layer), for invoke doctor's memory check (None: another mode, or the model's
    layers are not known or fewer than the ranks: equal stages)."""
    layers = layer_count(model_config(model_dir))
    if parallel != "pipeline" or layers is None or not 2 <= cluster.world_size <= layers:
        return None
    return sized(cluster, layers, memory, body=body).counts


def refitted(cluster: Cluster, settings: FinetuneConfig, layers: int,
             memory: Mapping[str, int | None] | None, body: Body | None = None) -> Stages | None:
    """A resumed run's stages when those its settings set by hand (pipeline_layers, pipeline_stages)
    do not fit the ranks it has now, as after a lost Mac: as many stages as pipeline_stages when it
    still divides the ranks, else one a rank, sized from the nodes' memory and said so (None: they
    fit). A checkpoint resumes in any stages, so the run goes on where it can."""
    world = cluster.world_size
    if not stage_problems(settings, world):
        return None
    given = settings.pipeline_stages
    count = given if given and world % given == 0 else world
    if count > layers:
        raise UserError(f"the {world} ranks left cannot each hold a stage of the model's {layers} layers: "
                        f"resume on at most {layers} ranks")
    fresh = sized(cluster, layers, memory, count, body)
    hand = ", ".join(f"{key} {getattr(settings, key)}" for key in ("pipeline_stages", "pipeline_layers")
                     if getattr(settings, key))
    return Stages(fresh.counts, f"{hand} set by hand do not fit the {world} ranks now: sized again, "
                                f"{fresh.why}", refit=True)
