"""Data on a node: instruction data prepared into mlx-lm's chat format, its formats, the batches and
each rank's share of them; and the bundled demo data set (pirate.jsonl) with its generator."""
