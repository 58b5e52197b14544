"""The model on a node: fetched into one mlx-lm folder, its manifest, GGUF files read.
"""
