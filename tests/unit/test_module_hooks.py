"""TrainingModule helpers from Lightning: toggle_optimizer / untoggle_optimizer / toggled_optimizer, freeze/unfreeze."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from phalanx_testing import quiet_trainer, regression_data
from torch import nn
from torch.utils.data import DataLoader

import phalanx


class TwoParts(phalanx.TrainingModule):
    """A generator and a discriminator with an optimizer each, a frozen parameter, and a parameter in no optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 4))
        self.discriminator = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
        self.generator[2].bias.requires_grad = False  # frozen before any toggling: must stay so
        self.unoptimized = nn.Parameter(torch.zeros(1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.generator.parameters(), lr=0.1), torch.optim.SGD(
            self.discriminator.parameters(), lr=0.1
        )


def _flags(module: nn.Module) -> dict[str, bool]:
    return {name: p.requires_grad for name, p in module.named_parameters()}


def _attached(module: TwoParts) -> list[torch.optim.Optimizer]:
    optimizers = list(module.configure_optimizers())
    module.trainer = SimpleNamespace(optimizers=optimizers)  # what toggle_optimizer reads: the Trainer's optimizers
    return optimizers


@pytest.mark.parametrize("form", ["calls", "context manager"])
@pytest.mark.parametrize("toggled", [0, 1])
def test_toggle_leaves_only_the_optimizers_parameters_trainable_and_untoggle_restores_exactly(form, toggled):
    module = TwoParts()
    optimizers = _attached(module)
    before = _flags(module)
    owner = ("generator.", "discriminator.")[toggled]
    if form == "calls":
        module.toggle_optimizer(optimizers[toggled])
        during = _flags(module)
        module.untoggle_optimizer(optimizers[toggled])
    else:
        with module.toggled_optimizer(optimizers[toggled]):
            during = _flags(module)
    for name, flag in during.items():
        if name.startswith(owner) or name == "unoptimized":  # its own, and those of no optimizer, keep their flag
            assert flag == before[name], name
        else:
            assert flag is False, name
    assert _flags(module) == before  # the frozen bias is still frozen


def test_toggled_optimizer_restores_the_flags_when_its_block_raises():
    module = TwoParts()
    optimizers = _attached(module)
    before = _flags(module)
    with pytest.raises(KeyError), module.toggled_optimizer(optimizers[1]):
        raise KeyError("in the block")
    assert _flags(module) == before


def test_toggle_needs_the_trainers_optimizers():
    module = TwoParts()
    with pytest.raises(RuntimeError, match="not attached to a Trainer"):
        module.toggle_optimizer(module.configure_optimizers()[0])


class Gan(TwoParts):
    """Manual optimization as in Lightning's GAN example: each optimizer's step under toggled_optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.grads_seen: list[tuple[bool, bool]] = []

    def training_step(self, batch, batch_idx):
        (x, _), (opt_g, opt_d) = batch, self.optimizers()
        opt_d.zero_grad()  # set_to_none: a discriminator gradient seen below comes from the generator's backward
        with self.toggled_optimizer(opt_g):  # the handle from self.optimizers(), as Lightning users pass it
            opt_g.zero_grad()
            self.manual_backward(self.discriminator(self.generator(x)).mean())
            self.grads_seen.append(
                (self.generator[0].weight.grad is not None, self.discriminator[0].weight.grad is not None)
            )
            opt_g.step()
        with self.toggled_optimizer(opt_d):
            opt_d.zero_grad()
            self.manual_backward(-self.discriminator(x).mean())
            opt_d.step()


def test_toggled_optimizer_in_a_manual_optimization_fit_keeps_gradients_off_the_other_model(tmp_path):
    module = Gan()
    before = _flags(module)
    quiet_trainer(default_root_dir=tmp_path, max_epochs=1, num_sanity_val_steps=0).fit(
        module, DataLoader(regression_data(16), batch_size=8)
    )
    assert module.grads_seen == [(True, False), (True, False)]  # the generator's loss left no discriminator gradient
    assert _flags(module) == before


@pytest.mark.parametrize("frozen_before", [(), ("generator.0.weight",), ("generator.0.weight", "discriminator.2.bias")])
def test_freeze_stops_every_gradient_and_evaluates_unfreeze_trains_everything(frozen_before):
    module = TwoParts()
    for name, parameter in module.named_parameters():
        parameter.requires_grad = name not in frozen_before
    module.freeze()
    assert not any(_flags(module).values())
    assert not any(sub.training for sub in module.modules())
    module.unfreeze()  # as in Lightning: every parameter, including those frozen before
    assert all(_flags(module).values())
    assert all(sub.training for sub in module.modules())
