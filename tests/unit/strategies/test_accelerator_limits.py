"""Accelerator limits are data the resolver reads (``Accelerator.strategy_family``, ``Accelerator.max_processes``;
``Strategy.family``, ``Strategy.multi_process``), so a new accelerator or strategy family declares its limits without
an edit to the resolver, which names no strategy family or accelerator class."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from phalanx.accelerators import CPUAccelerator
from phalanx.accelerators.mps import MPSAccelerator
from phalanx.accelerators.xla import XLAAccelerator
from phalanx.strategies import (
    DDPStrategy,
    FSDPStrategy,
    SingleDeviceStrategy,
    SingleDeviceXLAStrategy,
    XLAFSDPStrategy,
    XLASPMDStrategy,
    XLAStrategy,
)
from phalanx.strategies.resolve import refuse_unfit_strategy, resolve_strategy


class OneProcessAccelerator(CPUAccelerator):
    """A device kind that runs one process (as MPS)."""

    name = "solo"
    max_processes = 1
    max_processes_reason = "one test device"


class DemoFamilyAccelerator(CPUAccelerator):
    """A device kind that runs only the strategies of the "demo" family (as XLA devices run the XLA ones)."""

    name = "demo"
    strategy_family = "demo"


class DemoStrategy(SingleDeviceStrategy):
    """A member of the "demo" family."""

    family = "demo"


REFUSED = [
    (OneProcessAccelerator, DDPStrategy, r"runs several processes that communicate, which the SOLO accelerator"),
    (OneProcessAccelerator, FSDPStrategy, r"\(one test device\) does not support. Train on SOLO with strategy='auto'"),
    (DemoFamilyAccelerator, DDPStrategy, r"does not run on DEMO devices \(accelerator='demo'\)"),
    (DemoFamilyAccelerator, SingleDeviceStrategy, r"Use one of the DEMO strategies, \[\] \(or strategy='auto'\)"),
]
ACCEPTED = [
    (OneProcessAccelerator, SingleDeviceStrategy),
    (OneProcessAccelerator, DemoStrategy),
    (DemoFamilyAccelerator, DemoStrategy),
    (CPUAccelerator, DDPStrategy),
    (CPUAccelerator, DemoStrategy),
]


@pytest.mark.parametrize(("accelerator", "strategy", "message"), REFUSED)
def test_declared_limits_refuse(accelerator: type, strategy: type, message: str) -> None:
    with pytest.raises(ValueError, match=rf"strategy='x' .*{message}"):
        refuse_unfit_strategy(strategy, accelerator(), "'x'")


@pytest.mark.parametrize(("accelerator", "strategy"), ACCEPTED)
def test_declared_limits_accept(accelerator: type, strategy: type) -> None:
    refuse_unfit_strategy(strategy, accelerator(), "'x'")


def test_an_instance_of_another_family_is_refused_by_the_resolver() -> None:
    with pytest.raises(ValueError, match=r"strategy=a SingleDeviceStrategy instance does not run on DEMO devices"):
        resolve_strategy(strategy=SingleDeviceStrategy(device=torch.device("cpu"), accelerator=DemoFamilyAccelerator()))
    built = resolve_strategy(strategy=DemoStrategy(device=torch.device("cpu"), accelerator=DemoFamilyAccelerator()))
    assert isinstance(built, DemoStrategy)


@pytest.mark.parametrize(
    ("holder", "attribute", "value"),
    [
        (MPSAccelerator, "max_processes", 1),
        (XLAAccelerator, "strategy_family", "xla"),
        (CPUAccelerator, "max_processes", None),
        (CPUAccelerator, "strategy_family", None),
        *[(cls, "family", "xla") for cls in (SingleDeviceXLAStrategy, XLAStrategy, XLASPMDStrategy, XLAFSDPStrategy)],
        *[(cls, "multi_process", True) for cls in (DDPStrategy, FSDPStrategy, XLAStrategy)],
        (SingleDeviceStrategy, "multi_process", False),
        (DDPStrategy, "family", None),
    ],
)
def test_the_built_ins_declare_their_limits(holder: type, attribute: str, value: object) -> None:
    assert getattr(holder, attribute) == value


RESOLVE = Path(__file__).resolve().parents[3] / "phalanx" / "strategies" / "resolve.py"
FAMILY_MODULES = ("phalanx.strategies.xla", "phalanx.strategies.fsdp", "phalanx.strategies.deepspeed")
DEVICE_MODULES = ("phalanx.accelerators.xla", "phalanx.accelerators.mps", "phalanx.accelerators.cuda")


def named_families(source: str) -> list[str]:
    """Imports of a strategy family or of one kind of accelerator, anywhere in ``source`` (function level too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [name for name in names if name.startswith(FAMILY_MODULES + DEVICE_MODULES)]
    return found


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("from phalanx.strategies.xla._common import XLAStrategyMixin", True),
        ("def f():\n    from phalanx.accelerators.mps import MPSAccelerator", True),
        ("from phalanx.accelerators import xla", True),
        ("import phalanx.strategies.deepspeed", True),
        ("from phalanx.strategies.registry import STRATEGY_REGISTRY", False),
    ],
)
def test_the_finder_finds_family_imports(source: str, found: bool) -> None:
    assert bool(named_families(source)) is found


def test_the_resolver_imports_no_strategy_family_and_no_kind_of_accelerator() -> None:
    assert named_families(RESOLVE.read_text()) == []
