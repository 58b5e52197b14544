"""The macOS parsers against what real Macs printed: outputs published by others, kept verbatim in
tests/contract/fixtures/macos/ (each one's source in its SOURCES.md), read by our parsers and by
MLX's own configurator (`mlx.distributed_config`, mlx/_distributed_utils/config.py), which must agree.

The other tests feed the parsers outputs we wrote ourselves; these are what macOS prints, with its
quirks (a drive on a Thunderbolt port, Thunderbolt 5 speeds, addresses obfuscated by the people who
published them). A fixture added to that folder is tested here unchanged: every
`<mac>.system_profiler.json` (`system_profiler SPThunderboltDataType -json`, read with the same Mac's
`<mac>.hardware_ports.txt` where its source published one), every `<mac>.hardware_ports.txt`
(`networksetup -listallhardwareports`) and every `<mac>.ifconfig.txt` (`ifconfig -a`). A folder
holds one source; the Macs of a folder with several system_profiler outputs are one cluster, cabled
to each other, whose cables and hostfiles are compared with MLX's.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from mlx._distributed_utils import config as mlx_config
from mlx._distributed_utils.common import Host

from mlxcluster.check import cabling, probe
from mlxcluster.describe import topology
from tests.unit.mlxcluster.describe.test_topology import mlx_hostfile, mlx_inputs
from tests.unit.mlxcluster.describe.test_topology import ours as our_hostfile

FIXTURES = Path(__file__).resolve().parents[3] / "contract" / "fixtures" / "macos"


def fixtures(kind: str) -> list[Path]:
    return sorted(FIXTURES.rglob(f"*.{kind}"))


PROFILERS = fixtures("system_profiler.json")
HARDWARE = fixtures("hardware_ports.txt")
IFCONFIG = fixtures("ifconfig.txt")
CLUSTERS = sorted({p.parent for p in PROFILERS if len(list(p.parent.glob("*.system_profiler.json"))) > 1})


def ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(FIXTURES)) for p in paths]


def host_of(path: Path) -> str:
    return path.name.split(".")[0]


def hardware_text(profiler: Path) -> str:
    """The Mac's `networksetup -listallhardwareports` as its source published it. Where none was
    (SOURCES.md says which), a stand-in in its format naming only the Thunderbolt ports, as the
    real captures of the same families do: port n is en<n> on a MacBook, whose en0 is its Wi-Fi,
    and en<n+1> on a Mac with built-in Ethernet (en0) and Wi-Fi (en1). Both parsers read the same
    text, so the names only have to be consistent."""
    real = profiler.with_name(f"{host_of(profiler)}.hardware_ports.txt")
    if real.exists():
        return real.read_text()
    stanzas = []
    for bus in json.loads(profiler.read_text())["SPThunderboltDataType"]:
        tag = (bus.get("receptacle_1_tag") or {}).get("receptacle_id_key")
        if tag is not None:
            first = 1 if bus.get("device_name_key", "").startswith("MacBook") else 2
            stanzas.append(f"Hardware Port: Thunderbolt {tag}\nDevice: en{int(tag) + first - 1}\n")
    return "\n" + "\n".join(stanzas) + "\nVLAN Configurations\n===================\n"


def ours_read(paths: list[Path]) -> tuple[list[cabling.SeenPort], list[str]]:
    """Our reading of these Macs (what `invoke topology` does with their two outputs)."""
    hosts = [host_of(p) for p in paths]
    return [port for path, host in zip(paths, hosts, strict=True)
            for port in cabling.ports_seen(host, json.loads(path.read_text()), hardware_text(path))], hosts


def mlx_reads(paths: list[Path], monkeypatch: pytest.MonkeyPatch):
    """MLX's own reading of the same Macs (`extract_connectivity`), its ssh to each Mac answered
    with the fixtures: its ThunderboltHosts and its index of their ports by domain UUID."""
    outputs = {host_of(p): {"system_profiler": p.read_bytes(), "networksetup": hardware_text(p).encode()}
               for p in paths}

    def run(argv, **kwargs):
        assert argv[0] == "ssh" and argv[2] in ("system_profiler", "networksetup"), argv
        return SimpleNamespace(stdout=outputs[argv[1]][argv[2]], returncode=0)

    monkeypatch.setattr(mlx_config, "run", run)
    return mlx_config.extract_connectivity([Host(i, host_of(p), [], []) for i, p in enumerate(paths)],
                                           verbose=False)


def mlx_cables(hosts: list[str], tb_hosts, index) -> list[tuple[str, str]]:
    """Each port MLX sees plugged into one of the cluster's ports, as (port, peer port)."""
    return [(f"{hosts[i]}:{port.iface}", f"{hosts[j]}:{tb_hosts[j].ports[k].iface}")
            for i, th in enumerate(tb_hosts) for port in th.ports if port.connected_to in index
            for j, k in [index[port.connected_to]]]


def test_there_are_real_outputs_of_every_kind_and_a_cluster():
    assert PROFILERS and HARDWARE and IFCONFIG and CLUSTERS
    assert (FIXTURES / "SOURCES.md").is_file()
    sources = (FIXTURES / "SOURCES.md").read_text()
    unlisted = [name for name in ids([*PROFILERS, *HARDWARE, *IFCONFIG]) if name not in sources]
    assert unlisted == [], "every fixture names its source in SOURCES.md"


@pytest.mark.parametrize("path", PROFILERS, ids=ids(PROFILERS))
def test_each_mac_has_the_ports_and_peers_mlx_reads(path, monkeypatch):
    ours, _ = ours_read([path])
    [theirs], _ = mlx_reads([path], monkeypatch)
    assert ours, "a Mac's system_profiler lists its Thunderbolt ports"
    assert [(p.interface, p.uuid, p.peer_uuid) for p in ours] == [
        (p.iface, p.uuid, p.connected_to) for p in theirs.ports]


@pytest.mark.parametrize("folder", CLUSTERS, ids=ids(CLUSTERS))
def test_a_cluster_has_the_cables_mlx_finds_and_its_block_validates(folder, monkeypatch):
    paths = sorted(folder.glob("*.system_profiler.json"))
    ports, hosts = ours_read(paths)
    links, notes = cabling.cables_seen(ports, hosts)
    tb_hosts, index = mlx_reads(paths, monkeypatch)
    theirs = mlx_cables(hosts, tb_hosts, index)
    # MLX sees each cable from both ends; we list it once.
    assert sorted(tuple(sorted(link)) for link in links) == sorted({tuple(sorted(c)) for c in theirs})
    assert len(theirs) == 2 * len(links)
    matrix = [[0] * len(hosts) for _ in hosts]
    for a, b in links:
        i, j = hosts.index(a.split(":")[0]), hosts.index(b.split(":")[0])
        matrix[i][j] += 1
        matrix[j][i] += 1
    assert matrix == mlx_config.make_connectivity_matrix(tb_hosts, index)
    # A port plugged into a Mac that is not in the folder is noted, and MLX leaves it out.
    strangers = [p for th in tb_hosts for p in th.ports if p.connected_to and p.connected_to not in index]
    assert len(notes) == len(strangers)
    pasted = yaml.safe_load(cabling.links_block(links, topology.DEFAULT_POOL))
    found, errors = topology.cables(pasted["thunderbolt_links"], pasted["thunderbolt_link_pool"], hosts)
    assert errors == [] and [str(cable) for cable in found] == [f"{a} <-> {b}" for a, b in links]


@pytest.mark.parametrize("folder", CLUSTERS, ids=ids(CLUSTERS))
@pytest.mark.parametrize("backend", ["ring", "jaccl", "jaccl-ring"])
def test_a_cluster_gets_mlx_own_hostfiles_or_both_refuse(folder, backend, tmp_path, monkeypatch):
    paths = sorted(folder.glob("*.system_profiler.json"))
    ports, hosts = ours_read(paths)
    links, _ = cabling.cables_seen(ports, hosts)
    # test_topology's helpers give MLX's configurator the cabling built from our cables: it must be
    # MLX's own reading of these Macs, port by port (the ports with no cable play no part).
    tb_hosts, index = mlx_reads(paths, monkeypatch)
    _, built, _ = mlx_inputs(hosts, links)
    assert [[(p.iface, p.connected_to) for p in th.ports] for th in built] == [
        [(a.split(":")[1], b) for a, b in mlx_cables(hosts, tb_hosts, index) if a.split(":")[0] == host]
        for host in hosts]
    assert our_hostfile(backend, hosts, links) == mlx_hostfile(backend, hosts, links, tmp_path, monkeypatch)


def test_the_tb5_pair_is_one_cable_and_the_drive_on_the_studio_is_none():
    """omlx-plus-tb5: the MacBook Pro's port 1 into the Mac Studio's port 2; the Studio's port 4
    holds an OWC Envoy Ultra drive, which has no Thunderbolt domain of its own to be cabled to."""
    ports, hosts = ours_read(sorted((FIXTURES / "omlx-plus-tb5").glob("*.system_profiler.json")))
    assert hosts == ["mac-studio-m3-ultra", "macbook-pro-m5-max"]
    assert cabling.cables_seen(ports, hosts) == ([["mac-studio-m3-ultra:en3", "macbook-pro-m5-max:en1"]], [])
    assert len(ports) == 9 and [p.interface for p in ports if p.peer_uuid] == ["en3", "en1"]


@pytest.mark.parametrize("path", HARDWARE, ids=ids(HARDWARE))
def test_each_hardware_ports_output_names_the_thunderbolt_ports_as_mlx_does(path):
    text = path.read_text()
    ours = {port: dev for port, dev in cabling.hardware_ports(text).items() if port.startswith("Thunderbolt")}
    theirs = {port: dev for port, dev in mlx_config.parse_hardware_ports(text.encode()).items()
              if port and port.startswith("Thunderbolt")}
    assert ours == theirs
    assert any(re.fullmatch(r"Thunderbolt \d+", port) for port in ours), "a Mac has Thunderbolt ports"
    # The thunderbolt role's macOS filter takes the same ports for cables, and only those.
    from filter_plugins.thunderbolt_macos import thunderbolt_macos_links

    taken = thunderbolt_macos_links([], text, "", "", "Thunderbolt Bridge", "MLX Thunderbolt ")
    assert sorted(taken["thunderbolt_ports"]) == sorted(
        f"{dev} ({port})" for port, dev in ours.items() if re.fullmatch(r"Thunderbolt \d+", port))


def interfaces(text: str) -> dict[str, str]:
    """`ifconfig -a` cut into what `ifconfig <name>` prints for each interface: the same stanza."""
    found: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        start = re.match(r"([A-Za-z0-9]+): flags=", line)
        if start:
            name = start.group(1)
            found[name] = ""
        if name is not None:
            found[name] += line + "\n"
    return found


def read_as_doctor(name: str, stanza: str, monkeypatch: pytest.MonkeyPatch) -> dict:
    """What the doctor's probe makes of `ifconfig <name>` on a Mac printing `stanza`."""
    def run(cmd, **kwargs):
        assert cmd == ["ifconfig", name]
        return 0, stanza.strip()  # as probe._run hands it over

    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(probe, "_run", run)
    return probe.interface(name)


@pytest.mark.parametrize("path", IFCONFIG, ids=ids(IFCONFIG))
def test_each_interface_reads_as_ifconfig_printed_it(path, monkeypatch):
    stanzas = interfaces(path.read_text())
    assert "lo0" in stanzas and "bridge0" in stanzas
    for name, stanza in stanzas.items():
        head = stanza.splitlines()[0]
        flags = re.search(r"<([^>]*)>", head).group(1).split(",")
        # A point-to-point address (`inet A --> B`, a VPN's utun) is not read: the doctor asks only
        # for the cluster's ports.
        addresses = [f"{words[1]}/{bin(int(words[3], 16)).count('1')}"
                     for words in (line.split() for line in stanza.splitlines())
                     if words[:1] == ["inet"] and words[2:3] == ["netmask"]]
        assert read_as_doctor(name, stanza, monkeypatch) == {
            "up": "UP" in flags, "mtu": int(re.search(r"mtu (\d+)", stanza).group(1)),
            "addresses": addresses, "loopback": "LOOPBACK" in flags}, name


@pytest.mark.parametrize("fixture, name, read", [
    ("glpi-agent/macbook-pro-16-apple-silicon-2021-macos-14.4.ifconfig.txt", "en0",
     {"up": True, "mtu": 1500, "addresses": ["192.168.2.46/24"], "loopback": False}),
    ("glpi-agent/macbook-pro-16-apple-silicon-2021-macos-14.4.ifconfig.txt", "bridge0",
     {"up": True, "mtu": 1500, "addresses": [], "loopback": False}),
    ("glpi-agent/macbook-pro-16-apple-silicon-2021-macos-14.4.ifconfig.txt", "lo0",
     {"up": True, "mtu": 16384, "addresses": ["127.0.0.1/8"], "loopback": True}),
    ("glpi-agent/macbook-pro-16-intel-2019-macos-10.15.ifconfig.txt", "en40",
     {"up": True, "mtu": 1500, "addresses": ["169.254.176.43/16"], "loopback": False}),
    ("glpi-agent/macbook-pro-16-intel-2019-macos-10.15.ifconfig.txt", "en37",
     {"up": False, "mtu": 1500, "addresses": [], "loopback": False}),
])
def test_the_doctor_reads_a_mac_s_interfaces(fixture, name, read, monkeypatch):
    stanza = interfaces((FIXTURES / fixture).read_text())[name]
    assert read_as_doctor(name, stanza, monkeypatch) == read
