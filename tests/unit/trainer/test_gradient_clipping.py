"""Gradient clipping as in Lightning: an overridden ``configure_gradient_clipping`` runs at every optimizer step with
the Trainer's settings (None when unset), ``clip_gradients`` fills the arguments left out from the Trainer's and
refuses ones that disagree with them, and ``GradClipAlgorithmType`` names the algorithms."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from phalanx_testing import Regressor, quiet_trainer, regression_data
from torch.utils.data import DataLoader

from phalanx.module import TrainingModule
from phalanx.utilities.enums import GradClipAlgorithmType
from phalanx.utilities.exceptions import MisconfigurationError

_BATCHES = 4


def _loader() -> DataLoader:
    # Large targets: the first gradients are far above the thresholds used below.
    x, y = regression_data(8 * _BATCHES).tensors
    return DataLoader(torch.utils.data.TensorDataset(x, 100 * y), batch_size=8)


class Recording(Regressor):
    """Records what configure_gradient_clipping receives, and the gradients once its clipping is done."""

    def __init__(self, clip_args: tuple[Any, ...] | None = None) -> None:
        super().__init__()
        self.clip_args = clip_args  # None: do not clip; else the arguments for self.clip_gradients
        self.received: list[tuple[Any, Any]] = []
        self.norms: list[float] = []
        self.max_abs: list[float] = []

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.received.append((gradient_clip_val, gradient_clip_algorithm))
        if self.clip_args is not None:
            self.clip_gradients(optimizer, *self.clip_args)
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        self.max_abs.append(max(float(g.abs().max()) for g in grads))


@pytest.mark.parametrize(
    ("trainer_args", "expected"),
    [
        ({}, (None, None)),
        ({"gradient_clip_val": 0.5}, (0.5, None)),
        ({"gradient_clip_val": 0.5, "gradient_clip_algorithm": "value"}, (0.5, "value")),
        ({"gradient_clip_algorithm": "norm"}, (None, "norm")),
        ({"accumulate_grad_batches": 2}, (None, None)),
    ],
)
def test_an_overridden_configure_gradient_clipping_runs_at_every_optimizer_step(tmp_path, trainer_args, expected):
    module = Recording()
    trainer = quiet_trainer(default_root_dir=tmp_path, max_epochs=1, **trainer_args)
    trainer.fit(module, _loader())
    steps = _BATCHES // trainer_args.get("accumulate_grad_batches", 1)
    assert trainer.global_step == steps
    assert module.received == [expected] * steps


class Plain(Regressor):
    """No override: the default configure_gradient_clipping (which clips nothing without gradient_clip_val)."""


def _assigned_override() -> Regressor:
    # An override assigned on the instance, as Lightning users do with hooks, counts as one.
    module = Plain()
    module.received = []  # type: ignore[attr-defined]
    module.configure_gradient_clipping = lambda optimizer, **kwargs: module.received.append(tuple(kwargs.values()))
    return module


@pytest.mark.parametrize(
    ("first", "second"),
    [(Plain, Recording), (Recording, Plain), (Recording, Recording), (Plain, _assigned_override)],
)
def test_whether_configure_gradient_clipping_is_overridden_is_decided_for_each_fit(
    tmp_path, monkeypatch, first, second
):
    # Decided once per fit, not per step: a second fit on the same Trainer with another module sees that module's.
    default_calls: list[TrainingModule] = []
    default = TrainingModule.configure_gradient_clipping

    def spy(self, *args, **kwargs):
        default_calls.append(self)
        return default(self, *args, **kwargs)

    monkeypatch.setattr(TrainingModule, "configure_gradient_clipping", spy)
    trainer = quiet_trainer(default_root_dir=tmp_path, max_epochs=1)
    modules = [first(), second()]
    for epochs, module in enumerate(modules, start=1):
        trainer.max_epochs = epochs
        trainer.fit(module, _loader())
        assert trainer.global_step == _BATCHES * epochs
    for module in modules:
        overrides = hasattr(module, "received")
        assert getattr(module, "received", []) == ([(None, None)] * _BATCHES if overrides else [])
    assert default_calls == []  # without gradient_clip_val the default is never called


THRESHOLD = 1e-3
# (Trainer arguments, clip_gradients arguments, what is bounded by THRESHOLD: 'norm', 'value', None, or an error)
CLIP_CASES = [
    ({"gradient_clip_val": THRESHOLD}, (), "norm"),
    ({"gradient_clip_val": THRESHOLD, "gradient_clip_algorithm": "value"}, (), "value"),
    ({"gradient_clip_val": THRESHOLD, "gradient_clip_algorithm": GradClipAlgorithmType.VALUE}, (), "value"),
    ({}, (), None),
    ({}, (THRESHOLD,), "norm"),
    ({}, (THRESHOLD, "value"), "value"),
    ({}, (THRESHOLD, GradClipAlgorithmType.VALUE), "value"),
    ({"gradient_clip_algorithm": "value"}, (THRESHOLD,), "value"),
    ({"gradient_clip_val": THRESHOLD}, (THRESHOLD, "norm"), "norm"),
    ({"gradient_clip_val": 0.5}, (THRESHOLD,), "gradient_clip_val=0.5.* disagree"),
    ({"gradient_clip_algorithm": "norm"}, (THRESHOLD, "value"), "gradient_clip_algorithm='norm'.* disagree"),
]


@pytest.mark.parametrize(("trainer_args", "clip_args", "bounded"), CLIP_CASES)
def test_clip_gradients_takes_the_trainer_settings_left_out(tmp_path, trainer_args, clip_args, bounded):
    module = Recording(clip_args)
    trainer = quiet_trainer(default_root_dir=tmp_path, max_steps=2, **trainer_args)
    if bounded not in ("norm", "value", None):
        with pytest.raises(MisconfigurationError, match=bounded):
            trainer.fit(module, _loader())
        return
    trainer.fit(module, _loader())
    norm, max_abs = module.norms[0], module.max_abs[0]
    if bounded == "norm":
        assert norm <= THRESHOLD * 1.01
    elif bounded == "value":
        assert max_abs <= THRESHOLD * 1.01 and norm > THRESHOLD * 1.01
    else:
        assert max_abs > THRESHOLD


class Manual(Regressor):
    def __init__(self, clip_args: tuple[Any, ...]) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.clip_args = clip_args
        self.max_abs: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.manual_backward(loss)
        self.clip_gradients(optimizer, *self.clip_args)
        self.max_abs.append(max(float(p.grad.abs().max()) for p in self.parameters()))
        optimizer.step()
        return loss


@pytest.mark.parametrize(("clip_args", "clipped"), [((), False), ((THRESHOLD, "value"), True)])
def test_clip_gradients_in_manual_optimization_defaults_to_no_clipping(tmp_path, clip_args, clipped):
    module = Manual(clip_args)
    quiet_trainer(default_root_dir=tmp_path, max_steps=1).fit(module, _loader())
    assert (module.max_abs[0] <= THRESHOLD * 1.01) is clipped


def test_grad_clip_algorithm_type_names_the_algorithms():
    assert GradClipAlgorithmType.supported_types() == ["value", "norm"]
    assert GradClipAlgorithmType.NORM == "norm" and str(GradClipAlgorithmType.VALUE) == "value"
    assert GradClipAlgorithmType.supported_type("value") and not GradClipAlgorithmType.supported_type("l2")
    assert quiet_trainer(gradient_clip_algorithm=GradClipAlgorithmType.VALUE).gradient_clip_algorithm == "value"
