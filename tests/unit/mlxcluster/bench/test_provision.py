"""bench.provision's arithmetic: where a run's time went by role, and how times grow with nodes."""

from __future__ import annotations

from mlxcluster.bench import provision


def test_a_runs_time_is_summed_by_role_with_a_plays_own_tasks_as_play():
    profile = [("hostfile : Install the hostfiles", 9.0), ("Gathering Facts", 3.0),
               ("hostfile : Render", 1.0), ("ssh_mesh : Pin host keys", 2.5)]
    assert provision.by_role(profile) == {"hostfile": 10.0, "play": 3.0, "ssh_mesh": 2.5}


def test_growth_is_the_time_ratio_over_the_node_ratio_and_targets_are_named():
    points = [{"nodes": 2, "second_run_s": 10.0}, {"nodes": 4, "second_run_s": 15.0},
              {"nodes": 8, "second_run_s": 40.0}]
    assert provision.growth(points, "second_run_s") == [
        {"from_nodes": 2, "to_nodes": 4, "time_ratio": 1.5, "node_ratio": 2.0, "growth": 0.75},
        {"from_nodes": 4, "to_nodes": 8, "time_ratio": 2.667, "node_ratio": 2.0, "growth": 1.333}]
    assert provision.targets_missed(points) == ["8 nodes: a second run took 40.0 s, the aim is 30 s"]
