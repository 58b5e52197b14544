"""Launching on the cluster: reaching a node, what is shipped and synced, the settings checked,
the parallel mode and batch shares, the one launch builder, the relayed output, the run records.
"""
