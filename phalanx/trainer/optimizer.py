"""The optimizer handle of ``TrainingModule.optimizers()`` and of the ``optimizer_step`` hook."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from torch.optim import Optimizer

if TYPE_CHECKING:
    from phalanx.trainer.trainer import Trainer


def _no_closure() -> None:
    return None


class ManualOptimizer:
    """Wraps a torch optimizer so that ``step()`` goes through the strategy and precision plugin.

    With manual optimization each ``step()`` counts as a global step; with automatic optimization (the handle given to
    ``TrainingModule.optimizer_step``) the training loop counts its steps, one per stepping batch, as in Lightning.
    """

    def __init__(self, optimizer: Optimizer, trainer: Trainer | None) -> None:
        self.optimizer = optimizer
        self._trainer = trainer
        # Inside the optimizer_step hook: what step() without a closure runs (the loss of the closure already run).
        self._closure_if_none: Callable[[], Any] | None = None

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Run the optimizer step (closure, loss scaling, clipping, hooks); in manual optimization advance
        ``global_step``."""
        trainer = self._trainer
        if trainer is None:
            raise RuntimeError(
                "This optimizer handle is a copy (pickled or deep-copied) and is detached from the Trainer; call"
                " self.optimizers() in the TrainingModule for a handle that steps."
            )
        if closure is None:
            closure = self.__dict__.get("_closure_if_none") or _no_closure
        module = trainer.strategy.module
        result = trainer.strategy.optimizer_step(self.optimizer, closure, module, **kwargs)
        if module is None or not module.automatic_optimization:
            trainer.fit_loop.global_step += 1
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups."""
        return self.optimizer.param_groups

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the handle lacks. While pickle or copy rebuild a handle, "optimizer" itself is not
        # there yet: looking it up through __getattr__ again would recurse forever.
        if name == "optimizer" or (name.startswith("__") and name.endswith("__")):
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __getstate__(self) -> dict[str, Any]:
        # The wrapped optimizer travels; the Trainer (threads, files, the process group) does not.
        return {"optimizer": self.optimizer, "_trainer": None, "_closure_if_none": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"ManualOptimizer({self.optimizer!r})"
