"""Hooks run in Lightning's order and lifecycle: the same module and callback, recording every hook they define, run
under phalanx and under Lightning 2.6 (``pytorch_lightning``, the oracle) give the same sequence, for fit (with the
defaults, with and without validation), validate, test, predict, and a resume from a checkpoint taken inside an epoch
and at an epoch's end, with and without validation.

The sequences are compared after three documented differences (rows of docs/migrating-from-lightning.md) are taken
out: gradients are zeroed right after the optimizer step (``on_before_zero_grad``, ``optimizer_zero_grad``),
epoch-interval LR schedulers step at one point after the epoch's validation (``lr_scheduler_step``), and on resume
the callbacks' state is restored after ``configure_optimizers`` (still before ``on_fit_start``). The counts of what is
taken out are compared too. The tests after the table check the same properties on phalanx alone.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.trainer.hooks import SHARED_HOOKS

# Every hook both frameworks call on a module (those only one of them has are left out where the classes are built).
MODULE_HOOKS = (
    "prepare_data", "setup", "teardown", "configure_callbacks", "configure_model", "configure_optimizers",
    *SHARED_HOOKS, "optimizer_step", "optimizer_zero_grad", "lr_scheduler_step", "configure_gradient_clipping",
    "backward", "on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer",
    "on_validation_model_zero_grad", "on_validation_model_eval", "on_validation_model_train", "on_test_model_eval",
    "on_test_model_train", "on_predict_model_eval", "on_predict_model_train", "on_save_checkpoint",
    "on_load_checkpoint", "train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader",
    "training_step", "validation_step", "test_step", "predict_step",
)  # fmt: skip
CALLBACK_HOOKS = (
    "setup", "teardown", *SHARED_HOOKS, "on_sanity_check_start", "on_sanity_check_end", "state_dict",
    "load_state_dict", "on_save_checkpoint", "on_load_checkpoint",
)  # fmt: skip
# Taken out before comparing, each a documented difference (see the module docstring); their counts must agree.
ZERO_GRAD = ("Callback.on_before_zero_grad", "on_before_zero_grad", "optimizer_zero_grad")
SET_APART = (*ZERO_GRAD, "lr_scheduler_step")
CALLBACK_RESTORE = ["Callback.on_load_checkpoint", "Callback.load_state_dict"]
RESUMED = "--- resumed ---"


def _data(n: int) -> TensorDataset:
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(n))
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


def _name(prefix: str, hook: str, args: tuple, kwargs: dict[str, Any]) -> str:
    """The hook's name, with the batch index of a step or batch hook: ``on_train_batch_start[2]``."""
    position = None
    if hook.endswith(("_batch_start", "training_step", "validation_step", "test_step", "predict_step")):
        position = 1
    elif hook.endswith("_batch_end"):
        position = 2
    if position is None:
        return f"{prefix}{hook}"
    index = args[position] if len(args) > position else kwargs["batch_idx"]
    return f"{prefix}{hook}[{index}]"


def _recording(hook: str, method: Callable[..., Any], prefix: str, calls: list[str], skip: int) -> Callable[..., Any]:
    def record(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(_name(prefix, hook, args[skip:], kwargs))
        return method(self, *args, **kwargs)

    record.__name__ = hook
    return record


@dataclass
class Api:
    """One framework's Trainer and ModelCheckpoint, and a recording module and callback writing to ``calls``."""

    Trainer: type
    ModelCheckpoint: type
    Module: type
    Callback: type
    calls: list[str]


def _api(framework: str) -> Api:
    if framework == "lightning":
        pl = pytest.importorskip("pytorch_lightning", reason="Lightning is the oracle of these tests")
        base, callback_base, trainer = pl.LightningModule, pl.Callback, pl.Trainer
        checkpoint = importlib.import_module("pytorch_lightning.callbacks").ModelCheckpoint
        other = phalanx.TrainingModule
    else:
        base, callback_base, trainer = phalanx.TrainingModule, phalanx.Callback, phalanx.Trainer
        checkpoint = phalanx.callbacks.ModelCheckpoint
        lightning = importlib.util.find_spec("pytorch_lightning") is not None
        other = importlib.import_module("pytorch_lightning").LightningModule if lightning else base
    calls: list[str] = []

    class Module(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return nn.functional.mse_loss(self.layer(batch[0]), batch[1])

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", nn.functional.mse_loss(self.layer(batch[0]), batch[1]))

        def test_step(self, batch: Any, batch_idx: int) -> None:
            self.log("test_loss", nn.functional.mse_loss(self.layer(batch[0]), batch[1]))

        def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
            return self.layer(batch[0])

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1)}

        def train_dataloader(self) -> DataLoader:
            return DataLoader(_data(8), batch_size=2)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(_data(4), batch_size=2)

        test_dataloader = predict_dataloader = val_dataloader

    class Stateful(callback_base):  # type: ignore[misc, valid-type]
        def state_dict(self) -> dict[str, Any]:
            return {"epochs": 1}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            pass

    hooks = [hook for hook in MODULE_HOOKS if hasattr(base, hook) and hasattr(other, hook)]
    module = type("Hooked", (Module,), {h: _recording(h, getattr(Module, h), "", calls, 0) for h in hooks})
    callback = type(
        "HookedCallback",
        (Stateful,),
        {
            h: _recording(h, getattr(Stateful, h), "Callback.", calls, 0 if "state_dict" in h else 2)
            for h in CALLBACK_HOOKS
        },
    )
    return Api(trainer, checkpoint, module, callback, calls)


QUIET = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)


def _fit_with_defaults(api: Api, root: str) -> None:
    api.Trainer(default_root_dir=root, max_epochs=1, limit_val_batches=2, callbacks=[api.Callback()]).fit(api.Module())


def _fit(validation: bool) -> Callable[[Api, str], None]:
    def run(api: Api, root: str) -> None:
        trainer = api.Trainer(
            default_root_dir=root,
            max_epochs=1,
            limit_val_batches=2 if validation else 0,
            enable_checkpointing=False,
            callbacks=[api.Callback()],
            **QUIET,
        )
        trainer.fit(api.Module())

    return run


def _evaluate(method: str) -> Callable[[Api, str], None]:
    def run(api: Api, root: str) -> None:
        trainer = api.Trainer(default_root_dir=root, enable_checkpointing=False, callbacks=[api.Callback()], **QUIET)
        options = {} if method == "predict" else {"verbose": False}
        getattr(trainer, method)(api.Module(), **options)

    return run


def _resume(where: str, validation: bool) -> Callable[[Api, str], None]:
    """A first fit saves checkpoints (every 2 steps; at the epoch's end; at its end after max_steps stopped it inside
    an epoch); a second fit resumes from one."""

    def run(api: Api, root: str) -> None:
        val = dict(limit_val_batches=2 if validation else 0)
        folder = os.path.join(root, "checkpoints")
        if where == "inside":  # step 2 of the 4 batches of epoch 0, saved in on_train_batch_end
            saver, path = api.ModelCheckpoint(folder, "mid-{step}", every_n_train_steps=2, save_top_k=-1), "mid-step=2"
        else:
            saver, path = api.ModelCheckpoint(folder, "end"), "end"
        first = api.Trainer(
            default_root_dir=root,
            max_epochs=1,
            max_steps=2 if where == "stopped" else -1,
            callbacks=[api.Callback(), saver],
            **val,
            **QUIET,
        )
        first.fit(api.Module())
        api.calls.append(RESUMED)
        second = api.Trainer(
            default_root_dir=root, max_epochs=2, enable_checkpointing=False, callbacks=[api.Callback()], **val, **QUIET
        )
        second.fit(api.Module(), ckpt_path=os.path.join(folder, f"{path}.ckpt"))

    return run


SCENARIOS: dict[str, Callable[[Api, str], None]] = {
    "fit with the Trainer's defaults": _fit_with_defaults,
    "fit with validation": _fit(validation=True),
    "fit without validation": _fit(validation=False),
    "validate": _evaluate("validate"),
    "test": _evaluate("test"),
    "predict": _evaluate("predict"),
    "resume inside an epoch": _resume("inside", validation=False),
    "resume inside an epoch, with validation": _resume("inside", validation=True),
    "resume at an epoch's end": _resume("end", validation=False),
    "resume at an epoch's end, with validation": _resume("end", validation=True),
}
# Lightning 2.6 resumes this one at the next epoch, leaving the rest of the stopped epoch untrained; phalanx trains it
# (a row of the migration guide): phalanx alone.
STOPPED = "resume after max_steps stopped inside an epoch"
PHALANX_SCENARIOS = {**SCENARIOS, STOPPED: _resume("stopped", validation=False)}


def record(framework: str, scenario: str, root: str) -> list[str]:
    """The hooks the scenario calls under ``framework`` ('phalanx' or 'lightning'), in order."""
    torch.manual_seed(0)
    api = _api(framework)
    PHALANX_SCENARIOS[scenario](api, root)
    return api.calls


def _as_lightning_orders(calls: list[str]) -> list[str]:
    """phalanx's sequence with its callbacks' restore moved before ``configure_optimizers``, where Lightning has it."""
    calls = list(calls)
    for i in range(len(calls) - 2):
        if calls[i] == "configure_optimizers" and calls[i + 1 : i + 3] == CALLBACK_RESTORE:
            calls[i : i + 3] = [*CALLBACK_RESTORE, "configure_optimizers"]
    return calls


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_hook_sequence_is_lightnings(tmp_path, scenario):
    lightning = record("lightning", scenario, str(tmp_path / "lightning"))
    ours = _as_lightning_orders(record("phalanx", scenario, str(tmp_path / "phalanx")))
    assert Counter(c for c in ours if c in SET_APART) == Counter(c for c in lightning if c in SET_APART)
    assert [c for c in ours if c not in SET_APART] == [c for c in lightning if c not in SET_APART]


# ---------------------------------------------------------------------------- the same properties, on phalanx alone
@pytest.mark.parametrize("scenario", PHALANX_SCENARIOS)
def test_callbacks_run_before_the_module_in_every_hook_both_define(tmp_path, scenario):
    calls = record("phalanx", scenario, str(tmp_path))
    shared = [call for call in calls if call.removeprefix("Callback.").split("[")[0] in SHARED_HOOKS]
    assert len(shared) > 10  # the scenario reaches shared hooks
    assert shared[0::2] == [f"Callback.{call}" for call in shared[1::2]]


@pytest.mark.parametrize("scenario", ["fit with validation", "validate", "test", "predict"])
def test_configure_callbacks_runs_first(tmp_path, scenario):
    assert record("phalanx", scenario, str(tmp_path))[:2] == ["configure_callbacks", "prepare_data"]


RESUMES = [name for name in SCENARIOS if name.startswith("resume")]


def _resumed(calls: list[str]) -> list[str]:
    return calls[calls.index(RESUMED) :]


@pytest.mark.parametrize("scenario", [*RESUMES, STOPPED])
def test_a_resume_restores_the_module_and_callbacks_before_on_fit_start(tmp_path, scenario):
    resumed = _resumed(record("phalanx", scenario, str(tmp_path)))
    order = ["on_load_checkpoint", *CALLBACK_RESTORE, "Callback.on_fit_start", "on_fit_start"]
    assert [call for call in resumed if call in order] == order


@pytest.mark.parametrize(
    ("scenario", "epoch_ends"),
    [(name, 2 if "inside" in name else 1) for name in RESUMES],  # inside: epoch 0 ends, then epoch 1 runs
)
def test_a_resume_starts_only_the_epochs_it_has_not_started(tmp_path, scenario, epoch_ends):
    resumed = _resumed(record("phalanx", scenario, str(tmp_path)))
    assert resumed.count("Callback.on_train_epoch_start") == resumed.count("on_train_epoch_start") == 1
    assert resumed.count("Callback.on_train_epoch_end") == resumed.count("on_train_epoch_end") == epoch_ends


def test_a_resume_after_a_stop_inside_an_epoch_trains_the_rest_of_that_epoch(tmp_path):
    resumed = _resumed(record("phalanx", STOPPED, str(tmp_path)))
    batches = [call for call in resumed if call.startswith("on_train_batch_start")]
    assert batches == [f"on_train_batch_start[{i}]" for i in (2, 3, 0, 1, 2, 3)]
    # on_train_epoch_end ran when max_steps stopped epoch 0: its rest starts again, so starts and ends pair up.
    assert resumed.count("on_train_epoch_start") == resumed.count("on_train_epoch_end") == 2
