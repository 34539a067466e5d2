"""Single-GPU training: run on a machine with CUDA (skipped elsewhere)."""

from __future__ import annotations

import math

import pytest
import torch
from phalanx_testing import Regressor, loaders, quiet_trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("precision", ["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"])
def test_fit_on_one_gpu(precision):
    if "bf16" in precision and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")
    model = Regressor()
    trainer = quiet_trainer(accelerator="cuda", devices=1, precision=precision, max_epochs=3)
    before = trainer.validate(model, loaders()[1], verbose=False)[0]["val_loss"]
    trainer.fit(model, *loaders())
    after = trainer.validate(model, loaders()[1], verbose=False)[0]["val_loss"]
    assert trainer.strategy.root_device.type == "cuda"
    assert after < before
    if precision == "16-mixed":
        assert trainer.strategy.precision_plugin.scaler is not None


def test_16_mixed_clipping_sees_unscaled_gradients():
    # The default scale (65536) overflows float16 on this model's first steps: the hook then sees a non-finite norm
    # and the scaler skips the step (as in Lightning). On every step the scaler keeps, the norm is the true one.
    seen: list[tuple[float, float]] = []

    class Probe(Regressor):
        def on_before_optimizer_step(self, optimizer):
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.parameters()])).item()
            seen.append((norm, self.trainer.strategy.precision_plugin.scaler.get_scale()))

    quiet_trainer(accelerator="cuda", precision="16-mixed", max_steps=8, gradient_clip_val=1e9).fit(
        Probe(), loaders()[0]
    )
    kept = [norm for norm, _ in seen if math.isfinite(norm)]
    assert kept, f"the scaler skipped every step: {seen}"
    assert all(norm < 1e4 for norm in kept), seen  # scaled gradients would be thousands of times larger


def test_tensor_init_context_creates_parameters_on_the_gpu():
    class Built(Regressor):
        def configure_model(self):
            if getattr(self, "head", None) is None:
                self.head = torch.nn.Linear(1, 1)

    model = Built()
    quiet_trainer(accelerator="cuda", max_steps=1).fit(model, loaders()[0])
    assert model.head.weight.device.type in ("cuda", "cpu")  # built on the GPU; teardown may move it back
