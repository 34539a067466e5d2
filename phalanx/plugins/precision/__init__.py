"""Precision plugins."""

from typing import Any

from phalanx.plugins.precision.amp import MixedPrecision
from phalanx.plugins.precision.deepspeed import DeepSpeedPrecision
from phalanx.plugins.precision.double import DoublePrecision
from phalanx.plugins.precision.fsdp import FSDPPrecision
from phalanx.plugins.precision.half import HalfPrecision
from phalanx.plugins.precision.precision import Precision
from phalanx.plugins.precision.xla import XLAPrecision
from phalanx.utilities.lightning_names import NotOffered, missing_name_error

#: Lightning's precision plugins that phalanx does not have, with what to use instead.
NOT_OFFERED = {
    "BitsandbytesPrecision": NotOffered(
        "a model quantized with bitsandbytes before fit (Linear4bit or Linear8bitLt layers) and precision='bf16-mixed'"
    ),
    "TransformerEnginePrecision": NotOffered(
        "transformer_engine's layers and fp8_autocast in your module's forward, with precision='bf16-mixed'"
    ),
}


def __getattr__(name: str) -> Any:
    raise missing_name_error(__name__, name, NOT_OFFERED)


__all__ = [
    "DeepSpeedPrecision",
    "DoublePrecision",
    "FSDPPrecision",
    "HalfPrecision",
    "MixedPrecision",
    "Precision",
    "XLAPrecision",
]
