"""``trainer.ckpt_path = path`` chooses the checkpoint that the next stages load when they are given none, as
Lightning's setter does: the choice holds for every later stage until None is assigned, and a stage given its own
``ckpt_path`` loads that one, with a warning, and ends the choice."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from phalanx_testing import Regressor, loaders, parameters_of, quiet_trainer, same_parameters

import phalanx


def _stage(trainer: phalanx.Trainer, model: Regressor, stage: str, **kwargs: Any) -> None:
    train, val = loaders(n=32)
    if stage == "fit":
        trainer.fit(model, train, val, **kwargs)
    elif stage == "validate":
        trainer.validate(model, val, verbose=False, **kwargs)
    elif stage == "test":
        trainer.test(model, val, verbose=False, **kwargs)
    else:
        trainer.predict(model, val, **kwargs)


def _two_checkpoints(root: Path) -> tuple[phalanx.Trainer, Regressor, dict[str, Any]]:
    """A Trainer after two epochs, and the checkpoint it saved after the first (its path, weights and step)."""
    trainer = quiet_trainer(max_epochs=1, default_root_dir=root)
    model = Regressor()
    _stage(trainer, model, "fit")
    first = {"path": str(root / "first.ckpt"), "weights": parameters_of(model), "step": trainer.global_step}
    trainer.save_checkpoint(first["path"])
    trainer.fit_loop.max_epochs = 2
    _stage(trainer, model, "fit")
    assert not same_parameters(parameters_of(model), first["weights"])
    return trainer, model, first


def _loaded(trainer: phalanx.Trainer, model: Regressor, stage: str, first: dict[str, Any]) -> bool:
    """Whether the stage just run started from the first checkpoint."""
    if stage == "fit":  # resumed from step 4 and trained one more epoch (to max_epochs=3) from there
        return trainer.ckpt_path == first["path"] and trainer.global_step == first["step"] * 2
    return trainer.ckpt_path == first["path"] and same_parameters(parameters_of(model), first["weights"])


STAGES = ["fit", "validate", "test", "predict"]


@pytest.mark.parametrize("stage", STAGES)
def test_the_checkpoint_assigned_is_loaded_by_the_next_stages(tmp_path: Path, stage: str) -> None:
    trainer, model, first = _two_checkpoints(tmp_path)
    trainer.ckpt_path = Path(first["path"])  # a path-like too
    assert trainer.ckpt_path == first["path"]
    if stage == "fit":
        trainer.fit_loop.max_epochs = 2
    _stage(trainer, model, stage)
    assert _loaded(trainer, model, stage, first)
    # The choice holds for the stage after, until None is assigned (Lightning leaves resetting it to the user).
    with torch.no_grad():
        model.net[0].weight.add_(1.0)
    _stage(trainer, model, "validate")
    assert _loaded(trainer, model, "validate", first)
    trainer.ckpt_path = None
    with torch.no_grad():
        model.net[0].weight.add_(1.0)
    changed = parameters_of(model)
    _stage(trainer, model, "validate")
    assert trainer.ckpt_path is None and same_parameters(parameters_of(model), changed)


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_given_its_own_checkpoint_loads_it_with_a_warning_and_ends_the_choice(tmp_path: Path, stage) -> None:
    trainer, model, first = _two_checkpoints(tmp_path)
    trainer.ckpt_path = str(tmp_path / "never-read.ckpt")
    if stage == "fit":
        trainer.fit_loop.max_epochs = 2
    with pytest.warns(UserWarning, match=r"trainer.ckpt_path = '.*never-read.ckpt' was assigned, but .* the latter"):
        _stage(trainer, model, stage, ckpt_path=first["path"])
    assert _loaded(trainer, model, stage, first)
    with torch.no_grad():
        model.net[0].weight.add_(1.0)
    changed = parameters_of(model)
    _stage(trainer, model, "validate")  # no longer the assigned (missing) file, and nothing else
    assert same_parameters(parameters_of(model), changed)


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (3, TypeError, "trainer.ckpt_path = 3 .* is not valid; assign a path"),
        (b"last.ckpt", TypeError, "of type bytes"),
        (["a.ckpt"], TypeError, "of type list"),
        ("", ValueError, "trainer.ckpt_path = '' is not a path"),
    ],
)
def test_what_is_not_a_path_is_refused(value: Any, error: type, message: str) -> None:
    trainer = quiet_trainer()
    with pytest.raises(error, match=message):
        trainer.ckpt_path = value
    assert trainer.ckpt_path is None and trainer._run.chosen_ckpt_path is None
