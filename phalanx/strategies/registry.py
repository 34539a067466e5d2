"""The strategy registry: names -> Strategy classes (third parties: entry-point group `phalanx.strategies`)."""

from __future__ import annotations

from phalanx.strategies.ddp import DDPStrategy
from phalanx.strategies.deepspeed import DeepSpeedStrategy
from phalanx.strategies.fault_tolerant import DDPFaultTolerantStrategy, HSDPFaultTolerantStrategy
from phalanx.strategies.fsdp import FSDPStrategy, ModelParallelStrategy
from phalanx.strategies.single_device import SingleDeviceStrategy
from phalanx.strategies.strategy import Strategy
from phalanx.strategies.xla import SingleDeviceXLAStrategy, XLAFSDPStrategy, XLASPMDStrategy, XLAStrategy
from phalanx.utilities.registry import Registry

STRATEGY_REGISTRY: Registry[Strategy] = Registry(
    "strategy",
    "phalanx.strategies",
    packages={
        "hivemind": "install phalanx-hivemind (`pip install ./integrations/phalanx-hivemind` in a phalanx checkout)"
    },
)

for _strategy in (
    SingleDeviceStrategy,
    DDPStrategy,
    DDPFaultTolerantStrategy,
    FSDPStrategy,
    HSDPFaultTolerantStrategy,
    ModelParallelStrategy,
    DeepSpeedStrategy,
    SingleDeviceXLAStrategy,
    XLAStrategy,
    XLASPMDStrategy,
    XLAFSDPStrategy,
):
    _strategy.register_strategies(STRATEGY_REGISTRY)
