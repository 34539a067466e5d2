"""MixedPrecision.autocast_context_manager(), as in Lightning: a new torch.autocast for the plugin's device and dtype,
and the context of every forward pass, so that a subclass overriding it changes how steps autocast."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from phalanx_testing import Regressor, quiet_trainer, regression_data
from torch.utils.data import DataLoader

from phalanx.plugins.precision import MixedPrecision


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)])
def test_autocast_context_manager_autocasts_to_the_plugin_dtype(precision, dtype):
    plugin = MixedPrecision(precision, device="cpu")
    manager = plugin.autocast_context_manager()
    assert isinstance(manager, torch.autocast)
    assert manager is not plugin.autocast_context_manager()  # a new one each time, usable in nested code
    with manager:
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == dtype


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_a_weight_updated_inside_the_context_is_cast_again(precision):
    # Manual optimization steps an optimizer inside training_step's autocast: the next forward must see the update.
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with MixedPrecision(precision, device="cpu").autocast_context_manager():
        before = layer(x)
        with torch.no_grad():
            layer.weight.add_(10.0)
        after = layer(x)
    assert not torch.equal(before, after)


class CountingMixed(MixedPrecision):
    """Lightning users override autocast_context_manager to change how forward passes autocast."""

    def autocast_context_manager(self) -> torch.autocast:
        self.entered = getattr(self, "entered", 0) + 1
        return super().autocast_context_manager()


class DtypeProbe(Regressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen = self(batch[0]).dtype
        return super().training_step(batch, batch_idx)


def test_an_overridden_autocast_context_manager_is_the_forward_context(tmp_path):
    plugin = CountingMixed("bf16-mixed", device="cpu")
    assert isinstance(plugin.forward_context(), torch.autocast) and plugin.entered == 1
    module = DtypeProbe()
    trainer = quiet_trainer(default_root_dir=tmp_path, max_steps=1, plugins=[plugin])
    trainer.fit(module, DataLoader(regression_data(8), batch_size=4))
    assert module.seen == torch.bfloat16 and plugin.entered >= 2
