"""16-mixed through the Trainer with a GradScaler: ``on_before_optimizer_step`` sees unscaled gradients.

On a step the scaler keeps, the hook's gradient norm equals a float32 run's on the same weights and batch; on a step
whose scaled gradients overflowed, the hook sees a non-finite norm and the scaler skips the update. The second case is
what the H100 run of ``tests/gpu`` met (issue 26): float16's range overflows on the first steps at the default scale
of 65536, so the GPU test now checks only the steps the scaler kept.
"""

from __future__ import annotations

import math

import pytest
import torch
from phalanx_testing import Regressor, loaders, quiet_trainer
from torch import nn

from phalanx.plugins.precision import MixedPrecision


class _NormProbe(Regressor):
    """Records, per step, the batch index, the total gradient norm and the scale in ``on_before_optimizer_step``."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, float, float]] = []
        self._batch_idx = -1

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        self._batch_idx = batch_idx

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.parameters()])).item()
        scale = self.trainer.strategy.precision_plugin.scaler.get_scale()
        self.seen.append((self._batch_idx, norm, scale))


def _float32_norm(initial: dict[str, torch.Tensor], batch_idx: int) -> float:
    """The total gradient norm of a float32 backward on ``initial`` weights and batch ``batch_idx``."""
    model = Regressor()
    model.load_state_dict(initial)
    x, y = list(loaders(shuffle=False)[0])[batch_idx]
    nn.functional.mse_loss(model(x), y).backward()
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()


def _fit_16_mixed(init_scale: float, steps: int) -> tuple[_NormProbe, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = _NormProbe()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    plugin = MixedPrecision("16-mixed", device="cpu", scaler=scaler)
    quiet_trainer(plugins=[plugin], max_steps=steps, gradient_clip_val=1e9).fit(model, loaders(shuffle=False)[0])
    return model, initial


@pytest.mark.parametrize("init_scale", [2.0**4, 2.0**8, 2.0**12])
def test_the_hook_sees_gradients_equal_to_float32_on_a_step_the_scaler_kept(init_scale: float) -> None:
    model, initial = _fit_16_mixed(init_scale, steps=1)
    [(batch_idx, norm, scale)] = model.seen
    assert math.isfinite(norm) and scale == init_scale  # the scaler kept this step
    # Scaled gradients would be init_scale (16 to 4096) times larger; float16 autocast costs about 1e-3 relative.
    assert norm == pytest.approx(_float32_norm(initial, batch_idx), rel=2e-2)


@pytest.mark.parametrize("init_scale", [2.0**16, 2.0**20])
def test_on_an_overflowing_step_the_hook_sees_a_non_finite_norm_and_the_step_is_skipped(init_scale: float) -> None:
    model, initial = _fit_16_mixed(init_scale, steps=8)
    overflowed = [step for step in model.seen if not math.isfinite(step[1])]
    kept = [step for step in model.seen if math.isfinite(step[1])]
    assert overflowed and kept, model.seen  # the default scale overflows float16 on this model, as on the H100
    assert model.seen[: len(overflowed)] == overflowed  # overflows come first, until the scale has backed off
    assert all(scale < init_scale for _, _, scale in kept)  # each overflow halved the scale
    # Skipped steps left the weights alone, so the first kept step matches float32 on the initial weights.
    batch_idx, norm, _ = kept[0]
    assert norm == pytest.approx(_float32_norm(initial, batch_idx), rel=2e-2)
    assert all(norm < 1e4 for _, norm, _ in kept)
