"""The jobs a user runs: `invoke train` (a plan, then running it), `invoke run` (any program on
every rank), and the invoke flags they read.
"""
