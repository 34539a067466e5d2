"""What a ``training_step`` returns, turned into the loss to backpropagate, or refused in phalanx's words."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor


def extract_loss(output: Any) -> Tensor | None:
    """The loss in a ``training_step`` result: the tensor itself, ``output['loss']``, or None (skip the batch).

    The loss is checked before backward, from tensor metadata only (no device read): one element, and part of an
    autograd graph; otherwise autograd fails later with a message that names neither the hook nor the value.
    """
    if output is None:
        return None
    if isinstance(output, Tensor):
        check_loss(output, "training_step returned")
        return output
    if isinstance(output, Mapping):
        if "loss" not in output:
            raise ValueError(
                f"training_step returned a dict without a 'loss' key (keys: {sorted(output)}); "
                f"add the loss under 'loss'."
            )
        check_loss(output["loss"], "training_step returned a dict whose 'loss' is")
        return output["loss"]
    raise TypeError(
        f"training_step returned a {type(output).__name__}; return the loss tensor, a dict with 'loss', or None to"
        " skip the batch."
    )


def check_loss(loss: Any, returned: str) -> None:
    """Raise, naming what ``returned`` gave, unless ``loss`` is a one-element tensor that requires grad."""
    if not isinstance(loss, Tensor):
        what = "None" if loss is None else f"a {type(loss).__name__}"
        raise TypeError(
            f"{returned} {what}, not a tensor. With automatic optimization the loss must be a scalar"
            " tensor computed from the module's outputs (return None to skip the batch)."
        )
    if loss.numel() != 1:
        raise ValueError(
            f"{returned} a tensor of shape {tuple(loss.shape)}, not a scalar: the loss must have one element. Reduce"
            " it (e.g. loss.mean() or loss.sum()) before returning it."
        )
    if not loss.requires_grad:
        raise ValueError(
            f"{returned} a tensor (dtype {loss.dtype}) that does not require grad and has no grad_fn, so backward has"
            " nothing to differentiate: it was detached (.detach(), .item()), computed under torch.no_grad() or"
            " inference mode, or from parameters that all have requires_grad=False. Return the loss computed from"
            " the module's outputs with gradients enabled, or None to skip the batch."
        )


def check_manual_backward_loss(loss: Any) -> None:
    """Raise, in phalanx's words, when ``manual_backward`` is given a tensor that autograd cannot differentiate."""
    if isinstance(loss, Tensor) and not loss.requires_grad:
        raise ValueError(
            f"manual_backward(loss) got a tensor of shape {tuple(loss.shape)} (dtype {loss.dtype}) that does not"
            " require grad and has no grad_fn: it was detached, computed under torch.no_grad() or inference mode, or"
            " from parameters that all have requires_grad=False. Pass the loss computed from the module's outputs"
            " with gradients enabled."
        )
