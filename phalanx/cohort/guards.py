"""The Cohort's watch on the losses given to ``cohort.backward``: NaN or infinity warns once, as the Trainer does."""

from __future__ import annotations

import warnings
from typing import Any

from torch import Tensor

from phalanx.utilities.nonfinite import LossFinitenessSum

_WARNED = object()  # the watch once it has warned: nothing more is recorded


def record_loss(cohort: Any, loss: Tensor) -> None:
    """Add ``loss`` into the Cohort's device-side sum (one small kernel per backward, never a host read)."""
    watch = cohort.__dict__.setdefault("_loss_watch", None)
    if watch is _WARNED:
        return
    if watch is None:
        watch = cohort._loss_watch = LossFinitenessSum()
    watch.record(loss)


def report_nonfinite(cohort: Any, where: str) -> None:
    """Read the sum where the Cohort reads or waits anyway (save, barrier, log); warn once if a loss was not finite."""
    watch = cohort.__dict__.get("_loss_watch")
    if not isinstance(watch, LossFinitenessSum):
        return
    recorded = watch.recorded
    with cohort.strategy.host_reads():
        finite = watch.read()
    if finite is not False:
        return
    cohort._loss_watch = _WARNED
    rank = f"[rank {cohort.global_rank}] " if cohort.world_size > 1 else ""
    warnings.warn(
        f"{rank}A loss given to cohort.backward was NaN or infinite at least once in the last {recorded} calls (seen at"
        f" Cohort.{where}, optimizer step {cohort.global_step}); training went on. This is reported once per Cohort."
        " Check that the weights were initialised or loaded (init_module(empty_init=True) leaves them uninitialised),"
        " lower the learning rate or clip gradients (cohort.clip_gradients).",
        UserWarning,
        stacklevel=3,
    )
