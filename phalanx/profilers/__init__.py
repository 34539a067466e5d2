"""Profilers: time the Trainer's hooks and the strategy's steps per stage (``Trainer(profiler="simple")``)."""

from typing import Any

from phalanx.profilers.advanced import AdvancedProfiler
from phalanx.profilers.profiler import PassThroughProfiler, Profiler
from phalanx.profilers.pytorch import PyTorchProfiler
from phalanx.profilers.simple import SimpleProfiler
from phalanx.utilities.lightning_names import NotOffered, missing_name_error

#: Lightning's profilers that phalanx does not have, with what to use instead (``from phalanx.profilers import
#: XLAProfiler`` raises an ImportError saying so).
NOT_OFFERED = {
    "XLAProfiler": NotOffered(
        "torch_xla.debug.profiler (start_server, then capture a trace with TensorBoard) on TPUs, or PyTorchProfiler"
        " for the host side"
    ),
}


def __getattr__(name: str) -> Any:
    raise missing_name_error(__name__, name, NOT_OFFERED)


__all__ = ["AdvancedProfiler", "PassThroughProfiler", "Profiler", "PyTorchProfiler", "SimpleProfiler"]
