"""The values of `invoke` flags, as invoke hands them over (text), read into what the tasks take;
and the help of the flags several tasks share (`helps`).

A value that cannot be read is a UserError of one line that names the flag, the value and what to
give instead, never a traceback: `--iters many` says `--iters many: give a whole number of at
least 1`.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Sequence
from typing import Any

from mlxcluster.describe.topology import INTERFACE_NAME
from mlxcluster.errors import UserError

# Far above any run (a step count, a thread count) and far below what would overflow a C int.
MAX_WHOLE = 2**31 - 1


def whole_number(value: Any, flag: str, minimum: int = 1, maximum: int = MAX_WHOLE) -> int | None:
    """`value` as a whole number in [minimum, maximum]; None when not given."""
    if value is None or value == "":
        return None
    text = str(value).strip()
    if isinstance(value, bool) or not text.isascii() or not text.isdigit() or len(text) > 12:
        raise UserError(f"{flag} {value!r}: give a whole number of at least {minimum}")
    number = int(text)
    if not minimum <= number <= maximum:
        raise UserError(f"{flag} {value!r}: give a whole number from {minimum} to {maximum}")
    return number


def whole_numbers(value: Any, flag: str, minimum: int = 1, maximum: int = MAX_WHOLE) -> list[int] | None:
    """Comma-separated whole numbers ("2,4,8"), each in [minimum, maximum]; None when not given."""
    if value is None or value == "":
        return None
    try:
        numbers = [whole_number(part, flag, minimum, maximum) for part in str(value).split(",")]
    except UserError:
        numbers = [None]
    if None in numbers:  # an empty part: "2,,4"
        raise UserError(f"{flag} {value!r}: give whole numbers from {minimum} to {maximum}, "
                        "separated by commas (e.g. 2,4,8)")
    return [n for n in numbers if n is not None]


def one_of(value: Any, flag: str, choices: Sequence[str]) -> str | None:
    """`value` if it is one of `choices`; None when not given."""
    if value is None or value == "":
        return None
    if value not in choices:
        raise UserError(f"{flag} {value!r}: give one of {', '.join(choices)}")
    return str(value)


def interface(value: Any, flag: str = "--interface") -> str | None:
    """Where MPI's traffic is pinned: interface names or networks (CIDR), comma-separated, as
    Open MPI's btl_tcp_if_include takes them; None when not given."""
    if value is None or value == "":
        return None
    text = str(value)
    for part in text.split(","):
        try:
            ipaddress.ip_address(part)
        except ValueError:
            pass
        else:
            raise UserError(f"{flag} {value!r}: {part} is an address; give its network, e.g. {part}/24")
        if "/" not in part and INTERFACE_NAME.fullmatch(part):
            continue
        try:
            ipaddress.ip_network(part, strict=False)
        except ValueError:
            raise UserError(f"{flag} {value!r}: give an interface name (like bridge0 or en2: at most 15 "
                            "letters, digits and . _ - : @) or a network such as 192.168.200.0/24, "
                            "several separated by commas") from None
    return text


def number(value: Any, flag: str, minimum: float, maximum: float) -> float | None:
    """`value` as a finite number in [minimum, maximum]; None when not given."""
    if value is None or value == "":
        return None
    try:
        read = float(str(value).strip()) if not isinstance(value, bool) else math.nan
    except ValueError:
        read = math.nan
    if not (math.isfinite(read) and minimum <= read <= maximum):
        raise UserError(f"{flag} {value!r}: give a number from {minimum:g} to {maximum:g}")
    return read


# The options several tasks share, said once; a task adds its own with `helps`.
SHARED_HELP = {
    "inventory": "Inventory file (default: cluster.inventory in invoke.yaml, the local machine)",
    "data": "Prepared data directory (default: the bundled pirate demo, prepared on first use)",
    "model": "Model directory on the controller (default: SmolLM2-135M, fetched on first use)",
    "config": "YAML training config (default training/configs/lora.yaml); flags win over it",
    "extra": "More training flags, e.g. \"--learning-rate 2e-4 --num-layers 4\"",
    "threads": "BLAS threads per rank (default: all cores, or 1 when a node has several slots)",
    "interface": "Interface MPI traffic is pinned to (default: the Thunderbolt interface)",
    "iters": "Steps of each run (default 30)",
    "nodes": "Node counts to run on, comma-separated (default: 1 and all of them, e.g. 1,3)",
    "batch_size": "Global batch (default: the smallest multiple of every configuration's ranks "
                  "that is at least 4)",
    "id": "Lab number 0-9 (default: lab.id in invoke.yaml)",
    "lab": "Lab number (default 8)",
    "output": "JSON file to write (default runs/bench/<benchmark>-<time>.json; a PNG goes next to it)",
    "dry_run": "Print every command and touch no host",
}


def helps(*shared: str, **own: str) -> dict[str, str]:
    """A task's help: the shared options it takes, by name, and its own."""
    return {name: SHARED_HELP[name] for name in shared} | own
