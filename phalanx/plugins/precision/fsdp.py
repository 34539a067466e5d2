"""FSDPPrecision: the precision of a model sharded with FSDP2, as a mixed-precision policy plus the usual contexts."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from phalanx.plugins.precision.amp import MixedPrecision
from phalanx.plugins.precision.half import HalfPrecision
from phalanx.plugins.precision.precision import BeforeStep, ModuleT, Precision

FSDP_PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")


class FSDPPrecision(Precision):
    """Precision for FSDPStrategy: FSDP2's ``MixedPrecisionPolicy`` for the all-gathered parameters, autocast around
    steps.

    ``"bf16-mixed"`` keeps float32 sharded parameters and optimizer state, computes with bfloat16 copies gathered for
    each layer, and reduces gradients in float32. ``"*-true"`` casts the whole model.
    """

    def __init__(
        self, precision: str = "32-true", device: str = "cpu", scaler: torch.amp.GradScaler | None = None
    ) -> None:
        if precision not in FSDP_PRECISIONS:
            raise ValueError(
                f"FSDPPrecision does not support precision={precision!r}; choose one of {list(FSDP_PRECISIONS)}."
            )
        self.precision = precision
        self.device = device
        # The plain plugin of the same precision does the per-step work (autocast, loss scaling, casting).
        if precision.endswith("-mixed"):
            self._inner: Precision = MixedPrecision(precision, device=device, scaler=scaler)
        elif precision.endswith("-true") and precision != "32-true":
            self._inner = HalfPrecision(precision)
        else:
            self._inner = Precision()

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The GradScaler of '16-mixed' (None without one)."""
        return getattr(self._inner, "scaler", None)

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The dtype parameters are gathered in for compute (None: their own)."""
        return {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(self.precision)

    def mixed_precision_policy(self) -> Any:
        """The ``MixedPrecisionPolicy`` for ``fully_shard`` (None when parameters compute in their own dtype)."""
        if self.param_dtype is None:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32)

    # The rest is the plain plugin's behaviour.
    def convert_module(self, module: ModuleT) -> ModuleT:
        """Cast the module for '*-true' precisions."""
        return self._inner.convert_module(module)

    def convert_input(self, data: Any) -> Any:
        """Cast floating-point inputs for '*-true' precisions."""
        return self._inner.convert_input(data)

    def convert_output(self, data: Any) -> Any:
        """Cast floating-point outputs back to torch's default dtype (except for '32-true')."""
        return self._inner.convert_output(data)

    @property
    def converts_io(self) -> bool:
        """As the plain plugin of the same precision."""
        return self._inner.converts_io

    def tensor_init_context(self) -> AbstractContextManager:
        """Create tensors in the precision's dtype ('*-true')."""
        return self._inner.tensor_init_context()

    def forward_context(self) -> AbstractContextManager:
        """Autocast for '*-mixed' (ops that need float32, such as softmax, keep it)."""
        return self._inner.forward_context()

    def pre_backward(self, tensor: Tensor, module: nn.Module | None) -> Tensor:
        """Scale the loss under a GradScaler."""
        return self._inner.pre_backward(tensor, module)

    def optimizer_step(
        self,
        optimizer: Optimizer,
        model: nn.Module | None,
        closure: Callable[[], Any],
        *,
        before_step: BeforeStep | None = None,
        **kwargs: Any,
    ) -> Any:
        """Step through the plain plugin (unscaling first under a GradScaler)."""
        return self._inner.optimizer_step(optimizer, model, closure, before_step=before_step, **kwargs)

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Unscale gradients under a GradScaler."""
        self._inner.unscale_gradients(optimizer)

    def clip_gradients(
        self, optimizer: Optimizer, clip_val: float | int, gradient_clip_algorithm: str = "norm"
    ) -> Tensor | None:
        """Clip sharded gradients; the norm is over the whole model (torch reduces it across shards)."""
        norm = self._inner.clip_gradients(optimizer, clip_val, gradient_clip_algorithm)
        full_tensor = getattr(norm, "full_tensor", None)
        return full_tensor() if full_tensor is not None else norm

    def state_dict(self) -> dict[str, Any]:
        """The GradScaler's state, if any."""
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the GradScaler's state."""
        self._inner.load_state_dict(state_dict)

    def teardown(self) -> None:
        """Undo what the plain plugin changed."""
        self._inner.teardown()
