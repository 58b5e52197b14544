#!/usr/bin/python3
"""Recording stand-ins for the macOS tools the roles' Darwin branches call.

One script, installed on a lab node under each tool's name (symlinks): ``brew``,
``networksetup``, ``pmset``, ``sysctl`` (``iogpu.*`` keys only), ``plutil``, ``dscl``, and from
macos_hardware.py beside it ``ifconfig`` (macOS's ``-l`` and ``ifconfig <interface>``),
``system_profiler`` (``SPThunderboltDataType -json``), ``sw_vers``, and RDMA's ``ibv_devices``
and ``rdma_ctl``.
Each invocation is appended as one JSON line to the call log, with the argv, the
user it ran as and the exit status; queries are answered from a small JSON state
file, and changes update it. The state starts as a fresh Apple Silicon Mac:
nothing installed with Homebrew, the Thunderbolt Bridge on DHCP, sleep after
1 minute, the default GPU wired-memory limit.

Like the real tools, the stand-ins refuse what the real ones refuse: brew run as
root, and changes to network, power or kernel settings without root. That is what
makes the contract catch a missing ``become`` (or a ``become`` too many).

One side effect is real: an address or MTU set with networksetup is also applied to the
node's own interface of that name (bridge0 on the lab's isolated link, or a cable's port en2,
en3... in links mode), so that a role's own check across the link (ping) runs for real.

This proves what the roles ask macOS to do, not that macOS does it: the answers
mimic the real tools' output formats as documented and seen in public scripts.
It runs on the node's /usr/bin/python3 with the standard library only.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import plistlib
import pwd
import shutil
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import macos_hardware  # beside this file (sys.path[0] is the real file's folder)

ROOT = Path(os.environ.get("MLX_CONTRACT_ROOT", "/opt/mlx-contract"))
STATE = ROOT / "state.json"
LOG = ROOT / "calls.jsonl"
LOCK = ROOT / "lock"
BREW_PREFIX = Path("/opt/homebrew")

State = dict[str, Any]


class ToolExit(Exception):
    """End the tool with an exit status, after printing ``message`` to stderr."""

    def __init__(self, status: int, message: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# Formulae the roles may install, with what each puts under the Homebrew prefix.
FORMULAE: dict[str, dict[str, Any]] = {
    "open-mpi": {"version": "5.0.8", "aliases": ["openmpi"], "bin": {
        "mpirun": "#!/bin/sh\n"
                  "echo 'mpirun (Open MPI) 5.0.8'\necho\n"
                  "echo 'Report bugs to https://www.open-mpi.org/community/help/'\n",
    }},
    # The Linux node's Python stands in for Homebrew's: the venv and pip steps after
    # `brew install python@3.x` then run for real (with the node's Python version).
    **{f"python@3.{minor}": {"version": f"3.{minor}.{patch}", "aliases": [],
                             "bin": {f"python3.{minor}": Path("/usr/bin/python3")}}
       for minor, patch in ((11, 13), (12, 11), (13, 5))},
}


@contextlib.contextmanager
def locked_state() -> Iterator[State]:
    """The state, locked against concurrent calls; saved when the block succeeds."""
    with LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        saved = json.loads(STATE.read_text()) if STATE.exists() else None
        state = json.loads(json.dumps(saved)) if saved is not None else macos_hardware.fresh_state()
        yield state
        if state == saved:
            return
        tmp = STATE.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.chmod(0o666)
        tmp.replace(STATE)


def out(text: str) -> None:
    sys.stdout.write(text if text.endswith("\n") or not text else text + "\n")


def require_root(message: str) -> None:
    if os.geteuid() != 0:
        raise ToolExit(1, message)


# --- brew -------------------------------------------------------------------------------

def _formula(name: str) -> tuple[str, dict[str, Any]]:
    bare = name.removeprefix("homebrew/core/")
    for formula, spec in FORMULAE.items():
        if bare == formula or bare in spec["aliases"]:
            return formula, spec
    raise ToolExit(1, f'Error: No available formula with the name "{name}".')


def _link_formula(formula: str, spec: dict[str, Any]) -> None:
    keg = BREW_PREFIX / "Cellar" / formula / spec["version"]
    (keg / "bin").mkdir(parents=True, exist_ok=True)
    for tool, content in spec["bin"].items():
        target = keg / "bin" / tool
        target.unlink(missing_ok=True)
        if isinstance(content, Path):
            target.symlink_to(content)
        else:
            target.write_text(content)
            target.chmod(0o755)
        link = BREW_PREFIX / "bin" / tool
        link.unlink(missing_ok=True)
        link.symlink_to(target)
    opt = BREW_PREFIX / "opt" / formula
    opt.parent.mkdir(parents=True, exist_ok=True)
    opt.unlink(missing_ok=True)
    opt.symlink_to(keg)


def brew(argv: list[str], state: State) -> int:
    if os.geteuid() == 0:
        raise ToolExit(1, "Error: Running Homebrew as root is extremely dangerous and no longer "
                          "supported.\nAs Homebrew does not drop privileges on installation you "
                          "would be giving all build scripts full access to your system.")
    installed: dict[str, str] = state["brew"]["installed"]
    command, args = (argv[0], argv[1:]) if argv else ("help", [])
    names = [a for a in args if not a.startswith("-")]
    if command == "--prefix":
        out(str(BREW_PREFIX / "opt" / _formula(names[0])[0]) if names else str(BREW_PREFIX))
    elif command == "--version":
        out("Homebrew 4.6.3")
    elif command == "info":
        if "--json=v2" not in args:
            raise ToolExit(1, "Error: the stand-in answers `brew info --json=v2` only")
        formulae = []
        for name in names:
            formula, spec = _formula(name)
            version = installed.get(formula)
            formulae.append({
                "name": formula, "full_name": formula, "tap": "homebrew/core",
                "aliases": spec["aliases"], "oldnames": [],
                "versions": {"stable": spec["version"]},
                "installed": [{"version": version}] if version else [],
                "linked_keg": version, "outdated": False,
            })
        out(json.dumps({"formulae": formulae, "casks": []}))
    elif command == "list":
        if "--versions" not in args:
            raise ToolExit(1, "Error: the stand-in answers `brew list --versions` only")
        for formula, version in sorted(installed.items()):
            if not names or formula in {_formula(n)[0] for n in names}:
                out(f"{formula} {version}")
        missing = any(_formula(n)[0] not in installed for n in names)
        return 1 if missing else 0
    elif command in ("install", "upgrade", "reinstall"):
        for name in names:
            formula, spec = _formula(name)
            if installed.get(formula) == spec["version"] and command == "install":
                print(f"Warning: {formula} {spec['version']} is already installed and "
                      "up-to-date.", file=sys.stderr)
                continue
            _link_formula(formula, spec)
            installed[formula] = spec["version"]
            out(f"==> Pouring {formula}--{spec['version']}.arm64_sequoia.bottle.tar.gz\n"
                f"/opt/homebrew/Cellar/{formula}/{spec['version']}: installed (stand-in)")
    elif command in ("uninstall", "remove", "rm"):
        for name in names:
            formula, _ = _formula(name)
            if installed.pop(formula, None) is None:
                raise ToolExit(1, f"Error: No such keg: /opt/homebrew/Cellar/{formula}")
    elif command in ("update", "link", "unlink"):
        out("Already up-to-date." if command == "update" else "")
    else:
        raise ToolExit(1, f"Error: Unknown command: {command} (not in the stand-in)")
    return 0


# --- networksetup -----------------------------------------------------------------------

def _service(state: State, name: str) -> dict[str, Any]:
    for service in state["network"]["services"]:
        if service["name"] == name:
            return service
    raise ToolExit(4, f"{name} is not a recognized network service.\n"
                      "** Error: The parameters were not valid.")


def _device(state: State, port_or_device: str) -> str:
    for port in state["network"]["hardware_ports"]:
        if port_or_device in (port["port"], port["device"]):
            return str(port["device"])
    raise ToolExit(4, f"Could not find hardware port or device named {port_or_device}.\n"
                      "** Error: The parameters were not valid.")


def _apply_to_link(device: str, *commands: list[str]) -> None:
    """Mirror a networksetup change on the node's own interface, when it has one."""
    ip = shutil.which("ip", path="/usr/sbin:/sbin:/usr/bin:/bin")
    if ip is None or not Path(f"/sys/class/net/{device}").exists():
        return
    for command in commands:
        subprocess.run([ip, *command], check=True, capture_output=True)


def _prefix(mask: str) -> int:
    return sum(bin(int(octet)).count("1") for octet in mask.split("."))


def _services(command: str, args: list[str], state: State) -> bool:
    """Services themselves: whether one is enabled, and making, enabling or removing one (False:
    not such a command)."""
    net = state["network"]
    if command == "-getnetworkserviceenabled" and len(args) == 1:
        out("Enabled" if _service(state, args[0])["enabled"] else "Disabled")
    elif command == "-setnetworkserviceenabled" and len(args) == 2:
        service = _service(state, args[0])
        service["enabled"] = args[1].lower() == "on"
        if not service["enabled"]:  # a disabled service's address is gone from its device
            _apply_to_link(service["device"], ["-4", "addr", "flush", "dev", service["device"]])
    elif command == "-createnetworkservice" and len(args) == 2:
        if any(service["name"] == args[0] for service in net["services"]):
            raise ToolExit(4, f"{args[0]} already exists.\n** Error: The parameters were not valid.")
        port = next((p for p in net["hardware_ports"] if p["port"] == args[1]), None)
        if port is None:
            raise ToolExit(4, f"{args[1]} is not a valid hardware port.\n"
                              "** Error: The parameters were not valid.")
        net["services"].append({**port, "name": args[0], "enabled": True, "config": {"mode": "DHCP"}})
    elif command == "-getadditionalroutes" and len(args) == 1:
        routes = _service(state, args[0]).get("routes", [])
        out("\n".join(" ".join(r) for r in routes) if routes
            else f"There are no additional IPv4 routes on {args[0]}.")
    elif command == "-setadditionalroutes" and len(args) >= 1 and len(args) % 3 == 1:
        service = _service(state, args[0])
        service["routes"] = [args[i:i + 3] for i in range(1, len(args), 3)]
        device = service["device"]
        _apply_to_link(device, *(["route", "replace", f"{to}/{_prefix(mask)}", "via", via, "dev", device]
                                 for to, mask, via in service["routes"]))
    elif command == "-removenetworkservice" and len(args) == 1:
        service = _service(state, args[0])
        net["services"].remove(service)
        _apply_to_link(service["device"], ["-4", "addr", "flush", "dev", service["device"]])
    else:
        return False
    return True


def networksetup(argv: list[str], state: State) -> int:
    if not argv:
        raise ToolExit(1, "Usage: networksetup -<command> <args>")
    command, args = argv[0], argv[1:]
    net = state["network"]
    if command.startswith("-set") or command in ("-createnetworkservice",
                                                 "-removenetworkservice"):
        require_root("** Error: Command requires admin privileges.")
    if command == "-listallnetworkservices":
        out("An asterisk (*) denotes that a network service is disabled.")
        for service in net["services"]:
            out(("" if service["enabled"] else "*") + service["name"])
    elif command == "-listallhardwareports":
        out("")
        for i, port in enumerate(net["hardware_ports"]):
            out(f"Hardware Port: {port['port']}\nDevice: {port['device']}\n"
                f"Ethernet Address: 36:a2:04:00:00:0{i}\n")
        out("VLAN Configurations\n===================")
    elif command == "-listnetworkserviceorder":
        out("An asterisk (*) denotes that a network service is disabled.")
        for i, service in enumerate(net["services"], 1):
            out(f"({i if service['enabled'] else '*'}) {service['name']}\n(Hardware Port: {service['port']}, "
                f"Device: {service['device']})\n")
    elif command == "-getinfo" and len(args) == 1:
        config = _service(state, args[0])["config"]
        if config["mode"] == "Manual":
            out(f"Manual Configuration\nIP address: {config['ip']}\n"
                f"Subnet mask: {config['mask']}\nRouter: {config.get('router') or '(null)'}")
        else:
            out("DHCP Configuration\nClient ID: ")
        out("IPv6: Automatic\nIPv6 IP address: none\nIPv6 Router: none")
    elif command == "-setmanual" and len(args) in (3, 4):
        service = _service(state, args[0])
        service["config"] = {"mode": "Manual", "ip": args[1], "mask": args[2],
                             "router": args[3] if len(args) == 4 else None}
        _apply_to_link(service["device"], ["-4", "addr", "flush", "dev", service["device"]],
                       ["addr", "add", f"{args[1]}/{_prefix(args[2])}", "dev", service["device"]],
                       ["link", "set", service["device"], "up"])
    elif command == "-setdhcp" and len(args) in (1, 2):
        service = _service(state, args[0])
        service["config"] = {"mode": "DHCP"}
        _apply_to_link(service["device"], ["-4", "addr", "flush", "dev", service["device"]])
    elif command == "-getMTU" and len(args) == 1:
        mtu = net["mtu"][_device(state, args[0])]
        out(f"Active MTU: {mtu} (Current Setting: {mtu})")
    elif command == "-listValidMTURange" and len(args) == 1:
        _device(state, args[0])
        out("Valid MTU Range: 1280-9000")
    elif command == "-setMTU" and len(args) == 2:
        if not args[1].isdigit() or not 1280 <= int(args[1]) <= 9000:
            raise ToolExit(4, f"{args[1]} is not a valid MTU.\n"
                              "** Error: The parameters were not valid.")
        device = _device(state, args[0])
        net["mtu"][device] = int(args[1])
        _apply_to_link(device, ["link", "set", device, "mtu", args[1]])
    elif not _services(command, args, state):
        raise ToolExit(4, f"{' '.join(argv)}: not handled by the stand-in.\n"
                          "** Error: The parameters were not valid.")
    return 0


# --- pmset ------------------------------------------------------------------------------

PMSET_FLAGS = {"-a": ("Battery Power", "AC Power", "UPS Power"), "-b": ("Battery Power",),
               "-c": ("AC Power",), "-u": ("UPS Power",)}
PMSET_SYSTEM_WIDE = {"disablesleep": "SleepDisabled"}


def _pmset_section(settings: dict[str, str], annotate: bool = False) -> None:
    for key, value in settings.items():
        # Real output often carries this note, which parsers must tolerate.
        note = " (sleep prevented by sharingd, powerd)" if annotate and key == "sleep" else ""
        out(f" {key:<20} {value}{note}")


def pmset(argv: list[str], state: State) -> int:
    pm = state["pmset"]
    if argv[:1] == ["-g"]:
        view = argv[1] if len(argv) > 1 else "live"
        if view == "custom":
            for source, settings in pm["sources"].items():
                out(f"{source}:")
                _pmset_section(settings)
        elif view == "live":
            out("System-wide power settings:")
            for key, value in pm["system"].items():
                out(f" {key}\t\t{value}")
            out("Currently in use:")
            _pmset_section(pm["sources"][pm["in_use"]], annotate=True)
        else:
            raise ToolExit(1, f"pmset -g {view}: not handled by the stand-in")
        return 0
    flag, pairs = (argv[0], argv[1:]) if argv[:1] and argv[0] in PMSET_FLAGS else ("-a", argv)
    if not pairs or len(pairs) % 2:
        raise ToolExit(1, f"Usage: pmset [-a|-b|-c|-u] setting value ...; got {argv}")
    require_root("pmset must be run as root in order to modify any settings")
    for key, value in zip(pairs[::2], pairs[1::2], strict=True):
        if not value.isdigit():
            raise ToolExit(1, f"Error: bad value {value!r} for {key}")
        if key in PMSET_SYSTEM_WIDE:
            pm["system"][PMSET_SYSTEM_WIDE[key]] = value
            continue
        known = [s for s in PMSET_FLAGS[flag] if s in pm["sources"]]
        if not any(key in pm["sources"][s] for s in known):
            raise ToolExit(1, f"Error: unknown setting {key!r} (not in the stand-in)")
        for source in known:
            pm["sources"][source][key] = value
    return 0


# --- sysctl (iogpu.* only) --------------------------------------------------------------

def sysctl(argv: list[str], state: State) -> int:
    values: dict[str, int] = state["sysctl"]
    names_only = "-n" in argv
    args = [a for a in argv if a not in ("-n", "-w")]
    if not args or any(a.startswith("-") for a in args):
        raise ToolExit(1, f"sysctl {' '.join(argv)}: not handled by the stand-in")
    for arg in args:
        name, sep, value = arg.partition("=")
        if name not in values:
            raise ToolExit(1, f"sysctl: unknown oid '{name}'")
        if not sep:
            out(str(values[name]) if names_only else f"{name}: {values[name]}")
            continue
        if os.geteuid() != 0:
            raise ToolExit(1, f"sysctl: {name}={value}: Operation not permitted")
        if not value.isdigit():
            raise ToolExit(1, f"sysctl: {name}: invalid integer '{value}'")
        old, values[name] = values[name], int(value)
        out(f"{name}: {old} -> {values[name]}")
    return 0


def real_sysctl(argv: list[str]) -> None:
    """Anything but iogpu.* goes to the node's own sysctl: the stand-in shadows nothing else."""
    for candidate in ("/usr/sbin/sysctl", "/sbin/sysctl"):
        if Path(candidate).resolve() != Path(__file__).resolve() and os.access(candidate, os.X_OK):
            os.execv(candidate, [candidate, *argv])
    raise ToolExit(127, "sysctl: no real sysctl on this node")


# --- plutil, dscl -----------------------------------------------------------------------

def plutil(argv: list[str], state: State) -> int:
    if argv[:1] != ["-lint"] or len(argv) < 2:
        raise ToolExit(1, f"plutil {' '.join(argv)}: the stand-in answers -lint only")
    status = 0
    for path in argv[1:]:
        try:
            with open(path, "rb") as handle:
                plistlib.load(handle)
            out(f"{path}: OK")
        except (OSError, plistlib.InvalidFileException, ValueError) as exc:
            out(f"{path}: {exc}")
            status = 1
    return status


def dscl(argv: list[str], state: State) -> int:
    if len(argv) != 4 or argv[:2] != [".", "-read"] or not argv[2].startswith("/Users/"):
        raise ToolExit(1, f"dscl {' '.join(argv)}: the stand-in answers `. -read /Users/<name>` only")
    try:
        entry = pwd.getpwnam(argv[2].removeprefix("/Users/"))
    except KeyError:
        raise ToolExit(56, "<dscl_cmd> DS Error: -14136 (eDSRecordNotFound)") from None
    fields = {"NFSHomeDirectory": entry.pw_dir, "UniqueID": str(entry.pw_uid),
              "PrimaryGroupID": str(entry.pw_gid), "UserShell": entry.pw_shell}
    if argv[3] not in fields:
        raise ToolExit(181, f"No such key: {argv[3]}")
    out(f"{argv[3]}: {fields[argv[3]]}")
    return 0


def _reader(function: Callable[[list[str], State, Path], str]) -> Callable[[list[str], State], int]:
    """A tool of macos_hardware.py, which returns what it prints."""
    def tool(argv: list[str], state: State) -> int:
        try:
            text = function(argv, state, ROOT)
        except macos_hardware.Refused as exc:
            raise ToolExit(exc.status, str(exc)) from None
        if text:
            out(text)
        return 0
    return tool


TOOLS: dict[str, Callable[[list[str], State], int]] = {
    "brew": brew, "networksetup": networksetup, "pmset": pmset, "sysctl": sysctl,
    "plutil": plutil, "dscl": dscl,
    **{name: _reader(function) for name, function in macos_hardware.READERS.items()},
}


def log(entry: dict[str, Any]) -> None:
    with LOG.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.write(json.dumps(entry) + "\n")


def main() -> int:
    tool = Path(sys.argv[0]).name
    argv = sys.argv[1:]
    entry: dict[str, Any] = {
        "tool": tool, "argv": argv, "uid": os.geteuid(),
        "user": pwd.getpwuid(os.geteuid()).pw_name,
        "run": os.environ.get("MLX_CONTRACT_RUN", ""),
    }
    if tool == "sysctl" and not any(a.split("=")[0].startswith("iogpu.") for a in argv):
        entry["passthrough"] = True
        log(entry)
        real_sysctl(argv)
    status = 0
    try:
        if tool not in TOOLS:
            raise ToolExit(127, f"{tool}: no such stand-in")
        with locked_state() as state:
            status = TOOLS[tool](argv, state)
    except ToolExit as exc:
        print(exc.message, file=sys.stderr)
        status = exc.status
    except Exception:
        # A stand-in bug must fail the contract, not pass as success.
        traceback.print_exc()
        status = 70
    finally:
        sys.stdout.flush()
        entry["rc"] = status
        log(entry)
    return status


if __name__ == "__main__":
    sys.exit(main())
