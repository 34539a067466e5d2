"""Imports torchft on first use only, with an error naming the extra to install when it is missing."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

#: The torchft release these strategies are written and tested against.
TORCHFT_VERSION = "0.2.0"


class _TorchFT:
    """The parts of torchft the strategies use, imported together."""

    def __init__(self) -> None:
        self.manager: ModuleType = importlib.import_module("torchft.manager")
        self.process_group: ModuleType = importlib.import_module("torchft.process_group")
        self.http_transport: ModuleType = importlib.import_module("torchft.checkpointing.http_transport")
        self.pg_transport: ModuleType = importlib.import_module("torchft.checkpointing.pg_transport")
        self.local_sgd: ModuleType = importlib.import_module("torchft.local_sgd")
        self.LighthouseServer: Any = importlib.import_module("torchft._torchft").LighthouseServer


def require_torchft(user: str) -> _TorchFT:
    """torchft's modules, or an ImportError saying that ``user`` needs the ``ft`` extra."""
    try:
        return _TorchFT()
    except ImportError as error:
        raise ImportError(
            f"{user} needs torchft, which is not installed ({error}). Install the extra with"
            f" `pip install 'phalanx[ft]'` (torchft=={TORCHFT_VERSION})."
        ) from error
