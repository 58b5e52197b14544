"""Provisioning from the controller: ansible-playbook command lines, the dry run's layout before
provisioning, the model store, the data and model a run trains on.
"""
