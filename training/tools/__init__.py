"""Node-side tools: the link and matmul benchmarks, generation side by side, the pirate score.
"""
