"""A quantized base model on the controller: the ranks that dequantize it as they load it, what the run
says and records of each node's base weights, and the fine-tune type it cannot train.

A quantized model stays quantized from the controller's store to every node
(mlxcluster/provision/model_store.py) and into the run: QLoRA, LoRA or DoRA layers over the packed
weights. A node whose inventory says `model_dequantize: true` has its ranks dequantize it as they load
it instead (more memory, and speed where quantized matmuls are slow, as on a Linux CPU): every rank
gets `--dequantize-ranks` with those ranks, in the order the launchers fill the hostfile
(Cluster.rank_nodes, as batch shares are given), unless the settings name the ranks themselves (a
resumed run's recorded ones). The run says what each node trains on, in the dry run and in
run.json; the ranks say it again in summary.json. `full` on a quantized base is refused here, before
anything is synced, unless every rank dequantizes (training/model/quantization.py's rule, which
the ranks apply too).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcluster.describe.cluster import Cluster
from mlxcluster.errors import UserError
from mlxcluster.provision import model_store
from training.config import FinetuneConfig
from training.model import quantization

FROM_INVENTORY = "inventory model_dequantize"
FROM_SETTINGS = "dequantize_ranks in the settings"


def model_config(model: Path, pending_shape: Mapping[str, Any] | None = None) -> Mapping[str, Any] | None:
    """config.json of the model a run trains, as the controller knows it: its folder's, or for a
    model not fetched yet (`pending_shape`) the one its source gives; None: not known (a hub id)."""
    return pending_shape if pending_shape is not None else model_store.shape_of(str(model))


def asked_ranks(cluster: Cluster) -> list[int]:
    """The ranks of the training nodes whose inventory says model_dequantize, in rank order."""
    return [rank for rank, name in enumerate(cluster.rank_nodes()) if cluster.node(name).model_dequantize]


def args(cluster: Cluster, config: Mapping[str, Any] | None, settings: FinetuneConfig) -> list[str]:
    """The flag every rank gets (before the user's own, which win): the ranks that dequantize, when a
    node asks and the model is known to be quantized; none when the settings name the ranks."""
    ranks = asked_ranks(cluster)
    if not ranks or config is None or not quantization.is_quantized(config):
        return []
    if settings.dequantize_ranks is not None:
        return []
    return ["--dequantize-ranks", ",".join(map(str, ranks))]


@dataclass(frozen=True)
class BaseWeights:
    """What each node's ranks train on: the quantized weights as fetched, or dequantized at load."""

    described: str  # the model's quantization, training/model/quantization.py's words
    per_node: dict[str, str]  # run.json's base_weights: node -> `described`, or "dequantized"
    why: str  # who chose the ranks that dequantize

    @property
    def line(self) -> str:
        """What the run says of its base weights, node by node."""
        kept = [node for node, said in self.per_node.items() if said == self.described]
        whole = [node for node, said in self.per_node.items() if said == "dequantized"]
        partly = [
            f"{node} ({said})"
            for node, said in self.per_node.items()
            if said not in (self.described, "dequantized")
        ]
        parts = [
            *([f"kept quantized on {', '.join(kept)}"] if kept else []),
            *(
                [f"dequantized at load on {', '.join(whole + partly)} ({self.why})"]
                if whole or partly
                else []
            ),
        ]
        return f"base weights {self.described}: {'; '.join(parts)}"


def base_weights(
    cluster: Cluster, config: Mapping[str, Any] | None, settings: FinetuneConfig, from_inventory: bool
) -> BaseWeights | None:
    """Each training node's base weights for a run with these settings (None: the model is float,
    or not known before it is fetched)."""
    if config is None or not quantization.is_quantized(config):
        return None
    described = quantization.describe(config)
    dequantizing = set(quantization.parse_ranks(settings.dequantize_ranks))
    ranks_of: dict[str, list[int]] = {}
    for rank, name in enumerate(cluster.rank_nodes()):
        ranks_of.setdefault(name, []).append(rank)
    per_node = {}
    for name, ranks in ranks_of.items():
        mine = [rank for rank in ranks if rank in dequantizing]
        per_node[name] = (
            described
            if not mine
            else "dequantized"
            if mine == ranks
            else f"ranks {','.join(map(str, mine))} dequantized, the others {described}"
        )
    return BaseWeights(described, per_node, FROM_INVENTORY if from_inventory else FROM_SETTINGS)


def check(config: Mapping[str, Any] | None, settings: FinetuneConfig, world_size: int) -> None:
    """Refuse, before anything is synced, a fine-tune type the quantized base cannot train."""
    if config is None:
        return
    ranks = quantization.parse_ranks(settings.dequantize_ranks)
    if problem := quantization.full_problem(config, settings.fine_tune_type, world_size, ranks):
        raise UserError(f"cannot train: {problem}")
