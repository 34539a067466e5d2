"""What a peer accepts from its swarm: the checks on averaged gradients, averaged states and downloaded states.

Peers of one ``run_id`` are trusted collaborators, but nothing an honest swarm sends is non-finite, shaped unlike this
peer's own tensors, or far larger than what this peer computed itself. These checks run once per swarm step (a rare,
heavy event) and never in a local step. They need no hivemind: ``guarded`` applies them inside hivemind's classes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

#: An averaged gradient may be at most this many times as large (in norm) as this peer's own gradient of the step.
DEFAULT_MAX_AVERAGED_GRAD_RATIO = 100.0
#: Averaged parameters and optimizer statistics may be at most this many times as large as this peer's own.
DEFAULT_MAX_AVERAGED_STATE_RATIO = 10.0
#: Bytes a downloaded tensor may take on the wire beyond its raw size (compression statistics and lookup tables).
WIRE_OVERHEAD_BYTES = 64 * 1024
#: Bytes of metadata (epoch, optimizer hyperparameters) a downloaded state may carry.
MAX_METADATA_BYTES = 4 * 1024 * 1024


class SwarmTrustError(RuntimeError):
    """This peer refused what the swarm sent and cannot go on without it (with ``offload_optimizer=True``)."""


class SwarmTrustWarning(UserWarning):
    """This peer refused what the swarm sent (averaged gradients, an averaged state or a peer's state) and went on."""


class StateRefused(Exception):
    """A peer's state does not match this peer's own tensors (raised while it arrives, before anything is loaded)."""


@dataclass(frozen=True)
class TensorSpec:
    """What one tensor of a downloaded state must be: this peer's own tensor's shape and dtype."""

    label: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, label: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(label, tuple(tensor.shape), tensor.dtype)

    @property
    def wire_allowance(self) -> int:
        """The most bytes this tensor may take on the wire (its raw size plus compression overhead)."""
        return math.prod(self.shape) * self.dtype.itemsize + WIRE_OVERHEAD_BYTES


def norm_of(tensors: Iterable[torch.Tensor]) -> float:
    """The 2-norm of all floating-point ``tensors`` together (nan or inf when any holds a non-finite value).

    One host read per device: called once per swarm step, never in a local step.
    """
    per_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor.is_floating_point():
            norm = torch.linalg.vector_norm(tensor.detach(), dtype=torch.float64)
            per_device.setdefault(tensor.device, []).append(norm)
    total = 0.0
    for norms in per_device.values():
        total += float(torch.linalg.vector_norm(torch.stack(norms))) ** 2
    return math.sqrt(total)


def averaged_problem(what: str, averaged: float, own: float, ratio: float | None, option: str) -> str | None:
    """Why ``what`` (tensors of norm ``averaged``) must be refused by a peer whose own have norm ``own``, or None.

    ``own`` of 0 (this peer contributed nothing) leaves only the finiteness check.
    """
    if not math.isfinite(averaged):
        return f"{what} hold non-finite values (norm {averaged})"
    if ratio is not None and own > 0 and averaged > ratio * own:
        return (
            f"{what} have norm {averaged:.4g}, {averaged / own:.4g} times this peer's own ({own:.4g}),"
            f" above {option}={ratio:g}"
        )
    return None


def check_header(specs: Sequence[TensorSpec], index: int, shape: Sequence[int]) -> TensorSpec:
    """The spec of the ``index``-th tensor arriving with ``shape``; StateRefused when there is none or it differs."""
    if index >= len(specs):
        raise StateRefused(f"it sent more than the {len(specs)} tensors of this peer's state")
    spec = specs[index]
    if tuple(shape) != spec.shape:
        raise StateRefused(f"its {spec.label} has shape {list(shape)}, this peer's has {list(spec.shape)}")
    return spec


def check_wire_size(spec: TensorSpec, received: int) -> None:
    """StateRefused when ``received`` bytes of one tensor exceed what a tensor like this peer's can take."""
    if received > spec.wire_allowance:
        raise StateRefused(
            f"its {spec.label} took more than {spec.wire_allowance} bytes on the wire; this peer's"
            f" {list(spec.shape)} {spec.dtype} tensor takes {spec.wire_allowance - WIRE_OVERHEAD_BYTES}"
        )


def check_tensor(spec: TensorSpec, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` if it has the spec's shape and dtype and only finite values; StateRefused naming what differs."""
    if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
        raise StateRefused(
            f"its {spec.label} is a {list(tensor.shape)} {tensor.dtype} tensor, this peer's is"
            f" {list(spec.shape)} {spec.dtype}"
        )
    if (tensor.is_floating_point() or tensor.is_complex()) and not bool(torch.isfinite(tensor).all()):
        raise StateRefused(f"its {spec.label} holds non-finite values")
    return tensor


def check_count(specs: Sequence[TensorSpec], received: int) -> None:
    """StateRefused when a complete state holds fewer tensors than this peer's."""
    if received != len(specs):
        raise StateRefused(f"it sent {received} tensors; this peer's state has {len(specs)}")
