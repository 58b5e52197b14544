"""Checking the cluster: `invoke doctor`'s checks and probes, and the cabling as the Macs see it.
"""
