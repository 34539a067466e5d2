"""empty_init_context: module constructors skip torch.nn.init initialisers (which would consume the global RNG)."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import nn

from phalanx.utilities.init import empty_init_context

_BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "linear": lambda: nn.Linear(1000, 1000),
    "conv": lambda: nn.Conv2d(3, 8, 3),
    "embedding": lambda: nn.Embedding(50, 8, padding_idx=0),
    "lstm": lambda: nn.LSTM(4, 4),
    "attention": lambda: nn.MultiheadAttention(8, 2),
}


@pytest.mark.parametrize("name", sorted(_BUILDERS))
def test_enabled_skips_initialisers_so_the_rng_is_untouched(name: str) -> None:
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with empty_init_context(True):
        module = _BUILDERS[name]()
    assert torch.equal(torch.get_rng_state(), before)
    assert all(parameter.shape.numel() > 0 for parameter in module.parameters())  # memory is still allocated


@pytest.mark.parametrize("name", sorted(_BUILDERS))
def test_disabled_initialises_as_usual(name: str) -> None:
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with empty_init_context(False):
        module = _BUILDERS[name]()
    assert not torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(0)
    reference = _BUILDERS[name]()
    for parameter, expected in zip(module.parameters(), reference.parameters()):
        assert torch.equal(parameter, expected)


def test_initialisers_that_dispatch_return_the_tensor_unchanged() -> None:
    tensor = torch.full((3, 3), 7.0)
    with empty_init_context():
        assert torch.nn.init.normal_(tensor) is tensor
        assert torch.nn.init.uniform_(tensor=tensor) is tensor
        assert torch.nn.init.kaiming_uniform_(tensor, a=1.0) is tensor
        assert torch.nn.init.constant_(tensor, 0.0) is tensor
    assert torch.equal(tensor, torch.full((3, 3), 7.0))
    torch.nn.init.constant_(tensor, 0.0)  # outside the context the initialisers work again
    assert torch.equal(tensor, torch.zeros(3, 3))


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    "initialiser",
    [
        "xavier_uniform_",
        "xavier_normal_",
        "kaiming_normal_",
        "kaiming_uniform_",
        "trunc_normal_",
        "orthogonal_",
        "normal_",
        "uniform_",
        "zeros_",
        "ones_",
        "eye_",
    ],
)
@pytest.mark.parametrize("shape", [(3, 5), (5, 3)])
def test_no_initialiser_consumes_the_rng_inside_the_context(initialiser: str, shape: tuple[int, int]) -> None:
    # xavier_*, trunc_normal_, orthogonal_, kaiming_normal_ do not dispatch to torch function modes themselves.
    tensor = torch.empty(shape)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with empty_init_context():
        assert getattr(torch.nn.init, initialiser)(tensor) is tensor
    assert torch.equal(torch.get_rng_state(), before)


def test_other_torch_operations_still_run_inside_the_context() -> None:
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    with empty_init_context():
        drawn = torch.rand(4)
        product = torch.ones(2, 2) @ torch.ones(2, 2)
        layer = nn.Linear(2, 2)
        with torch.no_grad():
            layer.weight.copy_(torch.eye(2))
            layer.bias.zero_()  # a Tensor method, not a torch.nn.init function: it runs
        output = layer(torch.tensor([[1.0, 2.0]]))
    assert torch.equal(drawn, expected)
    assert torch.equal(product, torch.full((2, 2), 2.0))
    assert torch.equal(output, torch.tensor([[1.0, 2.0]]))


def test_the_context_is_undone_after_an_error() -> None:
    with pytest.raises(RuntimeError, match="inside"):
        with empty_init_context():
            raise RuntimeError("inside")
    torch.manual_seed(0)
    before = torch.get_rng_state()
    nn.Linear(4, 4)
    assert not torch.equal(torch.get_rng_state(), before)
