"""The Cohort against Lightning Fabric 2.6 on the same calls, where a Fabric user's loop relies on the behaviour: the
dtypes a set-up module sees and returns under every precision, the keywords ``call`` hands each callback, and the
``device`` of the set-up module and dataloader. Fabric is the oracle where installed; without it those comparisons
skip and the Cohort's own expectations still run."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from phalanx import Cohort, TrainingModule

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
# precision -> (the dtype the module's forward sees, the dtypes it returns). Under '*-mixed' Fabric also casts the
# inputs to the half dtype; the Cohort leaves them as the Trainer does (docs/migrating-from-lightning.md, Fabric).
PRECISIONS = {
    "32-true": (F32, (F32, F32)),
    "64-true": (F64, (F32, F32)),
    "16-true": (F16, (F32, F32)),
    "bf16-true": (BF16, (F32, F32)),
    "bf16-mixed": (F32, (F32, F32)),
    "16-mixed": (F32, (F32, F32)),  # on the CPU both run bfloat16 autocast
}


class Probe(nn.Module):
    """Records the dtype its forward sees; returns a layer's output (autocast) and an elementwise one (no autocast)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 2)
        self.seen: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.seen = x.dtype
        return self.layer(x), x * 2


def _quietly(make: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # '16-mixed' on the CPU says it runs bfloat16
        return make()


def _cohort_run(precision: str) -> tuple[torch.dtype, tuple[torch.dtype, ...]]:
    cohort = _quietly(lambda: Cohort(accelerator="cpu", devices=1, precision=precision))
    model = cohort.setup(Probe())
    outputs = model(torch.randn(4, 3))
    return model.module.seen, tuple(output.dtype for output in outputs)


def _fabric_run(precision: str) -> tuple[torch.dtype, tuple[torch.dtype, ...]]:
    fabric_module = pytest.importorskip("lightning_fabric", reason="Lightning Fabric (the oracle) is not installed")
    fabric = _quietly(lambda: fabric_module.Fabric(accelerator="cpu", devices=1, precision=precision))
    model = fabric.setup(Probe())
    outputs = model(torch.randn(4, 3))
    return model.module.seen, tuple(output.dtype for output in outputs)


# ---------------------------------------------------------------------------- item 1: dtypes in and out
@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_set_up_module_converts_inputs_and_returns_the_default_dtype(precision):
    assert _cohort_run(precision) == PRECISIONS[precision]
    assert torch.get_default_dtype() == F32  # the forward's dtype context was left


@pytest.mark.parametrize("precision", PRECISIONS)
def test_outputs_have_fabrics_dtypes_and_inputs_too_outside_autocast(precision):
    seen, outputs = _cohort_run(precision)
    fabric_seen, fabric_outputs = _fabric_run(precision)
    assert outputs == fabric_outputs  # the loss a ported loop computes has the dtype it has under Fabric
    if not precision.endswith("-mixed"):
        assert seen == fabric_seen


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_training_modules_step_methods_convert_as_its_forward(precision):
    class Steps(TrainingModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(3, 1)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            self.seen = batch.dtype
            return self.layer(batch).sum()

    cohort = _quietly(lambda: Cohort(accelerator="cpu", devices=1, precision=precision))
    model = cohort.setup(Steps())
    loss = model.training_step(torch.randn(4, 3), 0)
    assert (model.module.seen, loss.dtype) == (PRECISIONS[precision][0], F32)


@pytest.mark.parametrize(("precision", "calls"), [("32-true", 0), ("bf16-mixed", 1), ("64-true", 1)])
def test_a_precision_that_changes_no_dtype_costs_no_conversion_call(precision, calls, monkeypatch):
    cohort = _quietly(lambda: Cohort(accelerator="cpu", devices=1, precision=precision))
    model = cohort.setup(Probe())
    plugin = cohort.strategy.precision_plugin
    counted = {"convert_input": 0, "convert_output": 0}
    for name in counted:
        original = getattr(plugin, name)

        def counting(data: Any, name: str = name, original: Any = original) -> Any:
            counted[name] += 1
            return original(data)

        monkeypatch.setattr(plugin, name, counting)
    for _ in range(3):
        model(torch.randn(2, 3))
    # bf16-mixed: its convert_input is the base's (no cast), called like the other precisions' where outputs change
    assert counted == {"convert_input": 3 * calls, "convert_output": 3 * calls}


# ---------------------------------------------------------------------------- item 3: call() hands each its keywords
class AllOfThem:
    def on_epoch(self, epoch: int, loss: float) -> None:
        self.got = {"epoch": epoch, "loss": loss}


class Fewer:
    def on_epoch(self, epoch: int) -> None:
        self.got = {"epoch": epoch}


class NoneOfThem:
    def on_epoch(self) -> None:
        self.got = {}


class Anything:
    def on_epoch(self, **kwargs: Any) -> None:
        self.got = kwargs


class SomeAndRest:
    def on_epoch(self, loss: float, **rest: Any) -> None:
        self.got = {"loss": loss, **rest}


class Positional:
    def on_epoch(self, stage: str, epoch: int = -1) -> None:
        self.got = {"stage": stage, "epoch": epoch}


class Lacking:
    """Has no on_epoch: skipped."""


SHAPES = [AllOfThem, Fewer, NoneOfThem, Anything, SomeAndRest, Lacking]


def _received(make_driver: Any, shapes: list[type], *args: Any, **kwargs: Any) -> list[Any]:
    """What each callback received (a callback that needs a keyword not given raises, and the later ones are not
    called)."""
    callbacks = [shape() for shape in shapes]
    try:
        make_driver(callbacks).call("on_epoch", *args, **kwargs)
    except TypeError as error:
        raised = [f"raised {type(error).__name__}"]
    else:
        raised = []
    return [getattr(callback, "got", "not called") for callback in callbacks] + raised


def _fabric(callbacks: list[Any]) -> Any:
    fabric_module = pytest.importorskip("lightning_fabric", reason="Lightning Fabric (the oracle) is not installed")
    return fabric_module.Fabric(accelerator="cpu", devices=1, callbacks=callbacks)


def _cohort(callbacks: list[Any]) -> Any:
    return Cohort(accelerator="cpu", devices=1, callbacks=callbacks)


def test_each_callback_gets_the_keywords_its_method_takes():
    assert _received(_cohort, SHAPES, epoch=3, loss=0.5) == [
        {"epoch": 3, "loss": 0.5},
        {"epoch": 3},
        {},
        {"epoch": 3, "loss": 0.5},
        {"loss": 0.5, "epoch": 3},
        "not called",
    ]


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((), {"epoch": 3, "loss": 0.5}), ((), {"epoch": 1}), ((), {}), (("fit",), {"epoch": 2, "loss": 0.1})],
    ids=["all", "one", "none", "positional-and-keywords"],
)
def test_call_hands_out_the_keywords_fabric_hands_out(args, kwargs):
    shapes = [Positional] if args else [shape for shape in SHAPES if shape is not Positional]
    assert _received(_cohort, shapes, *args, **kwargs) == _received(_fabric, shapes, *args, **kwargs)


def test_a_callback_attribute_that_is_no_method_is_skipped_with_a_warning():
    class NotCallable:
        on_epoch = 5

    with pytest.warns(UserWarning, match="Cohort.call: skipped NotCallable.on_epoch, which is not callable"):
        assert _received(_cohort, [NotCallable, Fewer], epoch=4)[1] == {"epoch": 4}


# ---------------------------------------------------------------------------- item 6: .device
def test_the_set_up_module_and_dataloaders_name_their_device():
    cohort = Cohort(accelerator="cpu", devices=1)
    model = cohort.setup(nn.Linear(2, 1))
    data = DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2)
    moved, kept = cohort.setup_dataloaders(data, data, move_to_device=True), None
    kept = cohort.setup_dataloaders(data, move_to_device=False)
    assert model.device == cohort.device == torch.device("cpu")
    assert [loader.device for loader in moved] == [torch.device("cpu")] * 2
    assert kept.device is None  # as Fabric's: batches are left where they are


def test_device_answers_as_fabrics_does():
    fabric_module = pytest.importorskip("lightning_fabric", reason="Lightning Fabric (the oracle) is not installed")
    fabric = fabric_module.Fabric(accelerator="cpu", devices=1)
    data = DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2)
    cohort = Cohort(accelerator="cpu", devices=1)
    for driver in (fabric, cohort):
        model = driver.setup(nn.Linear(2, 1))
        assert model.device == torch.device("cpu")
        assert driver.setup_dataloaders(data).device == torch.device("cpu")
        assert driver.setup_dataloaders(data, move_to_device=False).device is None
