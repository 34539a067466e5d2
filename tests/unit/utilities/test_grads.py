"""``grad_norm`` returns what Lightning's returns (the same keys, the same values) for the norms Lightning users log,
and refuses a norm that is not positive; ``phalanx.utilities`` offers Lightning's other helpers under their names."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from phalanx.utilities import grad_norm


def _module_with_gradients() -> nn.Module:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    module[0].bias.requires_grad_(False)  # no gradient: left out
    module(torch.randn(5, 3)).pow(2).sum().backward()
    return module


@pytest.mark.parametrize(("norm_type", "separator"), [(2, "/"), (1.0, "/"), ("inf", "."), (3, "_")])
def test_it_reports_what_lightnings_grad_norm_reports(norm_type, separator):
    lightning = pytest.importorskip("pytorch_lightning.utilities", reason="pytorch-lightning is the oracle of this row")
    module = _module_with_gradients()
    theirs = lightning.grad_norm(module, norm_type, separator)
    ours = grad_norm(module, norm_type, separator)
    assert list(ours) == list(theirs)
    assert (
        f"grad_{float(norm_type)}_norm{separator}0.weight" in ours
        and f"grad_{float(norm_type)}_norm{separator}0.bias" not in ours
    )
    for name, value in theirs.items():
        assert torch.allclose(ours[name], value), name


def test_the_total_is_the_norm_of_all_gradients_as_one_vector():
    module = _module_with_gradients()
    every = torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None])
    assert torch.allclose(grad_norm(module, 2)["grad_2.0_norm_total"], every.norm(2))
    assert grad_norm(nn.Linear(2, 2), 2) == {}  # no gradients yet


@pytest.mark.parametrize("norm_type", [0, -1, "-inf"])
def test_a_norm_that_is_not_positive_is_refused(norm_type):
    with pytest.raises(ValueError, match="must be a positive number or 'inf'"):
        grad_norm(nn.Linear(2, 2), norm_type)


def test_lightnings_other_helpers_are_here_under_their_names():
    from phalanx.utilities import AttributeDict, GradClipAlgorithmType, measure_flops, move_data_to_device

    assert AttributeDict(a=1).a == 1 and GradClipAlgorithmType("norm").value == "norm"
    assert move_data_to_device({"x": torch.ones(1)}, torch.device("cpu"))["x"].device.type == "cpu"
    assert callable(measure_flops)
