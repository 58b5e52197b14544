"""Checks on a cluster inventory, run on the controller before anything changes.

The playbook ``playbooks/validate.yml`` calls :func:`inventory_errors` through the
``cluster_inventory_errors`` filter; ``invoke`` tasks call it directly. The thunderbolt
role checks the link settings its nodes resolved with the same rules,
:func:`link_errors`, through the ``cluster_link_errors`` filter. Every message names
the host and says what to change in the inventory.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jinja2 import Undefined

from mlxcluster.describe import topology
from mlxcluster.describe.topology import INTERFACE_NAME

PLATFORM_GROUPS = ("macs", "linux")
# The thunderbolt role's defaults, for hosts whose inventory does not set them.
DEFAULT_PREFIX = 24
DEFAULT_MTU = 1500
# From the 576 bytes every IPv4 host must accept (RFC 791) to Linux loopback's 65536.
MIN_MTU = 576
MAX_MTU = 65536
# Ranks on one machine: far above any Mac's cores, far below what would make rendering hang.
MAX_SLOTS = 1024
# cluster_root goes into shell lines and rsync's remote paths (old rsync, as macOS ships, hands
# those to the remote shell): plain path characters only.
SAFE_PATH = re.compile(r"/[A-Za-z0-9._+@=,/-]*")
# Folders that hold other things: the cluster's files (rsync --delete included) need their own.
SHARED_FOLDERS = re.compile(r"/|/(root|home|Users|var|opt|usr|etc|tmp|srv)|/(home|Users)/[^/]+|/var/root")


def cluster_root_error(host: str, value: Any) -> str | None:
    """What is wrong with a node's cluster_root (None: fine), saying what to set instead."""
    fix = ("set cluster_root to an absolute folder of the cluster's own, such as "
           "/opt/mlx-cluster (letters, digits and . _ - + @ = , only)")
    if not isinstance(value, str) or not SAFE_PATH.fullmatch(value):
        return f"{host}: cluster_root {value!r} is not an absolute path of plain characters; {fix}"
    normal = "/" + "/".join(part for part in value.split("/") if part not in ("", "."))
    if ".." in normal.split("/"):
        return f"{host}: cluster_root {value!r} climbs with '..'; {fix}"
    if SHARED_FOLDERS.fullmatch(normal):
        return f"{host}: cluster_root {value!r} is a folder that holds other things; {fix}"
    return None


# Inventory names end up in /etc/hosts, known_hosts and ssh command lines: DNS names only.
DNS_NAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                      r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


def connection_errors(host: str, hv: Mapping[str, Any]) -> list[str]:
    """A host's name and its ssh destination (ansible_host, ansible_user) as ssh and /etc/hosts
    take them: a value starting with '-' would be read as an ssh option."""
    errors = []
    if not DNS_NAME.fullmatch(host):
        errors.append(f"{host!r}: not a valid host name: use letters, digits, '-' and '.' only "
                      "(a DNS name, such as mac1 or mac1.local)")
    for key in ("ansible_host", "ansible_user"):
        value = hv.get(key)
        if value is not None and (not isinstance(value, str) or not value
                                  or value.startswith("-") or any(c.isspace() for c in value)
                                  or not value.isprintable()):
            errors.append(f"{host}: {key} {value!r} cannot be an ssh destination (it is empty, "
                          f"starts with '-' or has spaces); set {key} to the machine's address or "
                          "account name")
    return errors


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"[0-9]+", value.strip()):  # not "²": isdigit() says yes
        return int(value)
    return None


def slots_of(host_vars: Mapping[str, Any]) -> int:
    """MPI slots of a host (1 when the inventory does not say); raises on a bad value."""
    value = host_vars.get("mpi_slots", 1)
    slots = _as_int(value)
    if slots is None or not 0 <= slots <= MAX_SLOTS:
        raise ValueError(f"mpi_slots must be a whole number from 0 to {MAX_SLOTS}, got {value!r}")
    return slots


def _node_link(host: str, hv: Mapping[str, Any]
               ) -> tuple[list[str], int | None, ipaddress.IPv4Interface | None]:
    """One node's own link settings: what is wrong with them, its MTU and its address (None
    where unusable)."""
    errors: list[str] = []
    iface = hv.get("thunderbolt_interface")
    if not iface or not isinstance(iface, str):
        errors.append(f"{host}: no thunderbolt_interface: set the name of its Thunderbolt "
                      "bridge interface (bridge0 on macOS)")
    elif not INTERFACE_NAME.fullmatch(iface):
        errors.append(f"{host}: thunderbolt_interface {iface!r} is not an interface name (at most 15 "
                      "letters, digits and . _ - : @, like bridge0 or thunderbolt0)")
    mtu, problems = _mtu(host, hv)
    errors += problems
    raw_ip = hv.get("thunderbolt_ip")
    if raw_ip in (None, ""):
        errors.append(f"{host}: no thunderbolt_ip: set thunderbolt_ip: <its address on the "
                      f"Thunderbolt bridge> under {host} in the inventory")
        return errors, mtu, None
    prefix = _as_int(hv.get("thunderbolt_prefix", DEFAULT_PREFIX))
    if prefix is None or not 8 <= prefix <= 32:
        errors.append(f"{host}: thunderbolt_prefix {hv.get('thunderbolt_prefix')!r} is not a "
                      "prefix length between 8 and 32")
        return errors, mtu, None
    try:
        address = ipaddress.IPv4Interface(f"{ipaddress.IPv4Address(str(raw_ip))}/{prefix}")
    except ipaddress.AddressValueError:
        errors.append(f"{host}: thunderbolt_ip {raw_ip!r} is not an IPv4 address "
                      "(write it like 192.168.200.1)")
        return errors, mtu, None
    if address.ip.is_multicast or address.ip.is_unspecified or address.ip.is_reserved:
        errors.append(f"{host}: thunderbolt_ip {address.ip} is a multicast, unspecified or reserved "
                      "address; use a private one such as 192.168.200.1")
        return errors, mtu, None
    network = address.network
    if prefix < 31 and address.ip in (network.network_address, network.broadcast_address):
        errors.append(f"{host}: thunderbolt_ip {address.ip} is the network or broadcast address of "
                      f"{network}; pick a host address inside it")
    return errors, mtu, address


def link_errors(hostvars: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Return what is wrong with the nodes' Thunderbolt link settings (empty when fine).

    Each node's own settings (``thunderbolt_interface``, ``thunderbolt_ip``,
    ``thunderbolt_prefix``, ``thunderbolt_mtu``), then whether they make one link:
    distinct addresses, one subnet, one MTU. :func:`inventory_errors` applies them to the
    inventory; the thunderbolt role (``cluster_link_errors`` filter) to the values its
    nodes resolved, role defaults included.
    """
    errors: list[str] = []
    networks: dict[str, ipaddress.IPv4Network] = {}
    owner_of_ip: dict[ipaddress.IPv4Address, str] = {}
    mtus: dict[str, int] = {}
    for host, hv in hostvars.items():
        own_errors, mtu, address = _node_link(host, hv)
        errors += own_errors
        if mtu is not None:
            mtus[host] = mtu
        if address is None:
            continue
        if address.ip in owner_of_ip:
            errors.append(f"thunderbolt_ip {address.ip} is used by both {owner_of_ip[address.ip]} "
                          f"and {host}: give each host its own address")
        else:
            owner_of_ip[address.ip] = host
        networks[host] = address.network

    # Loopback is the link of a cluster that is this one machine; across machines it reaches none.
    all_local = all(hv.get("ansible_connection") == "local" for hv in hostvars.values())
    looped = [host for ip, host in owner_of_ip.items() if ip.is_loopback]
    if len(hostvars) > 1 and looped and not all_local:
        errors.append(f"thunderbolt_ip of {', '.join(looped)} is a loopback address, which reaches "
                      "no other machine: give every node its address on the Thunderbolt bridge")
    by_network = _hosts_by_value(networks)
    if len(by_network) > 1:
        detail = "; ".join(f"{net}: {', '.join(hosts)}" for net, hosts in by_network.items())
        errors.append(f"the thunderbolt IPs are not in one subnet ({detail}): put every node "
                      "in one subnet (or fix thunderbolt_prefix)")
    return errors + _same_mtu(mtus)


def _mtu(host: str, hv: Mapping[str, Any]) -> tuple[int | None, list[str]]:
    raw = hv.get("thunderbolt_mtu", DEFAULT_MTU)
    mtu = _as_int(raw)
    if mtu is None or not MIN_MTU <= mtu <= MAX_MTU:
        return None, [f"{host}: thunderbolt_mtu {raw!r} is not an MTU between {MIN_MTU} and "
                      f"{MAX_MTU}; set thunderbolt_mtu: {DEFAULT_MTU} (9000 for jumbo frames) for "
                      "the whole cluster"]
    return mtu, []


def _same_mtu(mtus: Mapping[str, int]) -> list[str]:
    by_mtu = _hosts_by_value(mtus)
    if len(by_mtu) < 2:
        return []
    detail = "; ".join(f"{mtu}: {', '.join(hosts)}" for mtu, hosts in by_mtu.items())
    return [f"thunderbolt_mtu differs between the nodes ({detail}): every node on the link needs "
            "the same MTU; set it once for the whole cluster"]


def links_mode_errors(hosts: Sequence[str], training: Sequence[str],
                      hostvars: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """`thunderbolt_topology: links`: the cables (mlxcluster/describe/topology.py) and one MTU."""
    errors = topology.links_errors(hosts, training, hostvars)
    mtus = {}
    for host in hosts:
        mtu, problems = _mtu(host, hostvars.get(host, {}))
        errors += problems
        if mtu is not None:
            mtus[host] = mtu
    return errors + _same_mtu(mtus)


def _hosts_by_value(value_of: Mapping[str, Any]) -> dict[str, list[str]]:
    by_value: dict[str, list[str]] = {}
    for host, value in value_of.items():
        by_value.setdefault(str(value), []).append(host)
    return by_value


def _cluster_link_errors(groups: Mapping[str, Sequence[str]], cluster: list[str],
                         hostvars: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The cluster link's problems: the cables in links mode, the one subnet on a bridge."""
    if topology.mode_of(cluster, hostvars) != "links":
        return [*topology.topology_errors(cluster, hostvars),
                *link_errors({host: hostvars.get(host, {}) for host in cluster})]
    return links_mode_errors(cluster, _ranked(groups, hostvars), hostvars)


def inventory_errors(groups: Mapping[str, Sequence[str]],
                     hostvars: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Return what is wrong with the inventory, one message per problem (empty when fine)."""
    errors: list[str] = []
    cluster = list(groups.get("cluster") or [])
    if not cluster:
        return ["the inventory has no hosts in group `cluster`: list every node under "
                "cluster: children: macs: (Apple Silicon) or linux: (Debian/Ubuntu)"]

    platforms = {name: set(groups.get(name) or []) for name in PLATFORM_GROUPS}
    total_slots = 0
    bad_slots = False
    for host in cluster:
        hv = hostvars.get(host, {})
        errors += connection_errors(host, hv)
        in_groups = [g for g in PLATFORM_GROUPS if host in platforms[g]]
        if not in_groups:
            errors.append(f"{host}: unknown OS family: it is in neither `macs` nor `linux`; "
                          "put it under macs: (macOS with Homebrew) or linux: (Debian/Ubuntu)")
        elif len(in_groups) > 1:
            errors.append(f"{host}: it is in both `macs` and `linux`; keep it in the one "
                          "that matches its OS")

        try:
            total_slots += slots_of(hv)
        except ValueError as exc:
            bad_slots = True
            errors.append(f"{host}: {exc}; set mpi_slots: <ranks on this machine> (0 keeps it "
                          "out of training)")

    errors += _cluster_link_errors(groups, cluster, hostvars)
    errors += cluster_share_errors(cluster, hostvars)
    errors += [e for host in cluster for key, read in ONE_NODE_SETTINGS
               if (e := setting_error(host, hostvars.get(host, {}), key, read))]

    launchers = list(groups.get("launcher") or [])
    if not launchers:
        errors.append("no host in group `launcher`: add exactly one node there (rank 0, where "
                      "mpirun starts)")
    elif len(launchers) > 1:
        errors.append(f"group `launcher` has {len(launchers)} hosts ({', '.join(launchers)}): "
                      "keep exactly one")
    else:
        launcher = launchers[0]
        if launcher not in cluster:
            errors.append(f"launcher {launcher} is not in group `cluster`: add it under "
                          "macs: or linux:")
        else:
            try:
                if slots_of(hostvars.get(launcher, {})) == 0:
                    errors.append(f"launcher {launcher} has mpi_slots: 0, but rank 0 runs there: "
                                  "give it at least 1 slot or make another node the launcher")
            except ValueError:
                pass  # already reported above
    if total_slots == 0 and not bad_slots:
        errors.append("the cluster has 0 MPI slots in total: give at least one host "
                      "mpi_slots: 1 or more")
    return errors


def training_hosts(groups: Mapping[str, Sequence[str]],
                   hostvars: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str, int]]:
    """(host, thunderbolt_ip, slots) in rank order: the launcher first, 0-slot hosts left out."""
    launcher = list(groups.get("launcher") or [])
    ordered = launcher + [h for h in groups.get("cluster") or [] if h not in launcher]
    return [(h, str(hostvars[h]["thunderbolt_ip"]), slots_of(hostvars[h]))
            for h in ordered if slots_of(hostvars[h]) > 0]


def _ranked(groups: Mapping[str, Sequence[str]], hostvars: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The hosts that train, the launcher first; hosts whose slots are unreadable left out (they
    are reported on their own)."""
    launcher = [h for h in groups.get("launcher") or [] if h in (groups.get("cluster") or [])][:1]
    ordered = launcher + [h for h in groups.get("cluster") or [] if h not in launcher]
    ranked = []
    for host in ordered:
        try:
            if slots_of(hostvars.get(host, {})) > 0:
                ranked.append(host)
        except ValueError:
            pass
    return ranked


# What Ansible resolves for the checks and the topology, per host.
LINK_KEYS = ("thunderbolt_ip", "thunderbolt_prefix", "thunderbolt_interface", "thunderbolt_mtu")
SHARE_KEYS = ("batch_share", "max_micro_batch")  # a node's weight in each global batch, its cap
MODEL_KEYS = ("model_dequantize",)  # whether its ranks dequantize a quantized model as they load it
STAGE_KEYS = ("pipeline_layers",)  # the layers each of its ranks holds in a pipeline-parallel run
TOPOLOGY_KEYS = ("thunderbolt_topology", "thunderbolt_links", "thunderbolt_link_pool", "cluster_backend")


def resolved(hosts: list[str], hostvars: Any, keys: tuple[str, ...]
              ) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The hosts' values of `keys` as plain data, and the ones that cannot be resolved, each
    said with its host."""
    unresolved: list[str] = []
    plain: dict[str, dict[str, Any]] = {}
    for host in hosts:
        if host not in hostvars:
            continue
        plain[host] = {}
        # Ansible works out all of a host's variables on every hostvars[host]: once per host.
        host_vars = hostvars[host]
        for key in keys:
            if key not in host_vars:
                continue
            try:
                value = host_vars[key]
                if isinstance(value, Undefined):
                    str(value)  # raises the undefined error, naming the variable
            except Exception as exc:  # whatever templating raised, said with the host
                unresolved.append(f"{host}: {key} cannot be resolved ({exc}); write it out in the "
                                  "inventory, or define what it refers to")
                continue
            plain[host][key] = value
    return plain, unresolved



def topology_view(hosts: Sequence[str], hostvars: Any) -> dict[str, dict[str, Any]]:
    """The hosts' link, topology, slots and management settings as plain data (what
    mlxcluster/describe/topology.py reads); values that cannot be resolved are left out."""
    plain, _ = resolved(list(hosts), hostvars, (*LINK_KEYS, *TOPOLOGY_KEYS, "mpi_slots", "ansible_host"))
    return plain


AUTO = "auto"  # batch_share: auto, the weights from invoke bench.calibrate


# --- batch shares: each node's weight and micro-batch cap ------------------------------------------


def share_value(raw: Any) -> float | str | None:
    """A node's batch_share as training takes it: a positive number, "auto", or None (not set); a
    ValueError says what is wrong."""
    if raw is None or raw == AUTO:
        return raw
    try:
        value = float(raw) if not isinstance(raw, bool) else math.nan
    except (TypeError, ValueError):
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"batch_share {raw!r} must be a positive number (its ranks' weight beside the "
                         "other nodes', e.g. 3 beside 1) or auto (from invoke bench.calibrate)")
    return value


def micro_batch_value(raw: Any) -> int:
    """A node's max_micro_batch: a whole number of examples, 0 (the default) for no limit."""
    if raw is None:
        return 0
    text = str(raw).strip()
    if isinstance(raw, bool) or not text.isdigit():
        raise ValueError(f"max_micro_batch {raw!r} must be a whole number of examples, at least 0 "
                         "(0: no limit)")
    return int(text)


def share_errors(host: str, hv: Mapping[str, Any]) -> list[str]:
    """What is wrong with a node's batch_share and max_micro_batch, each said with its fix."""
    errors = []
    for read, key in ((share_value, "batch_share"), (micro_batch_value, "max_micro_batch")):
        try:
            read(hv.get(key))
        except ValueError as error:
            errors.append(f"{host}: {error}")
    return errors


def cluster_share_errors(hosts: Sequence[str], hostvars: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Every node's errors, and auto beside numbers: a calibration's tokens/s and a weight set by
    hand are not on one scale."""
    errors = [e for host in hosts for e in share_errors(host, hostvars.get(host, {}))]
    if errors:
        return errors
    given = {h: share_value(hostvars.get(h, {}).get("batch_share")) for h in hosts}
    auto = sorted(h for h, v in given.items() if v == AUTO)
    numbers = sorted(h for h, v in given.items() if v not in (None, AUTO))
    if auto and numbers:
        errors.append(f"batch_share is auto on {', '.join(auto)} but a number on {', '.join(numbers)}: "
                      "use auto on every node (weights from the calibration) or numbers on every node")
    return errors


# --- the model: a node's ranks dequantize a quantized model as they load it -------------------------


def dequantize_value(raw: Any) -> bool:
    """A node's model_dequantize: true or false (false when not set; `-e` gives the words as
    strings); a ValueError says what to set."""
    if raw is None or isinstance(raw, bool):
        return bool(raw)
    if isinstance(raw, str) and raw.strip().lower() in ("true", "false"):
        return raw.strip().lower() == "true"
    raise ValueError(f"model_dequantize {raw!r} must be true or false (true: this node's ranks "
                     "dequantize a quantized model as they load it, trading memory for speed; false, "
                     "the default: they train on its quantized weights)")


def setting_error(host: str, hv: Mapping[str, Any], key: str, read: Callable[[Any], Any]) -> str | None:
    """What is wrong with a node's `key` as `read` takes it (a ValueError says what), said with
    the host (None: fine)."""
    try:
        read(hv.get(key))
    except ValueError as error:
        return f"{host}: {error}"
    return None


# --- pipeline stages: the layers each of a node's ranks holds ----------------------------------------


def stage_layers_value(raw: Any) -> int:
    """A node's pipeline_layers: a whole number of layers, at least 1, for each of its ranks; 0
    when not set (its stages are sized from its memory: mlxcluster/launch/stages.py). Whether they
    add up to a model's layers is known once the run's model is: the run says so."""
    if raw is None:
        return 0
    text = str(raw).strip()
    if isinstance(raw, bool) or not text.isdigit() or int(text) < 1:
        raise ValueError(f"pipeline_layers {raw!r} must be a whole number of layers, at least 1 (each "
                         "of this node's ranks holds that many in a pipeline-parallel run); leave it "
                         "out to size its stages from the node's memory")
    return int(text)


# The settings each node has on its own, checked one node at a time: the key and its reader.
ONE_NODE_SETTINGS = (("model_dequantize", dequantize_value), ("pipeline_layers", stage_layers_value))
