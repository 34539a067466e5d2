"""The Precision plugin base: full float32 training, and the hooks every precision plugin implements."""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, ClassVar, TypeVar

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from phalanx.utilities.grad_clipping import clip_grad_norm

_NULL = nullcontext()
#: What runs once gradients are final, before the update (the strategy passes ``RunSettings.before_optimizer_step``).
BeforeStep = Callable[[Optimizer], None]
#: A precision returns the module it converts (cast in place), so the caller keeps its type.
ModuleT = TypeVar("ModuleT", bound=nn.Module)
_CLOSURE_ONCE: dict[type, bool] = {}


def evaluates_closure_once(optimizer: Optimizer) -> bool:
    """Whether the closure can be run before ``step()`` instead of being passed to it.

    True for torch's own optimizers, which call a closure once before updating (all but LBFGS), and for optimizers
    whose ``step`` takes no closure at all (e.g. PostLocalSGDOptimizer). Others (LBFGS, SAM-like optimizers) may
    re-evaluate the closure, so they always get it.
    """
    kind = type(optimizer)
    known = _CLOSURE_ONCE.get(kind)
    if known is None:
        torch_builtin = kind.__module__.startswith("torch.optim.") and not issubclass(kind, torch.optim.LBFGS)
        try:
            takes_closure = "closure" in inspect.signature(kind.step).parameters
        except (TypeError, ValueError):
            takes_closure = True
        known = _CLOSURE_ONCE[kind] = torch_builtin or not takes_closure
    return known


def _inherits(cls: type, *names: str) -> bool:
    """Whether ``cls`` still has ``Precision``'s own version of each method ``names``."""
    return all(getattr(cls, name) is getattr(Precision, name) for name in names)


class Precision:
    """Float32 training; subclasses change dtypes, autocast and loss scaling."""

    precision: str = "32-true"
    # Set for each subclass: which step methods are still the base's pass-throughs, so that the strategy's step can
    # skip calling them (a call each per step, for nothing, on the plain float32 path).
    #: train_step_context and forward_context are the base's (no context around training_step).
    _plain_forward: ClassVar[bool] = True
    #: pre_backward and post_backward are the base's (they return the loss as is).
    _plain_backward_hooks: ClassVar[bool] = True
    #: _after_closure is the base's (it only runs ``before_step``).
    _plain_after_closure: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._plain_forward = _inherits(cls, "train_step_context", "forward_context")
        cls._plain_backward_hooks = _inherits(cls, "pre_backward", "post_backward")
        cls._plain_after_closure = _inherits(cls, "_after_closure")

    def convert_module(self, module: ModuleT) -> ModuleT:
        """Convert the module's parameters and buffers to this precision."""
        return module

    def convert_input(self, data: Any) -> Any:
        """Convert a batch (already on the device) to this precision."""
        return data

    def convert_output(self, data: Any) -> Any:
        """Convert a forward's outputs back to torch's default dtype (Fabric's name); float32 needs nothing."""
        return data

    @property
    def converts_io(self) -> bool:
        """Whether ``convert_input`` / ``convert_output`` can change a dtype; where not, a module wrapper skips them."""
        return False

    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        """Wrap the model, optimizers and schedulers if this precision needs to."""
        return model, optimizers, lr_schedulers

    def tensor_init_context(self) -> AbstractContextManager:
        """Context in which tensors are created with this precision's dtype."""
        return _NULL

    def module_init_context(self) -> AbstractContextManager:
        """Context in which a module is built with this precision's dtype."""
        return self.tensor_init_context()

    def forward_context(self) -> AbstractContextManager:
        """Context for a forward pass (autocast for mixed precision)."""
        return _NULL

    def train_step_context(self) -> AbstractContextManager:
        """Context around ``training_step``."""
        return self.forward_context()

    def val_step_context(self) -> AbstractContextManager:
        """Context around ``validation_step``."""
        return self.forward_context()

    def test_step_context(self) -> AbstractContextManager:
        """Context around ``test_step``."""
        return self.forward_context()

    def predict_step_context(self) -> AbstractContextManager:
        """Context around ``predict_step``."""
        return self.forward_context()

    def pre_backward(self, tensor: Tensor, module: nn.Module | None) -> Tensor:
        """Called before ``backward``; may transform the loss (e.g. scale it)."""
        return tensor

    def backward(
        self, tensor: Tensor, module: nn.Module | None, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> None:
        """Run backward on ``tensor`` (the module's ``backward`` hook if it defines one)."""
        backward = getattr(module, "backward", None)
        if backward is not None:
            backward(tensor, *args, **kwargs)
        else:
            tensor.backward(*args, **kwargs)

    def post_backward(self, tensor: Tensor, module: nn.Module | None) -> Tensor:
        """Called after ``backward``."""
        return tensor

    def optimizer_step(
        self,
        optimizer: Optimizer,
        model: nn.Module | None,
        closure: Callable[[], Any],
        *,
        before_step: BeforeStep | None = None,
        **kwargs: Any,
    ) -> Any:
        """Step ``optimizer``: ``closure`` (passed on, for LBFGS-like optimizers), then ``before_step``, the update."""
        once = _CLOSURE_ONCE.get(type(optimizer))  # evaluates_closure_once's cache, read here: every step
        if once or (once is None and evaluates_closure_once(optimizer)):
            # Same result as optimizer.step(closure=...) for these optimizers, without its per-step overhead.
            result = closure()
            if not self._plain_after_closure:
                self._after_closure(optimizer, before_step)
            elif before_step is not None:
                before_step(optimizer)
            optimizer.step(**kwargs)
            return result
        return optimizer.step(closure=self._wrap_closure(optimizer, closure, before_step), **kwargs)

    def _wrap_closure(
        self, optimizer: Optimizer, closure: Callable[[], Any], before_step: BeforeStep | None
    ) -> Callable[[], Any]:
        """``closure``, followed by ``_after_closure``: what ``optimizer.step(closure=...)`` receives."""

        def closure_then_prepare_step() -> Any:
            result = closure()
            self._after_closure(optimizer, before_step)
            return result

        return closure_then_prepare_step

    def _after_closure(self, optimizer: Optimizer, before_step: BeforeStep | None) -> None:
        """Gradients are final here: run the driver's ``before_step`` (on_before_optimizer_step hooks, clipping)."""
        if before_step is not None:
            before_step(optimizer)

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Bring gradients back to their true scale (no-op without loss scaling)."""

    def clip_gradients(
        self, optimizer: Optimizer, clip_val: float | int, gradient_clip_algorithm: str = "norm"
    ) -> Tensor | None:
        """Clip ``optimizer``'s gradients by total norm or by value; return the total norm when clipping by norm."""
        # Check the algorithm first: a typo must fail on the first step, not only once gradients exist.
        self._check_clip_algorithm(gradient_clip_algorithm)
        parameters = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not parameters or clip_val <= 0:
            return None
        if gradient_clip_algorithm == "norm":
            return clip_grad_norm(parameters, clip_val)
        torch.nn.utils.clip_grad_value_(parameters, clip_val)
        return None

    @staticmethod
    def _check_clip_algorithm(gradient_clip_algorithm: str) -> None:
        """Raise ValueError unless ``gradient_clip_algorithm`` is 'norm' or 'value'."""
        if gradient_clip_algorithm not in ("norm", "value"):
            raise ValueError(
                f"gradient_clip_algorithm={gradient_clip_algorithm!r} is not valid; choose 'norm' or 'value'."
            )

    def state_dict(self) -> dict[str, Any]:
        """Return the plugin's state for a checkpoint (e.g. the loss scaler)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the plugin's state from a checkpoint."""

    def teardown(self) -> None:
        """Undo global changes the plugin made."""
