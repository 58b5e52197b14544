"""The cluster's description: the inventory's rules, the cabling, the layout provisioning
recorded, the backend it allows, the pinned host keys.
"""
