"""grad_norm: the norm of each parameter's gradient and their total norm, as Lightning's ``grad_norm`` reports them."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def grad_norm(module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, Tensor]:
    """The ``norm_type`` norm of each gradient of ``module``'s parameters, under
    ``grad_{norm_type}_norm{group_separator}{name}``, and of all of them as one vector under
    ``grad_{norm_type}_norm_total`` (``'inf'``: the largest absolute value); parameters without a gradient are left
    out. Ready for ``self.log_dict`` in ``on_before_optimizer_step``.
    """
    norm = float(norm_type)
    if not norm > 0:
        raise ValueError(f"norm_type={norm_type!r} must be a positive number or 'inf' (the infinity norm).")
    norms = {
        f"grad_{norm}_norm{group_separator}{name}": parameter.grad.detach().norm(norm)
        for name, parameter in module.named_parameters()
        if parameter.grad is not None
    }
    if norms:
        # One stack on the gradients' device: no copy to the host per parameter.
        norms[f"grad_{norm}_norm_total"] = torch.stack([value.float() for value in norms.values()]).norm(norm)
    return norms


__all__ = ["grad_norm"]
