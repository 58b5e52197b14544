"""mlx-lm's `resume_adapter_file` on the cluster: the weights a new run starts from, a file on the
controller, sent to every node that trains (each rank loads it), and the setting rewritten to
where it lands: <work>/start/<run id>/<file name>.

Only that file goes, and only if it is what the setting means: an adapters file, a safetensors
file whose header lists tensors (a run's `adapters.safetensors`, or one of its checkpoints). Any
other file (a private key, /etc/passwd) is refused before anything is sent, by its header alone,
and so is a file on a hidden path (~/.ssh/...); then it is checked as every shipment is
(mlxcluster/launch/shipment.py): a regular file, not a link out of its folder, not hidden.
"""

from __future__ import annotations

from pathlib import Path

from safetensors import SafetensorError, safe_open

from mlxcluster.errors import UserError, shown
from mlxcluster.launch import shipment
from mlxcluster.paths import RUNS

SUFFIX = ".safetensors"


def _refusal(given: str, why: str) -> UserError:
    return UserError(f"resume_adapter_file {shown(given)}: {why}; give the adapters.safetensors a run "
                     "left (runs/<id>/adapters.safetensors, or one of its checkpoints)")


def tensor_count(path: Path) -> int:
    """How many tensors a safetensors file's header lists; a ValueError when it is not one."""
    try:
        with safe_open(str(path), framework="numpy") as file:
            return len(file.keys())
    except (SafetensorError, OSError) as error:
        raise ValueError(str(error).splitlines()[0] if str(error) else type(error).__name__) from None


def shipment_of(given: str) -> shipment.Shipment:
    path = Path(given).expanduser()
    if not path.is_file():
        raise _refusal(given, "no such file here (the controller sends it to the nodes)")
    resolved = path.resolve()
    # The runs' own folder counts from itself: a repository kept on a hidden path still resumes.
    inside = resolved.relative_to(RUNS) if resolved.is_relative_to(RUNS) else resolved.relative_to("/")
    if shipment.is_hidden(inside.as_posix()) or shipment.is_secret(resolved.name):
        raise _refusal(given, "a hidden or secret file, which is never sent to the nodes")
    if resolved.suffix != SUFFIX:
        raise _refusal(given, f"not a {SUFFIX} file")
    try:
        count = tensor_count(resolved)
    except ValueError:
        raise _refusal(given, "not a safetensors file (its header cannot be read)") from None
    if count == 0:
        raise _refusal(given, "a safetensors file with no tensor in it")
    return shipment.select(path.parent, [path.name], f"resume_adapter_file {shown(given)}")


def folder_on_nodes(work_dir: str, run_id: str) -> str:
    return f"{work_dir}/start/{run_id}"
