"""mlx-lm's `resume_adapter_file` on the cluster: the weights a new run starts from, a file on the
controller, sent to every node that trains (each rank loads it), and the setting rewritten to
where it lands: <work>/start/<run id>/<file name>. Only that file goes, checked as every shipment
is (mlxcluster/launch/shipment.py): a regular file, not a link out of its folder, not hidden.
"""

from __future__ import annotations

from pathlib import Path

from mlxcluster.errors import UserError, shown
from mlxcluster.launch import shipment


def shipment_of(given: str) -> shipment.Shipment:
    path = Path(given).expanduser()
    if not path.is_file():
        raise UserError(f"resume_adapter_file {shown(given)}: no such file here (the controller sends it "
                        "to the nodes): give the adapters.safetensors a run left, e.g. "
                        "runs/<id>/adapters.safetensors")
    return shipment.select(path.parent, [path.name], f"resume_adapter_file {shown(given)}")


def folder_on_nodes(work_dir: str, run_id: str) -> str:
    return f"{work_dir}/start/{run_id}"
