"""DeepSpeedPrecision: the precision of a DeepSpeed engine, which keeps its own float32 master weights and loss scale.

DeepSpeed does mixed precision its own way: with float16 or bfloat16 enabled in its config, the engine holds the model
in the half dtype, keeps float32 master weights (partitioned under ZeRO) in its optimizer, and scales the loss itself
for float16. So this plugin never autocasts: it casts the model and the floating-point inputs to the half dtype and
hands backward and the optimizer step to the engine. '-true' additionally makes the half dtype torch's default while
the model is created and while a step runs (as ``HalfPrecision`` does).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from phalanx.plugins.precision.half import cast_floating, default_dtype
from phalanx.plugins.precision.precision import BeforeStep, ModuleT, Precision

DEEPSPEED_PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
_DTYPES = {"32": torch.float32, "16": torch.float16, "bf16": torch.bfloat16}


def _is_partitioned(parameter: Tensor) -> bool:
    """Whether ``parameter`` is managed by ZeRO-3 (its data lives in shards; ``.to()`` would not reach them)."""
    return hasattr(parameter, "ds_id")


class DeepSpeedPrecision(Precision):
    """Precision for ``DeepSpeedStrategy``: '32-true', '16-mixed', 'bf16-mixed', '16-true' or 'bf16-true'."""

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in DEEPSPEED_PRECISIONS:
            raise ValueError(f"DeepSpeedPrecision supports {list(DEEPSPEED_PRECISIONS)}, got precision={precision!r}.")
        self.precision = precision
        self.dtype = _DTYPES[precision.split("-")[0]]
        # The gradient clipping DeepSpeed applies inside engine.step() (set by the strategy from its config).
        self.engine_gradient_clipping: float = 0.0

    # ------------------------------------------------------------------ what the DeepSpeed config needs
    def deepspeed_config(self) -> dict[str, Any]:
        """The 'fp16' / 'bf16' sections of a DeepSpeed config for this precision (empty for '32-true')."""
        if self.dtype is torch.float16:
            return {"fp16": {"enabled": True}}
        if self.dtype is torch.bfloat16:
            return {"bf16": {"enabled": True}}
        return {}

    # ------------------------------------------------------------------ dtypes
    def convert_module(self, module: ModuleT) -> ModuleT:
        """Cast to the half dtype (what the engine does anyway); ZeRO-3 shards were already created in that dtype."""
        if self.dtype is torch.float32 or any(_is_partitioned(p) for p in module.parameters()):
            return module
        return module.to(dtype=self.dtype)

    def convert_input(self, data: Any) -> Any:
        """Cast floating-point inputs to the model's dtype."""
        if self.dtype is torch.float32:
            return data
        return cast_floating(data, self.dtype)

    def convert_output(self, data: Any) -> Any:
        """Cast floating-point outputs back to torch's default dtype (the engine computes in the half dtype)."""
        if self.dtype is torch.float32:
            return data
        return cast_floating(data, torch.get_default_dtype())

    @property
    def converts_io(self) -> bool:
        """Everything but '32-true' changes dtypes."""
        return self.dtype is not torch.float32

    def tensor_init_context(self) -> AbstractContextManager:
        """With '-true', new floating tensors default to the half dtype."""
        return (
            default_dtype(self.dtype)
            if self.precision.endswith("-true") and self.dtype is not torch.float32
            else nullcontext()
        )

    def forward_context(self) -> AbstractContextManager:
        """With '-true', tensors created inside a step default to the half dtype; no autocast in any case."""
        return self.tensor_init_context()

    # ------------------------------------------------------------------ backward and step go through the engine
    def backward(
        self, tensor: Tensor, module: nn.Module | None, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> None:
        """``engine.backward(loss)``: the engine scales the loss (accumulation, float16) and reduces gradients."""
        backward = getattr(module, "backward", None)
        if module is None or not hasattr(module, "is_gradient_accumulation_boundary") or backward is None:
            raise RuntimeError(
                "DeepSpeedPrecision.backward needs the DeepSpeed engine; "
                "it is created by DeepSpeedStrategy.setup() when fitting."
            )
        backward(tensor, *args, **kwargs)

    def optimizer_step(
        self,
        optimizer: Any,
        model: nn.Module | None,
        closure: Callable[[], Any],
        *,
        before_step: BeforeStep | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run the closure (forward and backward), ``before_step`` (hooks, clipping checks), then ``engine.step()``."""
        if model is None or not hasattr(model, "is_gradient_accumulation_boundary"):
            raise RuntimeError("DeepSpeedPrecision.optimizer_step needs the DeepSpeed engine as `model`.")
        module = getattr(model, "module", None)
        result = closure()
        if result is None and getattr(module, "automatic_optimization", False):
            raise RuntimeError(
                "training_step returned None, which skips the batch; DeepSpeed cannot skip a step of its engine"
                " (its gradient accumulation and loss scaling count every batch). Return the loss for every batch."
            )
        self._after_closure(optimizer, before_step)
        model.step(**kwargs)  # type: ignore[operator]  # the DeepSpeed engine's step (checked above), not a tensor
        return result

    def clip_gradients(
        self, optimizer: Optimizer, clip_val: float | int, gradient_clip_algorithm: str = "norm"
    ) -> Tensor | None:
        """DeepSpeed clips by norm inside ``engine.step()`` with the config's 'gradient_clipping'; nothing to do here.

        Asking for anything else (by value, or another threshold) is refused rather than silently ignored.
        """
        self._check_clip_algorithm(gradient_clip_algorithm)
        if clip_val <= 0:
            return None
        if gradient_clip_algorithm != "norm":
            raise ValueError("DeepSpeed clips gradients by norm only; use gradient_clip_algorithm='norm'.")
        if float(clip_val) != float(self.engine_gradient_clipping):
            raise ValueError(
                f"DeepSpeed clips gradients inside engine.step() with the config's 'gradient_clipping'"
                f" ({self.engine_gradient_clipping}); clipping to {clip_val} here cannot work. Set the threshold with"
                " Trainer(gradient_clip_val=...) or 'gradient_clipping' in the DeepSpeed config"
                " (DeepSpeedStrategy(config={'gradient_clipping': ...}) when you drive it from a Cohort)."
            )
        return None
