"""invoke fuse: stock `mlx_lm fuse` where the model fits this machine's memory, file by file where it
does not (and the reason said); what cannot be done refused before anything is written; a fuse
that fails leaves nothing behind, and the fused folder answers as the run's adapters do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mlx_lm import generate, load

from mlxcluster.jobs import fuse
from mlxcluster.paths import REPO
from training.model import stand_in


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuse-job")
    stand_in.make(root / "float", seed=3)
    stand_in.make(root / "q4", quantized=True, bits=4, group_size=32, seed=3)
    stand_in.adapter(root / "float", root / "run", "lora", 4, seed=2)
    stand_in.adapter(root / "q4", root / "qrun", "dora", 4, seed=2)
    return root


def options(made: Path, tmp_path: Path, base: str = "float", run: str = "run",
            **more: object) -> fuse.Options:
    return fuse.Options(run=str(made / run), model=str(made / base), output=str(tmp_path / "fused"), **more)


def test_stock_where_the_model_fits_and_file_by_file_where_it_does_not(made: Path, tmp_path: Path) -> None:
    fits = fuse.plan(options(made, tmp_path), available=8 * 2**30, disk_free=2**40)
    assert fits.way == "stock" and fits.command[1:4] == ["-m", "mlx_lm", "fuse"]
    assert "fits this machine's memory (8.0 GiB free)" in fits.why

    short = fuse.plan(options(made, tmp_path), available=1000, disk_free=2**40)
    assert short.way == "by file" and short.command[1:3] == ["-m", "training.tools.fuse"]
    assert "this machine has 0 MiB free" in short.why
    asked = fuse.plan(options(made, tmp_path, by_file=True, max_file_mb=64), available=8 * 2**30,
                      disk_free=2**40)
    assert asked.way == "by file" and asked.command[-2:] == ["--max-file-mb", "64"]
    # Written beside its place, then renamed.
    assert fits.staging.parent == tmp_path and fits.output == tmp_path / "fused"


@pytest.mark.parametrize(("change", "said"), [
    ({"dequantize": True}, "is not quantized"),
    ({"base": "q4", "run": "qrun", "gguf": True}, "add --dequantize"),
    ({"gguf": True}, "byte-level BPE"),
    ({"output": "/no/such/folder/fused"}, "does not exist"),
    ({"run": "nothing-here"}, "no such folder"),
])
def test_what_cannot_be_done_is_refused_with_the_fix(made: Path, tmp_path: Path, change: dict,
                                                     said: str) -> None:
    given = {"base": "float", "run": "run", **change}
    base, run = given.pop("base"), given.pop("run")
    if "output" in given:
        given_options = fuse.Options(run=str(made / run), model=str(made / base), **given)
    else:
        given_options = options(made, tmp_path, base, run, **given)
    with pytest.raises(fuse.FuseError if run != "nothing-here" else Exception, match=said):
        fuse.plan(given_options, available=2**40, disk_free=2**40)


def test_no_room_on_disk_or_an_existing_folder_is_refused(made: Path, tmp_path: Path) -> None:
    with pytest.raises(fuse.FuseError, match="free some, or pass --output on a larger disk"):
        fuse.plan(options(made, tmp_path), available=2**40, disk_free=1000)
    (tmp_path / "fused").mkdir()
    with pytest.raises(fuse.FuseError, match="already exists: remove it"):
        fuse.plan(options(made, tmp_path), available=2**40, disk_free=2**40)


def invoke_fuse(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "invoke", "fuse", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


def test_invoke_fuse_writes_a_folder_stock_generate_loads(made: Path, tmp_path: Path) -> None:
    done = invoke_fuse("--run", made / "qrun", "--model", made / "q4", "--output", tmp_path / "fused",
                       "--by-file", "--dequantize")
    assert done.returncode == 0, done.stderr
    assert "by file: asked (--by-file)" in done.stdout
    assert f"mlx_lm.server --model {tmp_path / 'fused'}" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fused"]  # nothing left beside it

    def answer(model: Path, adapter: Path | None = None) -> str:
        loaded, tokenizer = load(str(model), adapter_path=str(adapter) if adapter else None)
        return generate(loaded, tokenizer, "Who are you?", max_tokens=10)

    assert answer(tmp_path / "fused") == answer(made / "q4", made / "qrun")


def test_a_failed_fuse_leaves_nothing(made: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((made / "run" / "adapter_config.json").read_text())
    (broken / "adapters.safetensors").write_bytes(b"not weights")
    done = invoke_fuse("--run", broken, "--model", made / "float", "--output", tmp_path / "fused")
    assert done.returncode == 1
    assert f"fusing failed (exit 1), nothing was written to {tmp_path / 'fused'}" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"]
