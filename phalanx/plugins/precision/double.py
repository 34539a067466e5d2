"""Double precision (float64) for numerically sensitive work."""

from __future__ import annotations

import torch

from phalanx.plugins.precision.half import TruePrecision


class DoublePrecision(TruePrecision):
    """'64-true': parameters, inputs and computation in float64."""

    precision = "64-true"
    dtype = torch.float64
