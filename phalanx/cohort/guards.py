"""The Cohort's watch on the losses given to ``cohort.backward``: NaN or infinity warns once, as the Trainer does."""

from __future__ import annotations

import os
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


#: Seconds a collective Cohort method waits for every rank to reach it before failing with the cause; long enough
#: for ranks that drift apart in a step, far below the process group's timeout (30 minutes) that would hit otherwise.
AGREEMENT_TIMEOUT_ENV = "PHALANX_COHORT_AGREEMENT_TIMEOUT"
_DEFAULT_AGREEMENT_TIMEOUT = 120.0
_calls = 0  # collective Cohort calls in this process: the same sequence on every rank of a correct program


def agree_on_call(cohort: Any, method: str, *, patient: bool = False) -> None:
    """Fail fast when a collective Cohort method runs on some ranks only, or ranks run different ones.

    Each rank writes the method's name under its call number in the process group's own key-value store and waits
    for every rank's entry (one store round trip, no collective, nothing at world size 1). A rank missing after the
    timeout, or a rank at another method, raises on every rank that got here, naming the method and the ranks.
    ``patient`` waits as long as the process group would (a barrier after rank-zero-only work is a correct program
    however long that work takes); a rank at another method still fails at once.
    """
    global _calls
    import torch.distributed as dist

    if cohort.world_size <= 1 or not dist.is_available() or not dist.is_initialized():
        return
    _calls += 1
    from datetime import timedelta

    store = dist.distributed_c10d._get_default_store()
    prefix = f"phalanx/cohort/call/{_calls}"
    store.set(f"{prefix}/{cohort.global_rank}", method)
    keys = [f"{prefix}/{rank}" for rank in range(cohort.world_size)]
    timeout = float(os.environ.get(AGREEMENT_TIMEOUT_ENV, _DEFAULT_AGREEMENT_TIMEOUT))
    if patient:
        timeout = max(timeout, store.timeout.total_seconds())
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception:  # the store's timeout error differs between torch versions and stores
        missing = [rank for rank, key in enumerate(keys) if not store.check([key])]
        raise RuntimeError(
            f"Cohort.{method} must be called on every rank, but rank(s) {missing} did not reach it within {timeout:g}"
            f" s (rank {cohort.global_rank} waited). A guard such as `if cohort.is_global_zero:` around a collective"
            " method deadlocks: call it on every rank (Cohort.save writes once by itself). The wait is set by the"
            f" environment variable {AGREEMENT_TIMEOUT_ENV}."
        ) from None
    called = {rank: store.get(key).decode() for rank, key in enumerate(keys)}
    if set(called.values()) != {method}:
        raise RuntimeError(
            f"The ranks called different collective Cohort methods at the same point: {called}. Every rank must call"
            " the same collective methods (save, load, barrier, broadcast, all_reduce, all_gather) in the same order."
        )
