"""What ``Cohort.setup`` hands back: the set-up module, optimizers and dataloaders, routed through the strategy."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import nn
from torch.optim import Optimizer

if TYPE_CHECKING:
    from phalanx.cohort.backward_guard import BackwardGuard
    from phalanx.strategies.strategy import Strategy

#: TrainingModule step methods that must run inside the wrapper's forward (DDP's reducer, FSDP's gathering).
_STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


class CohortModule(nn.Module):
    """The module as the strategy runs it (DDP-wrapped, sharded, a DeepSpeed engine), called like the original.

    ``forward`` runs the wrapper under the precision's forward context; ``training_step`` & co. of a TrainingModule
    run through the wrapper's forward too. Every other attribute, and ``state_dict`` / ``load_state_dict``, belong
    to the original module, so the names in checkpoints are the plain module's.
    """

    def __init__(self, strategy: Strategy, guard: BackwardGuard | None = None) -> None:
        super().__init__()
        assert strategy.model is not None and strategy.module is not None
        # Registered as a submodule so that .parameters(), .train(), .to() reach the wrapped module.
        self._forward_module = strategy.model
        self.__dict__["_original_module"] = strategy.module
        self.__dict__["_strategy"] = strategy
        # Only where loss.backward() would train differently from cohort.backward(loss); None costs nothing per step.
        self.__dict__["_guard"] = guard
        # As Fabric's module: inputs in the precision's dtype, outputs back in torch's default one (a loss computed on
        # them has the dtype it has under Fabric). Decided once: a precision that changes no dtype costs no call.
        self.__dict__["_converts_io"] = strategy.precision_plugin.converts_io

    @property
    def module(self) -> nn.Module:
        """The user's module, unwrapped."""
        return self.__dict__["_original_module"]

    @property
    def device(self) -> torch.device:
        """The device the module computes on (the strategy's root device)."""
        return self.__dict__["_strategy"].root_device

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        precision = self.__dict__["_strategy"].precision_plugin
        converts = self.__dict__["_converts_io"]
        if converts:
            args, kwargs = precision.convert_input((args, kwargs))
        with precision.forward_context():
            output = self._forward_module(*args, **kwargs)
        if converts:
            output = precision.convert_output(output)
        guard = self.__dict__["_guard"]
        return output if guard is None else guard.watch(output)

    def cohort_backward_context(self) -> AbstractContextManager:
        """Where ``cohort.backward`` runs the strategy's backward: the outputs' gradients are expected there."""
        guard = self.__dict__["_guard"]
        return nullcontext() if guard is None else guard.allowed()

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return self.module.load_state_dict(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # parameters, buffers and submodules registered here
        except AttributeError:
            pass
        original = self.__dict__["_original_module"]
        if name in _STEP_METHODS and hasattr(original, name):
            strategy = self.__dict__["_strategy"]
            step = getattr(strategy, name)
            if self.__dict__["_converts_io"]:  # as forward: Fabric runs step methods through its forward
                step = _converting(step, strategy.precision_plugin)
            guard = self.__dict__["_guard"]
            return step if guard is None else lambda *args, **kwargs: guard.watch(step(*args, **kwargs))
        return getattr(original, name)


def _converting(step: Callable[..., Any], precision: Any) -> Callable[..., Any]:
    """``step`` with its inputs converted to the precision's dtype and its outputs back to the default one."""

    def converted(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = precision.convert_input((args, kwargs))
        return precision.convert_output(step(*args, **kwargs))

    return converted


class _OptimizerView:
    """Mixed into a subclass of the optimizer's class: every attribute is the optimizer's, ``step`` goes through the
    strategy.

    The view keeps its own ``__dict__`` for what is set on it (an LR scheduler patches ``step`` there), so nothing it
    is given lands on the optimizer, which the strategy steps with its own class's ``step``.
    """

    _cohort_optimizer: Optimizer
    _cohort_step: Callable[[Optimizer, Callable[[], Any] | None], Any]
    _SHARED = ("param_groups", "state", "defaults")

    @property
    def optimizer(self) -> Optimizer:
        """The optimizer behind this view."""
        return self._cohort_optimizer

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        return type(self)._cohort_step(self._cohort_optimizer, closure)

    def state_dict(self) -> dict[str, Any]:
        return self._cohort_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._cohort_optimizer.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        return getattr(type(self)._cohort_optimizer, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OptimizerView._SHARED:
            setattr(type(self)._cohort_optimizer, name, value)
        else:
            object.__setattr__(self, name, value)

    def __getstate__(self) -> Any:
        return type(self)._cohort_optimizer.__getstate__()

    def __repr__(self) -> str:
        return f"Cohort view of {type(self)._cohort_optimizer!r}"


def wrap_optimizer(optimizer: Optimizer, step: Callable[[Optimizer, Callable[[], Any] | None], Any]) -> Optimizer:
    """A view of ``optimizer`` that is an instance of its class (LR schedulers accept it) and steps through ``step``."""
    kind = type(optimizer)
    namespace = {"_cohort_optimizer": optimizer, "_cohort_step": staticmethod(step), "__module__": kind.__module__}
    view_class = type(f"Cohort{kind.__name__}", (_OptimizerView, kind), namespace)
    return view_class.__new__(view_class)


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer behind a ``wrap_optimizer`` wrapper (others unchanged)."""
    return type(optimizer)._cohort_optimizer if isinstance(optimizer, _OptimizerView) else optimizer


class CohortDataLoader:
    """A dataloader whose batches arrive on the strategy's device; each new iteration is a new sampler epoch."""

    def __init__(self, dataloader: Any, strategy: Strategy | None) -> None:
        self._dataloader = dataloader
        self._strategy = strategy
        self._epoch = 0

    @property
    def dataloader(self) -> Any:
        """The wrapped dataloader."""
        return self._dataloader

    @property
    def device(self) -> torch.device | None:
        """The device batches are moved to; None with ``setup_dataloaders(..., move_to_device=False)``."""
        return None if self._strategy is None else self._strategy.root_device

    def __len__(self) -> int:
        return len(self._dataloader)

    def set_epoch(self, epoch: int) -> None:
        """Iterate as epoch ``epoch`` next (the distributed sampler's shuffle), e.g. when resuming a run; later
        iterations count on from it."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"CohortDataLoader.set_epoch(epoch={epoch!r}) takes an int >= 0.")
        self._epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        # As DistributedSampler asks: every rank calls set_epoch with the same value before each epoch.
        for sampler in (
            getattr(self._dataloader, "sampler", None),
            getattr(getattr(self._dataloader, "batch_sampler", None), "sampler", None),
        ):
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(self._epoch)
        self._epoch += 1
        strategy = self._strategy
        for batch in self._dataloader:
            yield batch if strategy is None else strategy.batch_to_device(batch)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._dataloader, name)
