"""``TrainingModule.load_from_checkpoint``: build a module from the hyper-parameters saved in a checkpoint and load its
weights, checking both first so that a bad checkpoint gives a ``CheckpointError`` naming the file."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from phalanx.utilities.exceptions import CheckpointError

if TYPE_CHECKING:
    from phalanx.module import TrainingModule


def load_module_from_checkpoint(
    cls: type[TrainingModule],
    checkpoint_path: Any,
    *,
    map_location: Any | None,
    strict: bool,
    overrides: dict[str, Any],
) -> TrainingModule:
    """An instance of ``cls`` built from the checkpoint's hyper-parameters (``overrides`` win), with its weights."""
    # Lazy for import time: `from phalanx import TrainingModule` does not load the checkpoint IO stack.
    from phalanx.plugins.io.checks import check_checkpoint, check_weights, check_weights_fit
    from phalanx.plugins.io.torch_io import TorchCheckpointIO

    source = str(checkpoint_path)
    checkpoint = TorchCheckpointIO().load_checkpoint(checkpoint_path, map_location=map_location)
    check_checkpoint(checkpoint, source, fitting=False)
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    hparams.update(overrides)
    signature = inspect.signature(cls.__init__)
    accepts_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    if not accepts_kwargs:
        hparams = {key: value for key, value in hparams.items() if key in signature.parameters}
    try:
        module = cls(**hparams)
    except (TypeError, ValueError, RuntimeError) as error:
        raise CheckpointError(
            f"{source}: {cls.__name__}(**checkpoint['hyper_parameters']) failed ({type(error).__name__}: {error})."
            f" Saved hyper-parameters: {sorted(hparams)}; pass corrected values as keyword arguments to"
            " load_from_checkpoint."
        ) from error
    module.configure_model()
    module.on_load_checkpoint(checkpoint)
    check_weights(source, checkpoint.get("state_dict"))
    check_weights_fit(source, checkpoint["state_dict"], module.state_dict(), strict=strict, owner=cls.__name__)
    module.load_state_dict(checkpoint["state_dict"], strict=strict)
    if map_location is not None:
        module.to(map_location if not callable(map_location) else "cpu")
    return module


__all__ = ["load_module_from_checkpoint"]
