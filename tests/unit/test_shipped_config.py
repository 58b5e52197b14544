"""Properties of the shipped files that no single test run would show."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INSECURE = re.compile(r"StrictHostKeyChecking\s*[= ]\s*(no|false|off|accept-new)", re.I)


def shipped_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    return [REPO / line for line in out.stdout.splitlines() if (REPO / line).is_file()]


def test_no_shipped_file_turns_host_key_checking_off():
    offenders = [str(p.relative_to(REPO)) for p in shipped_files()
                 if p.suffix in {".yml", ".yaml", ".j2", ".py", ".cfg", ".sh", ""}
                 and p.name != "test_shipped_config.py"
                 and INSECURE.search(p.read_text(errors="ignore"))]
    assert offenders == []


def test_site_yml_only_imports_the_plays_in_order():
    import yaml

    site = yaml.safe_load((REPO / "site.yml").read_text())
    assert [entry["ansible.builtin.import_playbook"] for entry in site] == [
        f"playbooks/{name}.yml"
        for name in ("validate", "base", "network", "ssh", "mpi", "python", "model", "hostfile")]
