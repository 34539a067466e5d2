"""The TrainingModule hooks a Lightning user overrides are called where Lightning calls them, and mean the same.

optimizer_step / optimizer_zero_grad in the training loop, the batch transfer hooks in every loop, the
eval/train mode hooks of validation, test and predict, and on_validation_model_zero_grad before validation in fit.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from phalanx_testing import Regressor, loaders, parameters_of, quiet_trainer, regression_data, same_parameters
from torch import nn
from torch.utils.data import DataLoader

import phalanx
from phalanx.plugins.precision import MixedPrecision
from phalanx.utilities.exceptions import MisconfigurationError


def _trainer(tmp_path, **kwargs: Any) -> phalanx.Trainer:
    options: dict[str, Any] = dict(default_root_dir=tmp_path, max_epochs=1, num_sanity_val_steps=0)
    options.update(kwargs)
    return quiet_trainer(**options)


def _train_loader(n: int = 48) -> DataLoader:
    return DataLoader(regression_data(n), batch_size=8, shuffle=False)


# ---------------------------------------------------------------------------- optimizer_step
class WarmUp(Regressor):
    """Lightning's documented warm-up: scale the learning rate in optimizer_step, then step with the closure."""

    def __init__(self, warmup: int = 4) -> None:
        super().__init__()
        self.warmup = warmup
        self.calls: list[tuple[int, int, int]] = []

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        self.calls.append((epoch, batch_idx, self.trainer.global_step))
        scale = min(1.0, (self.trainer.global_step + 1) / self.warmup)
        for group in optimizer.param_groups:
            group["lr"] = scale * self.hparams.lr
        optimizer.step(closure=optimizer_closure)


def _reference_warm_up(
    model: Regressor, loader: DataLoader, epochs: int, accumulate: int, warmup: int
) -> list[torch.Tensor]:
    """The same training written as a plain PyTorch loop."""
    optimizer = torch.optim.SGD(model.parameters(), lr=model.hparams.lr)
    batches = list(loader)
    step = 0
    for _ in range(epochs):
        for start in range(0, len(batches), accumulate):
            optimizer.zero_grad()
            for x, y in batches[start : start + accumulate]:
                (nn.functional.mse_loss(model(x), y) / accumulate).backward()
            for group in optimizer.param_groups:
                group["lr"] = min(1.0, (step + 1) / warmup) * model.hparams.lr
            optimizer.step()
            step += 1
    return parameters_of(model)


@pytest.mark.parametrize("accumulate", [1, 2, 3])
def test_a_warm_up_in_optimizer_step_is_applied_on_each_stepping_batch(tmp_path, accumulate):
    phalanx.seed_everything(0)
    model = WarmUp()
    plain = Regressor()
    plain.load_state_dict(model.state_dict())
    reference = _reference_warm_up(copy.deepcopy(plain), _train_loader(), epochs=2, accumulate=accumulate, warmup=4)
    _trainer(tmp_path, max_epochs=2, accumulate_grad_batches=accumulate).fit(model, _train_loader())
    _trainer(tmp_path / "plain", max_epochs=2, accumulate_grad_batches=accumulate).fit(plain, _train_loader())
    stepping = [i for i in range(6) if (i + 1) % accumulate == 0]
    assert model.calls == [(epoch, i, epoch * len(stepping) + n) for epoch in range(2) for n, i in enumerate(stepping)]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(parameters_of(model), reference))
    assert not same_parameters(parameters_of(model), parameters_of(plain))  # the warm-up changed the updates


class LogsWarmUp(WarmUp):
    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        self.log(
            "scale", min(1.0, (self.trainer.global_step + 1) / self.warmup)
        )  # per step by default, as in Lightning
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)


def test_self_log_in_optimizer_step_records_the_step_value(tmp_path):
    model = LogsWarmUp(warmup=8)
    trainer = _trainer(tmp_path, max_steps=3)
    trainer.fit(model, _train_loader())
    assert trainer.callback_metrics["scale"].item() == pytest.approx(3 / 8)  # the last step's, not the epoch's mean


class Recorder(Regressor):
    """Records, in order, the hooks around an optimizer step."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    def training_step(self, batch, batch_idx):
        self.events.append("training_step")
        return super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer):
        self.events.append("on_before_optimizer_step")

    def on_before_zero_grad(self, optimizer):
        self.events.append("on_before_zero_grad")

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        self.events.append("optimizer_step")
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        self.events.append("optimizer_zero_grad")
        super().optimizer_zero_grad(epoch, batch_idx, optimizer)


def test_optimizer_step_wraps_training_step_and_the_strategy_step_in_lightnings_order(tmp_path):
    model = Recorder()
    _trainer(tmp_path, max_steps=2).fit(model, _train_loader())
    one_step = [
        "optimizer_step",
        "training_step",
        "on_before_optimizer_step",
        "on_before_zero_grad",
        "optimizer_zero_grad",
    ]
    assert model.events == one_step * 2


@pytest.mark.parametrize(("accumulate", "clip"), [(1, None), (2, None), (1, 0.05), (3, 0.05)])
def test_overriding_the_step_hooks_with_their_defaults_changes_nothing(tmp_path, accumulate, clip):
    phalanx.seed_everything(1)
    hooked, plain = Recorder(), Regressor()
    plain.load_state_dict(hooked.state_dict())
    for model, root in ((hooked, "hooked"), (plain, "plain")):
        _trainer(tmp_path / root, max_epochs=2, accumulate_grad_batches=accumulate, gradient_clip_val=clip).fit(
            model, _train_loader(40)
        )
    assert same_parameters(
        parameters_of(hooked), parameters_of(plain)
    )  # clipping and accumulation went through the handle
    windows = -(-5 // accumulate)  # 5 batches an epoch; the last window may be short
    assert hooked.events.count("optimizer_step") == hooked.events.count("optimizer_zero_grad") == 2 * windows


class NoClosure(Regressor):
    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer.step()  # forgets the closure: training_step would never run


def test_an_optimizer_step_that_never_runs_the_closure_is_refused(tmp_path):
    with pytest.raises(
        MisconfigurationError,
        match=r"NoClosure.optimizer_step did not run the optimizer_closure.*batch_idx"
        r" 0.*optimizer.step\(closure=optimizer_closure\)",
    ):
        _trainer(tmp_path).fit(NoClosure(), _train_loader())


class ClosureWithoutUpdate(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.steps_run = 0

    def training_step(self, batch, batch_idx):
        self.steps_run += 1
        return super().training_step(batch, batch_idx)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer_closure()  # training_step and backward, no update (Lightning's documented way to skip a step)


class ClosureThenStep(Regressor):
    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer_closure()
        optimizer.step()  # no closure: the step uses the loss and gradients of the closure run above


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed with a GradScaler"])
def test_running_the_closure_then_stepping_without_it_trains_as_the_default(tmp_path, precision):
    phalanx.seed_everything(3)
    model, plain = ClosureThenStep(), Regressor()
    plain.load_state_dict(model.state_dict())
    before = parameters_of(model)
    for trained, root in ((model, "a"), (plain, "b")):
        if precision.startswith("16-mixed"):  # the scaler skips a step whose closure gave no loss: here it has one
            options = {
                "plugins": [
                    MixedPrecision("16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu", init_scale=8.0))
                ]
            }
        else:
            options = {"precision": precision}
        _trainer(tmp_path / root, gradient_clip_val=0.05, **options).fit(trained, _train_loader())
    assert same_parameters(parameters_of(model), parameters_of(plain))
    assert not same_parameters(parameters_of(model), before)


def test_running_the_closure_without_stepping_trains_nothing_but_counts_the_step(tmp_path):
    model = ClosureWithoutUpdate()
    before = parameters_of(model)
    trainer = _trainer(tmp_path)
    trainer.fit(model, _train_loader())
    assert model.steps_run == 6 and trainer.global_step == 6  # as in Lightning, the loop counts the stepping batches
    assert same_parameters(parameters_of(model), before)


class OldSignature(Regressor):
    def optimizer_step(
        self, epoch, batch_idx, optimizer, optimizer_idx, optimizer_closure, on_tpu=False, using_lbfgs=False
    ):
        optimizer.step(closure=optimizer_closure)


def test_lightning_1_signature_of_optimizer_step_is_refused_before_training(tmp_path):
    model = OldSignature()
    with pytest.raises(
        MisconfigurationError,
        match=r"OldSignature.optimizer_step takes optimizer_idx.*optimizer_step\(self, epoch, batch_idx, optimizer,"
        r" optimizer_closure=None\)",
    ):
        _trainer(tmp_path).fit(model, _train_loader())
    assert model.global_step == 0


class ManualWithStepHook(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.hook_calls = 0

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(self(batch[0]), batch[1])
        self.manual_backward(loss)
        optimizer.step()
        return loss

    def optimizer_step(self, *args, **kwargs):
        self.hook_calls += 1


def test_manual_optimization_does_not_call_optimizer_step_and_says_so(tmp_path):
    model = ManualWithStepHook()
    trainer = _trainer(tmp_path)
    with pytest.warns(
        UserWarning,
        match="ManualWithStepHook overrides optimizer_step, which the training loop calls only with automatic"
        " optimization",
    ):
        trainer.fit(model, _train_loader())
    assert model.hook_calls == 0 and trainer.global_step == 6  # the handle's step() counts in manual optimization


# ---------------------------------------------------------------------------- optimizer_zero_grad
class KeepGradients(Regressor):
    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        pass  # gradients add up over the whole run


class ZeroInPlace(Regressor):
    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad(set_to_none=False)


@pytest.mark.parametrize(("kind", "grads"), [(Regressor, "none"), (ZeroInPlace, "zeros"), (KeepGradients, "kept")])
def test_optimizer_zero_grad_replaces_the_loops_zeroing(tmp_path, kind, grads):
    phalanx.seed_everything(2)
    model, plain = kind(), Regressor()
    plain.load_state_dict(model.state_dict())
    _trainer(tmp_path / "a").fit(model, _train_loader())
    _trainer(tmp_path / "b").fit(plain, _train_loader())
    found = [p.grad for p in model.parameters()]
    if grads == "none":
        assert all(g is None for g in found)
    elif grads == "zeros":
        assert all(g is not None and not g.any() for g in found)
    else:
        assert all(g is not None and g.any() for g in found)
    assert same_parameters(parameters_of(model), parameters_of(plain)) == (grads != "kept")


# ---------------------------------------------------------------------------- batch transfer hooks
class Tagged(Regressor):
    """Each transfer hook appends its tag to the batch; every step records the batch it receives."""

    def __init__(self, hooks: tuple[str, ...]) -> None:
        super().__init__()
        self.hooks = hooks
        self.seen: list[tuple[str, tuple[str, ...]]] = []
        self.devices: list[torch.device] = []
        for name in hooks:
            setattr(self, name, getattr(self, f"_{name}"))

    def _on_before_batch_transfer(self, batch, dataloader_idx):
        return (*batch, f"before{dataloader_idx}")

    def _transfer_batch_to_device(self, batch, device, dataloader_idx):
        self.devices.append(device)
        return (*super().transfer_batch_to_device(batch, device, dataloader_idx), "transfer")

    def _on_after_batch_transfer(self, batch, dataloader_idx):
        return (*batch, "after")

    def _record(self, stage: str, batch: Any) -> torch.Tensor:
        self.seen.append((stage, tuple(item for item in batch[2:])))
        return nn.functional.mse_loss(self(batch[0]), batch[1])

    def training_step(self, batch, batch_idx):
        return self._record("train", batch)

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self._record("validate", batch)

    def test_step(self, batch, batch_idx, dataloader_idx=0):
        self._record("test", batch)

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self._record("predict", batch)


TRANSFER_CASES = [
    (
        ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer"),
        ("before{}", "transfer", "after"),
    ),
    (("on_before_batch_transfer",), ("before{}",)),
    (("transfer_batch_to_device",), ("transfer",)),
    (("on_after_batch_transfer",), ("after",)),
]


@pytest.mark.parametrize(("hooks", "tags"), TRANSFER_CASES)
@pytest.mark.parametrize("stage", ["fit", "sanity_check", "validate", "test", "predict"])
def test_batch_transfer_hooks_shape_what_every_step_receives(tmp_path, hooks, tags, stage):
    model = Tagged(hooks)
    train, val = loaders(n=16)
    second = DataLoader(regression_data(8), batch_size=8)
    trainer = _trainer(
        tmp_path, max_steps=1, limit_val_batches=1, num_sanity_val_steps=1 if stage == "sanity_check" else 0
    )
    if stage in ("fit", "sanity_check"):
        trainer.fit(model, train, val if stage == "sanity_check" else None)
        expected = [("validate", tuple(t.format(0) for t in tags))] if stage == "sanity_check" else []
        expected.append(("train", tuple(t.format(0) for t in tags)))
    else:
        getattr(trainer, stage)(model, [val, second], **({} if stage == "predict" else {"verbose": False}))
        expected = [(stage, tuple(t.format(idx) for t in tags)) for idx in (0, 1)]
    assert model.seen == expected
    if "transfer_batch_to_device" in hooks:
        assert model.devices and set(model.devices) == {torch.device("cpu")}


class TransferData(phalanx.DataModule):
    def __init__(self, tag: str = "datamodule") -> None:
        super().__init__()
        self.tag = tag

    def train_dataloader(self):
        return DataLoader(regression_data(8), batch_size=8)

    def on_after_batch_transfer(self, batch, dataloader_idx):
        return (*batch, self.tag)


def test_a_datamodules_transfer_hook_wins_over_the_modules_with_a_warning(tmp_path):
    model = Tagged(("on_after_batch_transfer", "on_before_batch_transfer"))
    trainer, data = _trainer(tmp_path, max_steps=1), TransferData()
    with pytest.warns(
        UserWarning, match="Tagged and TransferData both override on_after_batch_transfer: the DataModule's is used"
    ) as caught:
        trainer.fit(model, datamodule=data)
        trainer.predict(model, DataLoader(regression_data(8), batch_size=8))  # no DataModule: the module's hooks
    assert model.seen == [
        ("train", ("before0", "datamodule")),
        ("predict", ("before0", "after")),
    ]  # the module's on_before runs: only it defines it
    assert sum("both override" in str(w.message) for w in caught) == 1


# ---------------------------------------------------------------------------- model mode hooks
class Modes(Regressor):
    """Records the hooks that switch modes and the mode each step runs in."""

    def __init__(self, overridden: tuple[str, ...]) -> None:
        super().__init__(dropout=0.5)
        self.events: list[str] = []
        for name in overridden:
            setattr(self, name, lambda name=name: self.events.append(name))

    def training_step(self, batch, batch_idx):
        self.events.append(f"train:{self.training}:{self.net[2].training}")
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.events.append(f"validate:{self.training}")

    def test_step(self, batch, batch_idx):
        self.events.append(f"test:{self.training}")

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        self.events.append(f"predict:{self.training}")
        return self(batch[0])

    def on_validation_start(self):
        self.events.append("on_validation_start")

    def on_validation_end(self):
        self.events.append("on_validation_end")


@pytest.mark.parametrize(
    "overridden", [(), ("on_{}_model_eval",), ("on_{}_model_train",), ("on_{}_model_eval", "on_{}_model_train")]
)
@pytest.mark.parametrize("stage", ["validation", "test", "predict"])
def test_mode_hooks_replace_the_eval_switch_and_its_restore(tmp_path, stage, overridden):
    eval_hook, train_hook = f"on_{stage}_model_eval", f"on_{stage}_model_train"
    model = Modes(tuple(name.format(stage) for name in overridden))
    model.net[2].eval()  # a submodule in eval mode of its own: the default restore keeps it so
    method = {"validation": "validate", "test": "test", "predict": "predict"}[stage]
    getattr(_trainer(tmp_path, limit_val_batches=1, limit_test_batches=1, limit_predict_batches=1), method)(
        model, loaders(n=16)[1]
    )
    eval_overridden, train_overridden = eval_hook in model.__dict__, train_hook in model.__dict__
    # These overrides do nothing: a model never switched to eval mode runs its step in train mode.
    expected = [eval_hook] if eval_overridden else []
    expected.append(f"{method}:{eval_overridden}")
    expected += [train_hook] if train_overridden else []
    assert [event for event in model.events if event not in ("on_validation_start", "on_validation_end")] == expected
    if train_overridden:  # the override replaced the restore of each submodule's mode
        assert model.training == eval_overridden
    else:
        assert model.training and not model.net[2].training


def test_during_fit_validation_switches_through_the_hooks_and_training_resumes_in_train_mode(tmp_path):
    model = Modes(("on_validation_model_eval", "on_validation_model_train"))
    model.on_validation_model_eval = lambda: (model.events.append("on_validation_model_eval"), model.eval())
    model.on_validation_model_train = lambda: (model.events.append("on_validation_model_train"), model.train())
    train, val = loaders(n=16)
    _trainer(tmp_path, max_epochs=1, limit_val_batches=1, num_sanity_val_steps=1, val_check_interval=1).fit(
        model, train, val
    )
    validation = [
        "on_validation_model_eval",
        "on_validation_start",
        "validate:False",
        "on_validation_end",
        "on_validation_model_train",
    ]
    assert model.events == validation + ["train:True:True"] + validation + ["train:True:True"] + validation


# ---------------------------------------------------------------------------- on_validation_model_zero_grad
class ReleaseBeforeValidation(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.released_at: list[int] = []

    def on_validation_model_zero_grad(self):
        self.released_at.append(self.trainer.fit_loop.batches_done)
        super().on_validation_model_zero_grad()


@pytest.mark.parametrize(("accumulate", "released_at"), [(1, [1, 2, 3, 4]), (2, [2, 4]), (3, [3, 4])])
def test_on_validation_model_zero_grad_runs_before_validation_in_fit_at_window_ends(tmp_path, accumulate, released_at):
    model = ReleaseBeforeValidation()
    train, val = loaders(n=32)  # 4 training batches, validated after each; the sanity check does not call it
    _trainer(
        tmp_path, val_check_interval=1, limit_val_batches=1, num_sanity_val_steps=1, accumulate_grad_batches=accumulate
    ).fit(model, train, val)
    assert model.released_at == released_at  # never inside an accumulation window, whose gradients are still needed
    _trainer(tmp_path).validate(model, val, verbose=False)
    assert model.released_at == released_at  # nor in a validate() call


class InPlaceZeroing(ZeroInPlace):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.grads_after_step = [p.grad for p in self.parameters()]

    def on_validation_start(self):
        self.grads_at_validation = [p.grad for p in self.parameters()]


def test_gradients_are_released_before_validation_when_optimizer_zero_grad_keeps_them(tmp_path):
    model = InPlaceZeroing()
    train, val = loaders(n=16)
    _trainer(tmp_path, limit_val_batches=1).fit(model, train, val)
    assert all(g is not None and not g.any() for g in model.grads_after_step)  # the training steps zeroed in place
    assert all(g is None for g in model.grads_at_validation)  # the default on_validation_model_zero_grad ran


# ---------------------------------------------------------------------------- no cost when nothing is overridden
def test_without_overrides_the_loop_calls_the_strategy_directly(tmp_path):
    model = Regressor()
    trainer = _trainer(tmp_path, max_steps=1)
    trainer.fit(model, _train_loader())
    hooks = trainer._hooks
    # A partial (no Python frame of its own) with the device read once, not a wrapper function.
    assert isinstance(hooks.move_batch, functools.partial)
    assert hooks.move_batch.func == trainer.strategy.batch_to_device
    assert hooks.move_batch.keywords == {"device": trainer.strategy.root_device}
    assert all(
        not hooks[name]
        for name in (
            "optimizer_step",
            "optimizer_zero_grad",
            "on_validation_model_eval",
            "on_validation_model_zero_grad",
        )
    )
    assert (
        trainer.fit_loop._step_hook is None
        and trainer.fit_loop._zero_grad_hook is None
        and trainer.fit_loop._release_grads is None
    )
