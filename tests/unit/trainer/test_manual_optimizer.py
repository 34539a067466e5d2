"""The handle ``self.optimizers()`` returns can be pickled and deep-copied, as Lightning's can."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from phalanx.trainer.loops.optimizer import ManualOptimizer


@pytest.mark.parametrize(
    "duplicate",
    [copy.deepcopy, copy.copy, lambda handle: pickle.loads(pickle.dumps(handle))],
    ids=["deepcopy", "copy", "pickle"],
)
def test_a_copied_handle_keeps_the_optimizer_state_and_refuses_to_step(duplicate):
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    handle = ManualOptimizer(optimizer, trainer=object())  # type: ignore[arg-type]
    copied = duplicate(handle)
    assert isinstance(copied.optimizer, torch.optim.SGD) and copied.param_groups[0]["lr"] == 0.1
    assert copied.defaults["momentum"] == 0.9  # attributes of the wrapped optimizer are reachable
    with pytest.raises(RuntimeError, match="detached from the Trainer"):
        copied.step()


def test_missing_attributes_raise_attribute_error_not_recursion():
    handle = ManualOptimizer.__new__(ManualOptimizer)
    with pytest.raises(AttributeError):
        handle.optimizer  # noqa: B018
    with pytest.raises(AttributeError):
        handle.no_such_attribute  # noqa: B018
