"""training.loop.trackers_on_use: a rank's start-up imports no tracker; a run that reports still gets it."""

import subprocess
import sys
import textwrap


def _python(code: str) -> str:
    # A fresh interpreter: this session has imported the trackers already.
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            check=True)
    return result.stdout.strip()


def test_the_trainer_s_start_imports_no_tracker_and_the_first_use_imports_it():
    shown = _python("""
        import sys
        import training.finetune
        from mlx_lm.tuner import callbacks
        print("wandb" in sys.modules, "swanlab" in sys.modules, repr(callbacks.wandb))
        callbacks.wandb.init
        print("wandb" in sys.modules, callbacks.wandb.finish is sys.modules["wandb"].finish)
    """)
    assert shown.splitlines() == ["False False <wandb, imported on first use>", "True True"]


def test_a_tracker_not_installed_stays_none_and_is_named_missing():
    shown = _python("""
        import importlib.abc, sys

        class NoSwanlab(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "swanlab":
                    raise ModuleNotFoundError(name)

        sys.meta_path.insert(0, NoSwanlab())
        import training.loop.reporting as reporting
        from mlx_lm.tuner import callbacks
        print(callbacks.swanlab, reporting.missing_packages("wandb,swanlab"))
    """)
    assert shown == "None ['swanlab']"
