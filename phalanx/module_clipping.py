"""The threshold and algorithm ``TrainingModule.clip_gradients`` uses, completed from the Trainer's as in Lightning."""

from __future__ import annotations

from typing import TYPE_CHECKING

from phalanx.utilities.checks import is_number
from phalanx.utilities.exceptions import MisconfigurationError

if TYPE_CHECKING:
    from phalanx.module import TrainingModule


def clip_settings(module: TrainingModule, value: float | int | None, algorithm: str | None) -> tuple[float | int, str]:
    """The threshold and algorithm ``clip_gradients`` uses: the ones given, else the Trainer's, else 0 and 'norm'.

    A value given must agree with the Trainer's when that one is set (MisconfigurationError otherwise), as in
    Lightning.
    """
    trainer = module._trainer
    trainer_value = getattr(trainer, "gradient_clip_val", None)
    trainer_algorithm = getattr(trainer, "gradient_clip_algorithm", None)
    if value is None:
        value = trainer_value or 0.0
    elif trainer_value is not None and trainer_value != value:
        raise MisconfigurationError(
            f"Trainer(gradient_clip_val={trainer_value!r}) and clip_gradients(gradient_clip_val={value!r}) disagree;"
            " set the threshold in one place."
        )
    if algorithm is None:
        algorithm = str(trainer_algorithm or "norm")
    elif trainer_algorithm is not None and trainer_algorithm != algorithm:
        raise MisconfigurationError(
            f"Trainer(gradient_clip_algorithm={str(trainer_algorithm)!r}) and"
            f" clip_gradients(gradient_clip_algorithm={str(algorithm)!r}) disagree; set the algorithm in one place."
        )
    if not is_number(value):
        raise TypeError(f"gradient_clip_val={value!r} must be an int or a float.")
    if algorithm not in ("norm", "value"):
        raise ValueError(f"gradient_clip_algorithm={str(algorithm)!r} is not valid; choose 'norm' or 'value'.")
    return value, str(algorithm)


__all__ = ["clip_settings"]
