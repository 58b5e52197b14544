"""The trackers mlx-lm reports to (wandb, swanlab) imported when a run first uses one, not at start.

`mlx_lm.tuner.callbacks` imports both at its top whenever they are installed, and every rank
imports it with the trainer: about a second of CPU per process (measured with `-X importtime`:
0.65 s wandb, 0.31 s swanlab, of 3.3 s for `import training.finetune`), on each rank of each run,
for trackers a run rarely names. So when that module is imported (by anyone: ours, the trainer),
it runs with the trackers hidden (it binds None for each), and each tracker that is installed is
then bound in it as a stand-in that imports the package at its first attribute, which only a run
with `report_to` reaches. One not installed stays None, which is what mlx-lm's callbacks refuse and
`training.loop.reporting` names as missing before any training. Nothing of mlx-lm is imported
before something asks for it (the controller's tasks import training's settings, not mlx-lm).
(The standard library's `LazyLoader` cannot do this on Python 3.11: `import wandb` reads the lazy
module's `__spec__`, which loads it.)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

TRACKERS = ("wandb", "swanlab")
CALLBACKS = "mlx_lm.tuner.callbacks"


class TrackerOnUse:
    """Stands for a tracker's module in mlx-lm's callbacks until an attribute is read from it."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        return getattr(importlib.import_module(self._name), attribute)

    def __repr__(self) -> str:
        return f"<{self._name}, imported on first use>"


class _CallbacksWithoutTrackers(importlib.abc.Loader):
    """mlx-lm's own loader for its callbacks module, run with the trackers not yet imported hidden."""

    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        pending = [name for name in TRACKERS if name not in sys.modules]
        for name in pending:
            sys.modules[name] = None  # type: ignore[assignment]  # None there: `import` raises ImportError
        try:
            self._loader.exec_module(module)
        finally:
            for name in pending:
                del sys.modules[name]
        for name in pending:
            if _installed(name):
                setattr(module, name, TrackerOnUse(name))


class _DeferTrackers(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name != CALLBACKS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _CallbacksWithoutTrackers(spec.loader)
        return spec


def defer_tracker_imports() -> None:
    """From now on, mlx-lm's callbacks module imports no tracker; nothing if it was imported already."""
    if CALLBACKS in sys.modules or any(isinstance(finder, _DeferTrackers) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _DeferTrackers())


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a finder that refuses it: as good as not installed
        return False
