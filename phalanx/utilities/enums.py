"""Enumerations Lightning users import by name: ``GradClipAlgorithmType`` (Lightning's
``lightning.pytorch.utilities.enums.GradClipAlgorithmType``)."""

from __future__ import annotations

from enum import Enum


class GradClipAlgorithmType(str, Enum):
    """How gradients are clipped: ``NORM`` scales them to a maximum total norm over all parameters together
    (``torch.nn.utils.clip_grad_norm_``); ``VALUE`` clamps each element (``torch.nn.utils.clip_grad_value_``).

    A ``str`` enum: ``GradClipAlgorithmType.NORM == "norm"``, so either spelling may be passed where an algorithm is
    expected.
    """

    VALUE = "value"
    NORM = "norm"

    def __str__(self) -> str:
        return self.value

    @staticmethod
    def supported_type(val: str) -> bool:
        """Whether ``val`` names an algorithm ('value' or 'norm')."""
        return any(member.value == val for member in GradClipAlgorithmType)

    @staticmethod
    def supported_types() -> list[str]:
        """The algorithm names: ['value', 'norm']."""
        return [member.value for member in GradClipAlgorithmType]


__all__ = ["GradClipAlgorithmType"]
