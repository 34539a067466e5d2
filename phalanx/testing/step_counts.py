"""Machine-independent counts of the work one training step does: Python calls, aten ops and host-device syncs.

Timings on a shared CPU are noise; counts are not. A :class:`StepWindow` is told where each step starts
(:meth:`StepWindow.at_step`) and, after ``warmup`` steps, counts over ``steps`` steps the Python function calls
(``sys.setprofile``), then over the next ``steps`` steps the aten ops (``torch.profiler``, every level and thread)
and the host-device syncs: ``aten::_local_scalar_dense`` (what ``.item()``, ``float(t)`` and ``bool(t)`` run) and
calls of ``Tensor.cpu``/``tolist``/``numpy`` and ``torch.cuda.synchronize`` (patched while the window is open; each
one waits for the device on a GPU). The two kinds are counted in separate steps so that neither counts the other's
own calls.

    window = StepWindow(warmup=2, steps=4)
    trainer = phalanx.Trainer(..., callbacks=[StepCountCallback(window)], max_steps=window.total_steps)
    trainer.fit(module, data)
    print(window.result())  # StepCounts(python_calls=..., aten_ops=..., syncs=...), per step

:func:`count_loop_steps` counts a hand-written loop the same way, for comparison.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from phalanx.callbacks.callback import Callback
from phalanx.module import TrainingModule
from phalanx.strategies.parallel_dims import MeshAxis
from phalanx.trainer.trainer import Trainer

# Tensor methods that copy to the host (and so wait for the device there); `.item()` is counted by its aten op.
_SYNC_METHODS = ("cpu", "tolist", "numpy")
_SCALAR_READ = "aten::_local_scalar_dense"


@dataclass(frozen=True)
class StepCounts:
    """Work per training step, averaged over a window of steps; ``ops`` and ``sync_calls`` per step by name."""

    python_calls: float
    aten_ops: float
    syncs: float
    ops: dict[str, float] = field(default_factory=dict)
    sync_calls: dict[str, float] = field(default_factory=dict)


def _op_counts(profile: Any) -> Counter[str]:
    """The aten ops a profile recorded, by name, at every level (also those a tensor subclass such as FSDP's DTensor
    runs for its own ops); not the labels of ``record_function`` or of the autograd engine."""
    return Counter(event.name for event in profile.events() if event.name.startswith("aten::"))


class StepWindow:
    """Counts the work of ``steps`` steps after ``warmup`` steps; call :meth:`at_step` at the start of every step."""

    def __init__(self, warmup: int = 2, steps: int = 4) -> None:
        if warmup < 1 or steps < 1:
            raise ValueError(f"StepWindow needs warmup >= 1 and steps >= 1, got warmup={warmup}, steps={steps}.")
        self.warmup = warmup
        self.steps = steps
        self._calls = 0
        self._profile: Any = None
        self._ops: Counter[str] = Counter()
        self._sync_calls: Counter[str] = Counter()
        self._patched: dict[str, Any] = {}
        self._seen = -1

    @property
    def total_steps(self) -> int:
        """The steps a run needs for the window to close: warmup, then two windows of ``steps``, then one more."""
        return self.warmup + 2 * self.steps + 1

    def at_step(self, index: int) -> None:
        """Mark the start of step ``index`` (0-based); opens and closes the counting windows."""
        self._seen = index
        if index == self.warmup:
            sys.setprofile(self._count_call)
        elif index == self.warmup + self.steps:
            sys.setprofile(None)
            self._open_op_window()
        elif index == self.warmup + 2 * self.steps:
            self.close()

    def close(self) -> None:
        """Stop counting (also when a run ends inside a window); idempotent."""
        sys.setprofile(None)
        if self._profile is not None:
            self._profile.__exit__(None, None, None)
            self._ops = _op_counts(self._profile)
            self._profile = None
        for name, original in self._patched.items():
            owner, attr = _owner(name)
            if original is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
        self._patched = {}

    def result(self) -> StepCounts:
        """The counts per step; raises when the run ended before both windows were counted."""
        if self._seen < self.warmup + 2 * self.steps:
            raise RuntimeError(
                f"The run ended at step {self._seen}, before the counting windows closed at step"
                f" {self.warmup + 2 * self.steps}; run at least {self.total_steps} steps."
            )
        per = float(self.steps)
        ops = {name: count / per for name, count in sorted(self._ops.items())}
        sync_calls = {name: count / per for name, count in sorted(self._sync_calls.items())}
        if _SCALAR_READ in self._ops:
            sync_calls["item/float/bool"] = self._ops[_SCALAR_READ] / per
        return StepCounts(
            python_calls=self._calls / per,
            aten_ops=sum(self._ops.values()) / per,
            syncs=sum(sync_calls.values()),
            ops=ops,
            sync_calls=sync_calls,
        )

    def _count_call(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            self._calls += 1

    def _open_op_window(self) -> None:
        for name in (*(f"Tensor.{method}" for method in _SYNC_METHODS), "cuda.synchronize"):
            owner, attr = _owner(name)
            original = owner.__dict__.get(attr)
            self._patched[name] = original
            setattr(owner, attr, self._counting(name, getattr(owner, attr)))
        self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self._profile.__enter__()

    def _counting(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        counter = self._sync_calls

        def counted(*args: Any, **kwargs: Any) -> Any:
            counter[name] += 1
            return function(*args, **kwargs)

        return counted


def _owner(name: str) -> tuple[Any, str]:
    owner, _, attr = name.partition(".")
    return (torch.Tensor if owner == "Tensor" else torch.cuda), attr


class StepCountCallback(Callback):
    """Marks the start of each training batch for a :class:`StepWindow` (the window spans whole batch cycles: the
    loop's work between two ``on_train_batch_start`` calls, data loading included)."""

    def __init__(self, window: StepWindow) -> None:
        self.window = window
        self._index = 0

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self.window.at_step(self._index)
        self._index += 1

    def on_train_end(self, trainer: Any, module: Any) -> None:
        self.window.close()


def count_loop_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Iterable[Any],
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    window: StepWindow,
) -> StepCounts:
    """Count a hand-written loop (forward, backward, step, ``zero_grad(set_to_none=True)``) over ``data``, repeated
    until the window closes."""
    index = 0
    try:
        while index < window.total_steps:
            for batch in data:
                window.at_step(index)
                loss = loss_fn(model, batch)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                index += 1
                if index >= window.total_steps:
                    break
    finally:
        window.close()
    return window.result()


# ---------------------------------------------------------------------------- the reference run of bench and tests
#: How a :class:`CountedModule` logs its loss: not at all, ``self.log("loss", loss)``, with ``prog_bar=True``, or
#: three values (the loss, twice it, its square) as a ``log_dict``.
LOG_MODES = ("none", "log", "prog_bar", "three")
_WIDTH = 32
_BATCH = 16


def counted_data(window: StepWindow) -> DataLoader:
    """One epoch of exactly ``window.total_steps`` batches: no epoch end, validation or checkpoint in the window."""
    generator = torch.Generator().manual_seed(0)
    size = window.total_steps * _BATCH
    inputs = torch.randn(size, _WIDTH, generator=generator)
    return DataLoader(TensorDataset(inputs, torch.randn(size, 1, generator=generator)), batch_size=_BATCH)


def counted_model() -> nn.Module:
    """The tiny MLP every counted run trains."""
    return nn.Sequential(nn.Linear(_WIDTH, 64), nn.ReLU(), nn.Linear(64, 1))


def _mse(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, targets = batch
    return nn.functional.mse_loss(model(inputs), targets)


class CountedModule(TrainingModule):
    """:func:`counted_model` under SGD; logs its loss as ``log_mode`` says; shards itself under model_parallel."""

    def __init__(self, log_mode: str = "none") -> None:
        super().__init__()
        if log_mode not in LOG_MODES:
            raise ValueError(f"log_mode={log_mode!r} is not one of {LOG_MODES}.")
        self.model = counted_model()
        self.log_mode = log_mode

    def configure_model(self) -> None:
        mesh = self.device_mesh  # ModelParallelStrategy's; FSDPStrategy shards the module itself
        if mesh is not None and MeshAxis.DATA.value in (mesh.mesh_dim_names or ()):
            fully_shard(self.model, mesh=mesh[MeshAxis.DATA.value])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = _mse(self.model, batch)
        if self.log_mode == "three":
            self.log_dict({"loss": loss, "twice": loss * 2, "square": loss * loss})
        elif self.log_mode != "none":
            self.log("loss", loss, prog_bar=self.log_mode == "prog_bar")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def count_fit(
    strategy: str, window: StepWindow, *, defaults: bool, log_mode: str = "none", **trainer_kwargs: Any
) -> StepCounts:
    """Count a phalanx fit of :class:`CountedModule` with ``strategy`` on one CPU device. ``defaults=False`` turns the
    logger, progress bar, checkpointing and model summary off; ``True`` leaves them as the Trainer has them."""
    off = dict(logger=False, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    kwargs: dict[str, Any] = {} if defaults else off
    kwargs.update(trainer_kwargs)
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=window.total_steps, num_sanity_val_steps=0,
        callbacks=[StepCountCallback(window)], **kwargs,
    )  # fmt: skip
    trainer.fit(CountedModule(log_mode), counted_data(window))
    return window.result()


def count_loop(window: StepWindow, wrap: str = "none") -> StepCounts:
    """Count the hand-written loop on :func:`counted_model`; ``wrap`` is 'none', 'ddp' (DistributedDataParallel) or
    'fsdp' (``fully_shard``), which need an initialised process group."""
    model = counted_model()
    if wrap == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif wrap == "fsdp":
        fully_shard(model)
    elif wrap != "none":
        raise ValueError(f"wrap={wrap!r} is not one of 'none', 'ddp', 'fsdp'.")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return count_loop_steps(model, optimizer, counted_data(window), _mse, window)


__all__ = [
    "LOG_MODES",
    "CountedModule",
    "StepCountCallback",
    "StepCounts",
    "StepWindow",
    "count_fit",
    "count_loop",
    "count_loop_steps",
    "counted_data",
    "counted_model",
]
