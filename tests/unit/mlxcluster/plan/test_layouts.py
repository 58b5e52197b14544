"""The layouts a cluster allows for a job and the pick (mlxcluster/plan/layouts.py): each node's
need at its peak against its room, data whenever it fits, else the layout that leaves the fullest
node the most room; the largest batch and the longest sequence each layout fits."""

from __future__ import annotations

from dataclasses import replace

from mlxcluster.plan import layouts
from mlxcluster.plan.memory import PROCESS_BYTES
from mlxcluster.plan.ranks import Layout
from tests.unit.mlxcluster.launch.test_stages import layout as cluster_of
from tests.unit.mlxcluster.plan.test_ranks import JOB

GB = 2**30
THREE = {"node1": 1, "node2": 1, "node3": 1}


def planned(cluster, free, job=JOB, tensor_problem=None):
    found = layouts.candidates(cluster, job, free, tensor_problem=tensor_problem)
    fits = [layouts.fit(cluster, job, c, free) for c in found if isinstance(c, Layout)]
    return fits, [c for c in found if not isinstance(c, Layout)]


def test_every_layout_the_cluster_allows_is_planned_and_the_rest_said_why():
    cluster = cluster_of({"node1": 1, "node2": 1, "node3": 1, "node4": 1})
    fits, refused = planned(cluster, {f"node{i}": 64 * GB for i in range(1, 5)},
                            tensor_problem="num_key_value_heads is 4, which 3 ranks do not divide")
    # A stage per rank, equal: every stage holds the embeddings (a stage after the first as its
    # placeholder's weight, the last as its tied head); or two stages twice.
    assert [f.layout.name for f in fits] == ["data", "pipeline 2,2,2,2", "pipeline 4,4 x 2"]
    assert refused == [("tensor", "num_key_value_heads is 4, which 3 ranks do not divide")]
    one_each = cluster_of({"node1": 1})
    fits, _ = planned(one_each, {"node1": 64 * GB})
    assert [f.layout.name for f in fits] == ["data"]


def test_a_node_s_need_is_the_peaks_of_all_of_its_ranks():
    cluster = cluster_of({"node1": 2, "node2": 1})
    fit = layouts.fit(cluster, JOB, Layout("data"), {"node1": None, "node2": None})
    each = fit.peaks[0].total + PROCESS_BYTES  # a rank's peak, and its process beside MLX's arrays
    assert fit.need["node1"] == 2 * each and fit.need["node2"] == fit.peaks[2].total + PROCESS_BYTES
    assert fit.fits  # what is not known does not stop a plan


def test_data_is_picked_whenever_it_fits():
    fits, _ = planned(cluster_of(THREE), dict.fromkeys(THREE, 64 * GB))
    picked, why = layouts.pick(fits)
    assert picked is not None and picked.layout.name == "data" and "only gradients travel" in why


def test_a_model_too_big_for_one_mac_is_split_where_the_fullest_node_keeps_the_most_room():
    # 12 GB of weights on Macs of 8 GB: data cannot fit, nor tensor parallelism, whose ranks each
    # read the whole 2 GB embedding twice over as they cut their rows of it; the pipeline's stages
    # are sized to each node.
    free = {"node1": 8 * GB, "node2": 8 * GB, "node3": 8 * GB}
    fits, _ = planned(cluster_of(THREE), free)
    picked, why = layouts.pick(fits)
    assert [f.layout.name for f in fits if not f.fits] == ["data", "tensor"]
    assert picked is not None and picked.layout.parallel == "pipeline"
    assert picked.fullest == min(f.fullest for f in fits if f.fits)
    assert why.startswith("data parallelism does not fit")
    assert "node1 needs" in fits[0].short()[0]


def test_with_step_times_a_layout_much_faster_than_data_or_the_fastest_that_fits_is_picked():
    fits, _ = planned(cluster_of(THREE), dict.fromkeys(THREE, 64 * GB))
    data, pipeline = fits[0], fits[1]
    timed = [replace(data, step_s=1.0), replace(pipeline, step_s=0.8), *fits[2:]]
    assert layouts.pick(timed)[0] == timed[0]  # some layout not timed: data
    even = [replace(f, step_s=1.0) for f in fits]
    faster = layouts.pick([even[0], replace(even[1], step_s=0.8), *even[2:]])[0]
    assert faster is not None and faster.layout.name == "data"  # 20 % faster: not enough
    picked, why = layouts.pick([even[0], replace(even[1], step_s=0.7), *even[2:]])
    assert picked is not None and picked.layout == pipeline.layout
    assert why == (f"{pipeline.layout.name} is the fastest that fits: 0.70 s a step against data "
                   "parallelism's 1.00")
    free = {"node1": 8 * GB, "node2": 8 * GB, "node3": 8 * GB}
    small, _ = planned(cluster_of(THREE), free)
    timed = [replace(f, step_s=2.0 - i * 0.1) for i, f in enumerate(small)]
    picked, why = layouts.pick(timed)
    fastest = min((f for f in timed if f.fits), key=lambda f: f.step_s or 0)
    assert picked == fastest and why.endswith(f"is the fastest that does ({fastest.step_s:.2f} s a step)")


def test_nothing_fits_a_mac_smaller_than_a_stage():
    fits, _ = planned(cluster_of(THREE), dict.fromkeys(THREE, 2 * GB))
    assert layouts.pick(fits) == (None, "no layout fits every node's memory")


def test_the_largest_batch_and_longest_sequence_a_layout_fits_are_found_at_their_edge():
    cluster, free = cluster_of(THREE), dict.fromkeys(THREE, 16 * GB)
    data = Layout("data", (3, 3, 2))
    batch, length = layouts.limits(cluster, JOB, data, free, 65536)
    assert batch is not None and length is not None
    def fits(size: int) -> bool:
        layout = replace(data, shares=_split(size))
        return layouts.fit(cluster, replace(JOB, batch_size=size), layout, free).fits

    assert fits(batch) and not fits(batch + 1)
    assert layouts.fit(cluster, replace(JOB, length=length), data, free).fits
    assert not layouts.fit(cluster, replace(JOB, length=length + 32), data, free).fits
    assert layouts.largest(lambda n: n <= 37, 1, 100) == 37 and layouts.largest(lambda n: False, 1, 9) is None


def _split(batch: int) -> tuple[int, ...]:
    from training.data import shares

    return tuple(shares.split(batch, [3, 3, 2]))
