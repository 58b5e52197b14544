"""The benchmarks behind `invoke bench.*`, one module each; every one writes its JSON through
`results.write`.

- provision: a first and an idempotent second site.yml run on a fresh lab;
- train: scaling, BLAS, pirate quality and our overhead over stock mlx-lm, on a fresh 2-node lab;
- links: every node pair's latency and bandwidth, and all-reduce, on your cluster;
- scaling: the same fine-tune on 1 node and on more, on your cluster.
"""
