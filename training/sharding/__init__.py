"""Tensor parallelism: the model's layers, attention head groups and vocabulary split across ranks.
"""
