"""The trackers mlx-lm reports to (wandb, swanlab) imported when a run first uses one, not at start.

`mlx_lm.tuner.callbacks` imports both at its top whenever they are installed, and every rank
imports it with the trainer: about a second of CPU per process (measured with `-X importtime`:
0.65 s wandb, 0.31 s swanlab, of 3.3 s for `import training.finetune`), on each rank of each run,
for trackers a run rarely names. So that module is imported first here with the trackers hidden
(it binds None for each), and each tracker that is installed is then bound in it as a stand-in that
imports the package at its first attribute, which only a run with `report_to` reaches. One not
installed stays None, which is what mlx-lm's callbacks refuse and `training.loop.reporting` names
as missing before any training. (The standard library's `LazyLoader` cannot do this on Python
3.11: `import wandb` reads the lazy module's `__spec__`, which loads it.)
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any

TRACKERS = ("wandb", "swanlab")


class TrackerOnUse:
    """Stands for a tracker's module in mlx-lm's callbacks until an attribute is read from it."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        return getattr(importlib.import_module(self._name), attribute)

    def __repr__(self) -> str:
        return f"<{self._name}, imported on first use>"


def defer_tracker_imports() -> None:
    """Imports mlx-lm's callbacks module with each tracker not yet imported bound to a `TrackerOnUse`
    (None if not installed); does nothing if that module was imported already."""
    if "mlx_lm.tuner.callbacks" in sys.modules:
        return
    pending = [name for name in TRACKERS if name not in sys.modules]
    for name in pending:
        sys.modules[name] = None  # type: ignore[assignment]  # None in sys.modules: import raises ImportError
    try:
        from mlx_lm.tuner import callbacks
    finally:
        for name in pending:
            del sys.modules[name]
    for name in pending:
        if _installed(name):
            setattr(callbacks, name, TrackerOnUse(name))


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a finder that refuses it: as good as not installed
        return False
