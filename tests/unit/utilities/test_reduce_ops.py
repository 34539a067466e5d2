"""``strategy.reduce`` takes what Lightning takes: the names in any case, 'avg', and torch's ReduceOp members."""

from __future__ import annotations

import pytest
import torch
from torch.distributed import ReduceOp

from phalanx.strategies import DDPStrategy, SingleDeviceStrategy
from phalanx.utilities.distributed import normalize_reduce_op


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("mean", "mean"),
        ("MEAN", "mean"),
        ("avg", "mean"),
        ("Avg", "mean"),
        (None, "mean"),
        ("sum", "sum"),
        ("Sum", "sum"),
        ("max", "max"),
        ("MIN", "min"),
        (ReduceOp.SUM, "sum"),
        (ReduceOp.AVG, "mean"),
        (ReduceOp.MAX, "max"),
        (ReduceOp.MIN, "min"),
    ],
)
def test_accepted_reduce_ops(given, expected):
    assert normalize_reduce_op(given) == expected


@pytest.mark.parametrize("given", ["product", "", "meen", ReduceOp.PRODUCT, ReduceOp.BAND, 3])
def test_other_reduce_ops_are_refused_with_the_choices(given):
    with pytest.raises(ValueError, match=r"is not supported; choose one of \('mean', 'sum', 'max', 'min'\)"):
        normalize_reduce_op(given)


@pytest.mark.parametrize(
    "strategy", [SingleDeviceStrategy(device=torch.device("cpu")), DDPStrategy()], ids=["single", "ddp-without-group"]
)
def test_strategies_check_the_op_even_when_nothing_is_reduced(strategy):
    value = torch.tensor(2.0)
    assert strategy.reduce(value, reduce_op=ReduceOp.AVG) is value
    assert strategy.reduce(value, reduce_op="AVG") is value
    with pytest.raises(ValueError, match="reduce_op='product'"):
        strategy.reduce(value, reduce_op="product")
