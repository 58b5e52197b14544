"""The lab's point-to-point cables (mlxcluster/lab/veth.py): which ports each cabling uses, and
that the inventory it gives is one `links` mode accepts with the backends that cabling carries."""

from __future__ import annotations

import pytest

from mlxcluster.describe import topology
from mlxcluster.lab import veth


def test_a_ring_of_three_uses_two_ports_a_node_in_cable_order():
    assert veth.inventory_links(veth.cabling([1, 2, 3], "ring")) == [
        ["node1:en2", "node2:en2"], ["node2:en3", "node3:en2"], ["node3:en3", "node1:en3"]]
    assert veth.inventory_links(veth.cabling([1, 2], "ring")) == [["node1:en2", "node2:en2"]]


@pytest.mark.parametrize("count", [2, 3, 4, 5])
@pytest.mark.parametrize("kind", ["ring", "mesh"])
def test_each_cabling_carries_the_backends_it_should(count, kind):
    hosts = [f"node{i}" for i in range(1, count + 1)]
    links = veth.inventory_links(veth.cabling(list(range(1, count + 1)), kind))
    found, errors = topology.cables(links, "10.78.9.0/24", hosts)
    assert errors == []
    assert topology.backend_problem("ring", hosts, found) is None
    mesh = kind == "mesh" or count <= 3
    assert (topology.backend_problem("jaccl", hosts, found) is None) == mesh


def test_an_unknown_cabling_is_refused():
    with pytest.raises(ValueError, match="--cables must be one of ring, mesh"):
        veth.pairs([1, 2], "star")
