"""The values of `invoke` flags, as invoke hands them over (text), read into what the tasks take;
each flag's help, default and reader said once (`Flag`, `Flags`, the shared ones in `SHARED`); and
`task`, the decorator of every task in tasks.py and bench_tasks.py, which reads the flags before the
task's body runs.

A value that cannot be read is a UserError of one line that names the flag, the value and what to
give instead, never a traceback: `--iters many` says `--iters many: give a whole number of at
least 1`. `task` turns every UserError into invoke's Exit with its message, in one place.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from invoke.context import Context
from invoke.exceptions import Exit
from invoke.tasks import Task as InvokeTask
from invoke.tasks import task as invoke_task

from mlxcluster import paths
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


def address(value: Any, flag: str) -> str | None:
    """An address to listen on: an IP address (v4 or v6; 0.0.0.0 or :: for all) or localhost; None
    when not given. A name other than localhost is refused: what it resolves to is not said here."""
    if value is None or value == "":
        return None
    text = str(value).strip()
    if text == "localhost":
        return text
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise UserError(f"{flag} {value!r}: give an IP address of the launcher (127.0.0.1, the default, "
                        "one of its own, or 0.0.0.0 for all of them)") from None


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


def some_of(value: Any, flag: str, choices: Sequence[str]) -> list[str] | None:
    """Comma-separated words, each one of `choices`; None when not given."""
    if value is None or value == "":
        return None
    words = str(value).split(",")
    if unknown := [w for w in words if w not in choices]:
        raise UserError(f"{flag} {value!r}: {', '.join(unknown)} unknown; give some of {', '.join(choices)}, "
                        "separated by commas")
    return words


# --- a flag said once: its help, its default, its reader -----------------------------------------

@dataclasses.dataclass(frozen=True)
class Flag:
    """One flag of a task: its help, the value it stands for when not given, and how its text is
    read (`read(value, "--flag")`; None: taken as given). `{default}` in the help is the default,
    so that the help says the value the task takes."""

    help: str
    default: Any = None
    read: Callable[[Any, str], Any] | None = None

    def with_default(self, default: Any) -> Flag:
        """The same flag standing for another value when not given (the help then says it)."""
        return dataclasses.replace(self, default=default)

    def help_text(self) -> str:
        default = self.default
        shown = (f"{default:g}" if isinstance(default, float) else
                 ",".join(map(str, default)) if isinstance(default, list | tuple) else str(default))
        return self.help.replace("{default}", shown)


def whole(help: str, default: int | None = None, minimum: int = 1, maximum: int = MAX_WHOLE) -> Flag:
    return Flag(help, default, partial(whole_number, minimum=minimum, maximum=maximum))


def wholes(help: str, default: Sequence[int] | None = None, minimum: int = 1,
           maximum: int = MAX_WHOLE) -> Flag:
    return Flag(help, default, partial(whole_numbers, minimum=minimum, maximum=maximum))


def real(help: str, default: float | None, minimum: float, maximum: float) -> Flag:
    return Flag(help, default, partial(number, minimum=minimum, maximum=maximum))


def choice(help: str, choices: Sequence[str], default: str | None = None) -> Flag:
    return Flag(help, default, partial(one_of, choices=choices))


def several(help: str, choices: Sequence[str]) -> Flag:
    """Some of `choices`, comma-separated; all of them when not given."""
    return Flag(help, tuple(choices), partial(some_of, choices=choices))


# The options several tasks share, said once; a task names them in its Flags (or `helps`).
SHARED = {
    "inventory": Flag("Inventory file (default: cluster.inventory in invoke.yaml, the local machine)"),
    "data": Flag("Prepared data directory (default: the bundled pirate demo, prepared on first use)"),
    "model": Flag("Model directory on the controller (default: SmolLM2-135M, fetched on first use)"),
    "config": Flag("YAML training config (default training/configs/lora.yaml); flags win over it"),
    "extra": Flag("More training flags, e.g. \"--learning-rate 2e-4 --num-layers 4\""),
    "threads": whole("BLAS threads per rank (default: all cores, or 1 when a node has several slots)",
                     maximum=1024),
    "interface": Flag("Interface MPI traffic is pinned to (default: the Thunderbolt interface)"),
    "iters": whole("Steps of each run (default {default})", 30),
    "nodes": Flag("Node counts to run on, comma-separated (default: 1 and all of them, e.g. 1,3)"),
    "batch_size": whole("Global batch (default: the smallest multiple of every configuration's ranks "
                        "that is at least 4)"),
    "id": Flag("Lab number 0-9 (default: lab.id in invoke.yaml)"),
    "lab": whole("Lab number (default {default})", 8, 0, 9),
    "output": Flag("JSON file to write (default runs/bench/<benchmark>-<time>.json; a PNG goes next to it)"),
    "dry_run": Flag("Print every command and touch no host"),
}
SHARED_HELP = {name: flag.help_text() for name, flag in SHARED.items()}


def helps(*shared: str, **own: str) -> dict[str, str]:
    """A task's help: the shared options it takes, by name, and its own."""
    return {name: SHARED_HELP[name] for name in shared} | own


class Flags:
    """A task's flags, each said once: the shared ones by name, its own as a Flag or a help text."""

    def __init__(self, *shared: str, **own: Flag | str) -> None:
        self.flags = {name: SHARED[name] for name in shared} | {
            name: flag if isinstance(flag, Flag) else Flag(flag) for name, flag in own.items()}

    @property
    def help(self) -> dict[str, str]:
        return {name: flag.help_text() for name, flag in self.flags.items()}

    def read(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """The task's arguments with each flag's text read (or refused: a UserError of one line)
        and a flag not given as its default."""
        values = dict(given)
        for name, flag in self.flags.items():
            value = given.get(name)
            if flag.read is not None:
                value = flag.read(value, "--" + name.replace("_", "-"))
            if name in given or flag.default is not None:
                values[name] = flag.default if value is None else value
        return values


class Task(InvokeTask):
    """A task whose flags are read before its body runs, and whose user errors end the program
    with their message and exit status."""

    def __init__(self, body: Callable, *, flags: Flags | None = None, **kwargs: Any) -> None:
        self.flags = flags or Flags()
        if flags is not None:
            kwargs["help"] = flags.help
        super().__init__(body, **kwargs)

    def arg_opts(self, name: str, default: str, taken_names: set[str]) -> dict[str, Any]:
        """invoke's options of a flag, without a short flag that is no letter: invoke gives a flag
        whose letters are all taken the next character of its name, a dash (`--=STRING` in the help)."""
        opts = super().arg_opts(name, default, taken_names)
        opts["names"] = [opts["names"][0], *(short for short in opts["names"][1:] if short.isalnum())]
        return opts

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **self.flags.read(kwargs))
        except UserError as error:
            raise Exit(str(error) or None, code=error.code) from None


def task(*args: Any, **kwargs: Any) -> Any:
    """invoke's @task, making a `Task`: `@task(flags=Flags(...))` gives the task its flags' help."""
    return invoke_task(*args, klass=Task, **kwargs)


def inventory_of(c: Context, given: str | None) -> str:
    """The inventory a task works on: --inventory, else invoke.yaml's cluster.inventory."""
    return paths.inventory_path(given or c.config.cluster.inventory)
