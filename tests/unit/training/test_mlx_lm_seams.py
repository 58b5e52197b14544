"""The seams between training/finetune.py and the pinned mlx-lm, checked against the installed
package: an upgrade that renames or reshapes one of them fails here, not in a run hours later.

mlx-lm's `trainer.train` offers callbacks and an `iterate_batches` argument, which we use; it has
no argument for its progress display or its gradient averaging, so `train` swaps two module
globals for the length of the call (`TrainUI`, which prints, and `average_gradients`, which must
not average the shards of tensor parallelism). Those two swaps only work while `trainer.train`
looks them up as globals when it runs, with the calls checked here.
"""

from __future__ import annotations

import inspect
import re
import types

from mlx_lm.tuner import trainer

from training.data.batches import SharedBatches
from training.loop.metrics import MetricsCallback
from training.loop.progress import ProgressDisplay

SOURCE = inspect.getsource(trainer.train)


def global_names(code: types.CodeType) -> set[str]:
    """The names a function (and the functions defined in it) may look up as globals."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= global_names(const)
    return names


def call_arguments(name: str) -> list[str]:
    return [" ".join(args.split()) for args in re.findall(rf"\b{name}\(([^()]*)\)", SOURCE)]


def test_the_trainer_looks_up_the_two_swapped_names_as_its_globals_at_run_time():
    for name in ("TrainUI", "average_gradients"):
        assert hasattr(trainer, name), f"mlx_lm.tuner.trainer has no {name}: training/finetune.py swaps it"
        assert name in global_names(trainer.train.__code__), f"trainer.train no longer calls {name}"
        assert name not in inspect.signature(trainer.train).parameters  # else pass it instead


def test_every_call_the_trainer_makes_on_its_display_exists_on_ours():
    calls = sorted(set(re.findall(r"\bui\.(\w+)", SOURCE)))
    assert calls, "trainer.train no longer reports through a TrainUI: see training/loop/progress.py"
    assert [c for c in calls if not callable(getattr(ProgressDisplay, c, None))] == []
    assert call_arguments("TrainUI") == ["args.iters, rank=rank"]  # our stand-in takes anything


def test_the_trainer_averages_one_tree_of_gradients_as_our_replacement_takes_it():
    assert call_arguments("average_gradients") == ["grad"]
    assert next(iter(inspect.signature(trainer.average_gradients).parameters)) == "gradients"


def test_the_trainer_calls_our_batches_and_callbacks_the_way_they_are_written():
    keywords = {k for args in call_arguments("iterate_batches") for k in re.findall(r"(\w+)=", args)}
    assert keywords, "trainer.train no longer calls iterate_batches with keywords"
    inspect.signature(SharedBatches.__call__).bind(None, **dict.fromkeys(keywords))
    for hook in ("on_train_loss_report", "on_val_loss_report"):
        assert f"training_callback.{hook}(" in SOURCE
        assert callable(getattr(MetricsCallback, hook))
    evaluate = inspect.signature(trainer.evaluate)
    evaluate.bind(None, None, 1, 1, max_seq_length=1, loss=None, iterate_batches=None,
                  progress_callback=None)


def test_the_trainer_takes_its_value_and_grad_from_its_nn_global_as_the_pipeline_swaps_it():
    """A pipeline run swaps the trainer's `nn` for one whose value_and_grad is the stages' step
    (training/sharding/pipeline.py: TrainerNN), and runs uncompiled: the step sends and receives."""
    assert "nn" in global_names(trainer.train.__code__)
    assert re.findall(r"\bnn\.value_and_grad\(([^()]*)\)", SOURCE) == ["model, loss"]
    assert re.findall(r"\bnn\.(\w+)", SOURCE) == ["value_and_grad"]  # nothing else of nn is looked up
    assert re.findall(r"\(\*?lvalue, toks\), grad = loss_value_and_grad\(model, \*batch\)", SOURCE)
