"""Serving what was trained: the base model loaded once (whole, or sharded across tensor-parallel
ranks) with every adapter over it, behind mlx-lm's OpenAI-compatible server (`python -m training.serve`)."""

READY = "ready: serving"  # what rank 0 prints once it listens (the controller waits for it)
