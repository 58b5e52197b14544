"""Where the controller keeps things: the repository and the folders under it.

Each inventory gets its own build folder (`build/<name>/`: the rendered hostfiles and the layout
provisioning recorded), so that rendering the lab's files never overwrites those of a real
cluster. Runs come back to `runs/<id>/`, benchmark results go to `runs/bench/`.
"""

from __future__ import annotations

import re
from pathlib import Path

from mlxcluster.errors import UserError

REPO = Path(__file__).resolve().parent.parent
RUNS = REPO / "runs"
DEFAULT_INVENTORY = "inventory/local/hosts.yml"  # the embedded default: this machine, 2 ranks
BENCH_RESULTS = RUNS / "bench"
MODELS = REPO / "models"
TRAINING_CODE = REPO / "training"
# A file or folder name that goes into a node's path (data, model, config): plain characters only.
# Remote paths reach the remote shell through old rsync (macOS ships 2.6.9), where a space splits
# the path and `$(...)` runs; with names like these no path needs quoting on any rsync.
PLAIN_NAME = re.compile(r"[A-Za-z0-9_+@=,-][A-Za-z0-9._+@=,-]*")


def build_dir_for(inventory: str | Path) -> Path:
    """Controller build folder of one inventory: build/<inventory folder name>."""
    path = Path(inventory).resolve()
    folder = path if path.is_dir() else path.parent
    if folder == REPO / "inventory":  # inventory/<name>.yml: the user's own clusters
        name = "cluster" if path.is_dir() else path.stem
    elif folder.name == "inventory":  # e.g. /srv/mlx-lab/lab0/inventory/hosts.yml
        name = folder.parent.name
    else:  # inventory/local/hosts.yml
        name = folder.name
    return REPO / "build" / re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def inventory_path(given: str | Path) -> str:
    """The inventory file a task works on, relative to the repository unless absolute."""
    path = Path(given)
    if not path.is_absolute():
        path = REPO / path
    if not path.exists():
        raise UserError(f"inventory {path} does not exist: pass -i/--inventory PATH "
                        "(see inventory/example/hosts.yml for an example)")
    return str(path)
