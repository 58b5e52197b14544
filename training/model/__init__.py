"""The model on a node: fetched into one mlx-lm folder, its manifest, GGUF files read, its
quantization described (and dequantized at load where the inventory asks).
"""
