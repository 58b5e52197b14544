"""The code that runs on the nodes: `python -m training.finetune` with its settings and its
distributed start at the top, and a room per job (data, model, sharding, the training loop and its
checkpoints, node-side tools). It never imports the controller (mlxcluster/)."""

from training.loop.trackers_on_use import defer_tracker_imports

# Before any module of the package imports mlx-lm's trainer, which imports the trackers.
defer_tracker_imports()
