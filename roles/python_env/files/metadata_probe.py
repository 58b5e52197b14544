# Run by the venv's python with the pinned requirements as arguments (name[extras]==version):
# prints the Python version, the installed mlx and mlx-lm versions and the requirements the
# venv does not satisfy, from package metadata alone (importing MLX would take seconds).
import importlib.metadata as md
import json
import platform
import re
import sys

PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[([^\]]*)\])?==([^\s;]+)")


def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def extras_installed(name, extras):
    # What `name[extra]` adds: its Requires-Dist lines marked with that extra.
    for line in md.requires(name) or []:
        for extra in extras:
            if re.search(r"extra\s*==\s*['\"]" + re.escape(extra) + r"['\"]", line):
                if version(re.match(r"[A-Za-z0-9._-]+", line).group()) is None:
                    return False
    return True


unmet = []
for requirement in sys.argv[1:]:
    pin = PIN.fullmatch(requirement.strip())
    if not pin or version(pin[1]) != pin[3]:
        unmet.append(requirement)
    elif pin[2] and not extras_installed(pin[1], [e.strip() for e in pin[2].split(",")]):
        unmet.append(requirement)
print(json.dumps({"python": platform.python_version(), "mlx": version("mlx"),
                  "mlx_lm": version("mlx-lm"), "unmet": unmet}))
