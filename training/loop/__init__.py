"""The training loop's parts: progress, metrics, the stall watchdog, checkpoints and resuming,
and the report at the end.
"""
