#!/usr/bin/python
"""Ansible module: how a node's copy of the model compares with its manifest. Changes nothing.

The checks are training/model/manifest.py's (module_utils/model_manifest.py links to it), the same ones
`python -m training.model verify` runs before training.
"""

from __future__ import annotations

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.model_manifest import copy_problems, room_shortfall

DOCUMENTATION = r"""
module: model_copy
short_description: Check a node's copy of the model against its sha256 manifest
description:
  - Hashes every file of the copy at I(path) and compares it with the copy's manifest, whose
    own sha256 must be I(manifest_sha256). Reports the differences in C(problems).
  - A copy hashed right is stamped (C(.verified.json) in it, not under check mode): each file's
    size, inode, mtime and ctime. With I(verify=quick) a copy whose stamp still holds is not
    hashed again; any write to a file (a C(touch -r) included) moves its ctime, so it is hashed.
  - With I(model_bytes), fails when the copy must be replaced and its filesystem has not the
    room for it, saying what to fix.
options:
  path:
    description: The copy's directory on the node.
    type: path
    required: true
  manifest_sha256:
    description: sha256 of the controller's manifest.json (none, under --check before a fetch).
    type: str
  model_bytes:
    description: The model's size; 0 skips the free-disk check.
    type: int
    default: 0
  must_match:
    description: Fail, saying what to do, when the copy differs (a check after copying).
    type: bool
    default: false
  verify:
    description: C(quick) trusts an unchanged stamp; C(full) hashes every file whatever it says.
    type: str
    choices: [quick, full]
    default: quick
"""

RETURN = r"""
problems:
  description: Why the copy is not the model (empty when it is), e.g. C(changed: model.safetensors).
  type: list
  elements: str
  returned: always
"""


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "manifest_sha256": {"type": "str"},
            "model_bytes": {"type": "int", "default": 0},
            "must_match": {"type": "bool", "default": False},
            "verify": {"type": "str", "choices": ["quick", "full"], "default": "quick"},
        },
        supports_check_mode=True,
    )
    path, expected = module.params["path"], module.params["manifest_sha256"]
    full = module.params["verify"] == "full" or module.params["must_match"]
    problems = copy_problems(path, expected, full=full, record=not module.check_mode)
    if problems and module.params["must_match"]:
        module.fail_json(msg=f"{path} still differs from the model after copying ({'; '.join(problems)}): "
                         "the controller's copy may be damaged: delete it (models/<name> in the "
                         "repository) and run invoke provision again", problems=problems)
    if problems and module.params["model_bytes"]:
        shortfall = room_shortfall(path, module.params["model_bytes"])
        if shortfall:
            module.fail_json(msg=shortfall, problems=problems)
    module.exit_json(changed=False, problems=problems)


if __name__ == "__main__":
    main()
