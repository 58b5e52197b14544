"""callback_plugins/warm_plugins.py: ansible-playbook loads this project's filter plugins (and
Ansible's test plugins) once, in its own process, so that the workers it forks per host and task
inherit them instead of each loading them again."""

from __future__ import annotations

import configparser
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

PROBE = """
import json, sys
from ansible.plugins.loader import init_plugin_loader, callback_loader
init_plugin_loader()
def ours():
    files = (getattr(m, '__file__', '') or '' for m in list(sys.modules.values()))
    return sorted(f for f in files if '/filter_plugins/' in f)
before = ours()
callback_loader.get('warm_plugins').v2_playbook_on_start(None)
print(json.dumps({"before": before, "after": ours(), "record": 'mlxcluster.describe.record' in sys.modules}))
"""


def test_ansible_cfg_enables_it():
    config = configparser.ConfigParser(interpolation=None)
    config.read(REPO / "ansible.cfg")
    assert "warm_plugins" in config["defaults"]["callbacks_enabled"].split(",")
    assert (REPO / config["defaults"]["callback_plugins"] / "warm_plugins.py").is_file()


def test_the_playbook_start_loads_every_filter_plugin_in_the_main_process():
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={"ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
                                            "PATH": "/usr/bin:/bin", "HOME": str(REPO / "build")})
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.splitlines()[-1])
    ours = sorted(str(p) for p in (REPO / "filter_plugins").glob("*.py") if p.name != "__init__.py")
    assert loaded["before"] == [] and loaded["after"] == ours and loaded["record"], loaded
