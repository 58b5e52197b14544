"""Ansible callback that loads the Jinja filter and test plugins once, in ansible-playbook's own
process, before it forks a worker for each host and task.

Ansible loads a plugin the first time a process asks for it and keeps it for that process. The
main process rarely templates, so each forked worker loaded every filter plugin again (this
project's import mlxcluster/) and every test plugin: on an idempotent 3-node site.yml, about a
sixth of the controller's CPU. Loaded here first, the workers inherit them with the fork.
Enabled in ansible.cfg (callbacks_enabled); it prints nothing.
"""

from __future__ import annotations

from typing import Any

from ansible.plugins.callback import CallbackBase
from ansible.plugins.loader import filter_loader, test_loader


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "warm_plugins"
    CALLBACK_NEEDS_ENABLED = True

    def v2_playbook_on_start(self, playbook: Any) -> None:
        for loader in (filter_loader, test_loader):
            for _ in loader.all():
                pass
