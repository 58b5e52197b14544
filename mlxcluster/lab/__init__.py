"""The lab cluster: real Debian hosts in network namespaces on this machine, their point-to-point
cables and their limits, for tests and rehearsals.
"""
