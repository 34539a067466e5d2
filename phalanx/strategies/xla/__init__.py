"""The XLA family: one device, replicas (one per XLA device), SPMD and XLA FSDP strategies, and their launcher."""

from phalanx.strategies.xla._collectives import cut_graph
from phalanx.strategies.xla.fsdp import XLAFSDPStrategy
from phalanx.strategies.xla.launcher import XLALauncher
from phalanx.strategies.xla.replicas import XLAStrategy
from phalanx.strategies.xla.single_device import SingleDeviceXLAStrategy
from phalanx.strategies.xla.spmd import XLASPMDStrategy

__all__ = ["SingleDeviceXLAStrategy", "XLAFSDPStrategy", "XLALauncher", "XLASPMDStrategy", "XLAStrategy", "cut_graph"]
