"""The ssh_mesh role's known_hosts block (mlxcluster.describe.known_hosts), as the role's filter builds it."""

from __future__ import annotations

from mlxcluster.describe.known_hosts import block_lines, pinned

MARKER = "# {mark} mlx-cluster ssh_mesh: the cluster nodes' host keys"
BEGIN, END = MARKER.replace("{mark}", "BEGIN"), MARKER.replace("{mark}", "END")
KEY1, KEY2, KEY3 = "ssh-ed25519 AAAA1", "ssh-ed25519 AAAA2", "ssh-ed25519 AAAA3"


def lines_of(names: list[str], key: str) -> list[str]:
    return [f"{name} {key}" for name in names]


def test_the_block_is_read_between_its_markers_only():
    text = "\n".join(["old ssh-rsa X", BEGIN, "node1 " + KEY1, END, "later ssh-rsa Y"])
    assert block_lines(text, BEGIN, END) == ["node1 " + KEY1]
    assert block_lines("node1 " + KEY1, BEGIN, END) == []
    assert block_lines(f"{BEGIN}\nnode1 {KEY1}", BEGIN, END) == []  # no end: not ours


def test_every_node_of_the_run_in_inventory_order_with_sorted_names():
    fresh = {"node2": lines_of(["node2", "10.0.0.2"], KEY2),
             "node1": lines_of(["node1", "10.0.0.1", "mac1"], KEY1)}
    out = pinned(["node1", "node2"], fresh, {}, [])
    assert out == sorted(fresh["node1"]) + sorted(fresh["node2"])
    # The same nodes in another order of names give the same block: no change on re-runs.
    shuffled = {host: list(reversed(lines)) for host, lines in fresh.items()}
    assert pinned(["node1", "node2"], shuffled, {}, []) == out


def test_a_node_away_keeps_its_lines_under_all_its_names():
    previous = (lines_of(["10.0.0.1", "node1"], KEY1) + lines_of(["10.0.0.3", "node3"], KEY3)
                + lines_of(["node3-hostname"], KEY3))
    fresh = {"node1": lines_of(["node1", "10.0.0.1"], KEY1)}
    out = pinned(["node1", "node3"], fresh, {"node3": ["node3", "10.0.0.3"]}, previous)
    # node3's lines, its facts-only name too (found by its host key), in the previous order.
    assert out == sorted(fresh["node1"]) + lines_of(["10.0.0.3", "node3", "node3-hostname"], KEY3)


def test_a_node_away_loses_a_name_a_present_node_now_claims():
    previous = lines_of(["node3", "shared-name"], KEY3)
    fresh = {"node1": lines_of(["node1", "shared-name"], KEY1)}
    out = pinned(["node1", "node3"], fresh, {"node3": ["node3"]}, previous)
    assert "shared-name " + KEY3 not in out and "node3 " + KEY3 in out


def test_a_node_taken_out_of_the_inventory_is_dropped():
    previous = lines_of(["node1"], KEY1) + lines_of(["gone"], KEY3)
    fresh = {"node1": lines_of(["node1"], KEY1)}
    assert pinned(["node1"], fresh, {}, previous) == ["node1 " + KEY1]


def test_malformed_previous_lines_are_ignored():
    previous = ["node3", "", "node3 " + KEY3]
    assert pinned(["node3"], {}, {"node3": ["node3"]}, previous) == ["node3 " + KEY3]


def test_only_the_keys_authorized_keys_lacks_are_added_whatever_its_options_and_comments():
    from mlxcluster.describe.known_hosts import missing_keys
    authorized = "\n".join([
        "# a comment line",
        'from="10.0.0.0/8",no-pty ssh-ed25519 AAAA1 someone@else',
        "ssh-ed25519 AAAA2 node2-old-comment",
        "ecdsa-sha2-nistp256 AAAA9 controller",
        ""])
    keys = [f"{KEY1} root@node1", f"{KEY2} root@node2", f"{KEY3} root@node3"]
    assert missing_keys(keys, authorized) == [f"{KEY3} root@node3"]
    assert missing_keys(keys, "") == keys
    assert missing_keys(keys, authorized + f"{KEY3} x\n") == []
