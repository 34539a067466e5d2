"""The agreement of collective Cohort calls: every rank at the same method with the same arguments, or a named failure.

Before a collective Cohort method (``setup``, ``save``, ``load``, ``load_raw``, ``barrier``, ``broadcast``) runs a
collective, each rank records what it calls in the process group's key-value store and waits, bounded, for a
verdict. One round for call ``n`` of the process (the same sequence on every rank of a correct program):

1. each rank writes its entry (method and arguments) under its own slot, ``entry/<n % 2>/<rank>``, and adds 1 to one
   counter; the rank whose addition makes the counter ``n * world_size`` arrived last;
2. the last rank reads every entry, compares them and publishes the verdict under ``verdict/<n>`` (``compare_set``:
   a verdict already there wins), then deletes ``verdict/<n - 1>``, which every rank has read by then;
3. the others wait for ``verdict/<n>``, bounded by the timeout, and read it.

So a call costs every rank four or five store round trips whatever the world size, and the store holds at most
``2 * world_size + 3`` of these keys however many calls were made (an entry slot is overwritten two calls later,
when every rank has finished with it), plus one per rank that exited. A rank that stops waiting publishes that it
gave up, so a rank arriving later fails at once instead of entering a collective alone; a rank whose interpreter
exits publishes that for its next call (and its current one, if it left in the middle), so the others fail at once,
naming it, instead of waiting for the timeout. Only an exit that runs no exit handlers (a signal, ``os._exit``)
leaves the others waiting until the timeout (under phalanx's launcher, a rank that ends with an error status ends
the job anyway).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import math
import os
import weakref
from datetime import timedelta
from multiprocessing import util as multiprocessing_util
from typing import Any, Callable

import torch.distributed as dist

#: Seconds a collective Cohort method (other than ``barrier``) waits for every rank to reach it before failing with the
#: cause, unless the strategy's ``timeout=`` is shorter: long enough for ranks that drift apart in a step, far below
#: the process group's default timeout (30 minutes).
AGREEMENT_TIMEOUT_ENV = "PHALANX_COHORT_AGREEMENT_TIMEOUT"
DEFAULT_AGREEMENT_TIMEOUT = 120.0
_PREFIX = "phalanx/cohort"
_OK = json.dumps({"kind": "ok"})
_HINTS = {
    "src": "pass the same src (the rank whose object is sent) on every rank",
    "path": "pass the same path on every rank",
    "checkpoint": "every rank must read the same checkpoint: put it on a file system that every rank reads, or give"
    " each node an identical copy",
    "parameters": "every rank must set up the same module (the same parameter names, shapes and dtypes)",
    "module": "every rank must set up the same module class",
}


class Agreement:
    """The agreement of one process (``rank`` of ``world_size``) through ``store`` (returned by ``store_of()``)."""

    def __init__(self, store_of: Callable[[], Any], rank: int, world_size: int) -> None:
        self._store_of = store_of
        self.rank = rank
        self.world_size = world_size
        self.calls = 0  # calls started by this process
        self.gone: dict[int, int] = {}  # ranks known to have exited -> their calls: no later call can complete

    def agree(self, method: str, arguments: dict[str, str], timeout: float, wait_source: str) -> None:
        """Return once every rank is at call ``calls + 1`` with ``method`` and the same ``arguments``; raise a
        RuntimeError naming the disagreement, the ranks that did not come within ``timeout`` s, or a rank that exited.
        """
        self.calls += 1
        call = self.calls
        if self.gone:  # (a process group that lost a rank never completes a collective again)
            raise RuntimeError(_exit_message(method, self.gone))
        store = self._store_of()
        entry = json.dumps({"call": call, "method": method, "arguments": arguments}, sort_keys=True)
        try:
            store.set(_entry_key(call, self.rank), entry)
            if store.add(f"{_PREFIX}/count", 1) == call * self.world_size:
                verdict = store.compare_set(_verdict_key(call), "", self._judge(store, call))
                if call > 1:
                    store.delete_key(_verdict_key(call - 1))
            else:
                verdict = self._await(store, call, method, timeout, wait_source)
        except _GaveUp as gave_up:
            raise RuntimeError(str(gave_up)) from None
        except Exception as error:  # the store's errors differ between torch versions and stores
            raise RuntimeError(
                f"Cohort.{method} could not reach the key-value store through which the ranks agree on collective"
                f" calls ({type(error).__name__}: {error}); the process that holds it (rank 0, or torchrun's agent)"
                " has probably exited."
            ) from error
        found = json.loads(verdict)
        if found["kind"] == "exited":
            self.gone[found["rank"]] = found["calls"]
        if found["kind"] != "ok":
            raise RuntimeError(_explain(found, method, self.rank))

    def _judge(self, store: Any, call: int) -> str:
        entries = [json.loads(raw) for raw in store.multi_get([_entry_key(call, r) for r in range(self.world_size)])]
        if all(entry == entries[0] for entry in entries):
            return _OK
        return json.dumps({"kind": "mismatch", "text": _mismatch(entries)})

    def _await(self, store: Any, call: int, method: str, timeout: float, wait_source: str) -> bytes:
        try:
            store.wait([_verdict_key(call)], timedelta(seconds=timeout))
        except Exception as error:
            if not _is_timeout(error):
                raise
            missing = self._missing(store, call)
            self.gone.update(self._exited(store, missing))
            gave_up = json.dumps({"kind": "gave_up", "rank": self.rank, "method": method, "missing": missing})
            verdict = store.compare_set(_verdict_key(call), "", gave_up)
            if verdict == gave_up.encode():
                raise _GaveUp(_timed_out(method, self.rank, missing, self.gone, timeout, wait_source)) from None
            return verdict  # decided while this rank gave up
        return store.get(_verdict_key(call))

    def _missing(self, store: Any, call: int) -> list[int]:
        missing = []
        for rank in range(self.world_size):
            key = _entry_key(call, rank)
            if not store.check([key]) or json.loads(store.get(key))["call"] != call:
                missing.append(rank)
        return missing

    def _exited(self, store: Any, ranks: list[int]) -> dict[int, int]:
        """Of ``ranks``, those whose interpreter exited, with the number of calls each had made."""
        keys = {rank: f"{_PREFIX}/exited/{rank}" for rank in ranks}
        return {rank: int(store.get(key)) for rank, key in keys.items() if store.check([key])}

    def mark_exited(self) -> None:
        """Tell the other ranks that this process is ending: its next call (and an unfinished one) never comes."""
        store = self._store_of()
        store.set(f"{_PREFIX}/exited/{self.rank}", str(self.calls))
        exited = json.dumps({"kind": "exited", "rank": self.rank, "calls": self.calls})
        for call in (self.calls, self.calls + 1):
            if call > 0:
                store.compare_set(_verdict_key(call), "", exited)


class _GaveUp(Exception):
    """This rank stopped waiting (its message is the one raised)."""


def _entry_key(call: int, rank: int) -> str:
    return f"{_PREFIX}/entry/{call % 2}/{rank}"


def _verdict_key(call: int) -> str:
    return f"{_PREFIX}/verdict/{call}"


def _is_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return "timeout" in text or "timed out" in text


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _mismatch(entries: list[dict[str, Any]]) -> str:
    methods = {rank: entry["method"] for rank, entry in enumerate(entries)}
    if len(set(methods.values())) > 1 or len({entry["call"] for entry in entries}) > 1:
        return (
            f"The ranks called different collective Cohort methods at the same point: {methods}. Every rank must call"
            " the same collective methods (setup, save, load, load_raw, barrier, broadcast, all_reduce, all_gather)"
            " in the same order."
        )
    method = entries[0]["method"]
    names = sorted({name for entry in entries for name in entry["arguments"]})
    differing = [name for name in names if len({entry["arguments"].get(name) for entry in entries}) > 1]
    parts = []
    for name in differing:
        groups: dict[str, list[int]] = {}
        for rank, entry in enumerate(entries):
            groups.setdefault(str(entry["arguments"].get(name)), []).append(rank)
        parts.append(f"{name}: " + "; ".join(f"{value} on {_ranks(ranks)}" for value, ranks in groups.items()))
    hints = [_HINTS[name] for name in differing if name in _HINTS]
    advice = f" To fix it, {', and '.join(hints)}." if hints else ""
    return f"Cohort.{method} was called with different arguments on the ranks ({' | '.join(parts)}).{advice}"


def _exit_message(method: str, gone: dict[int, int]) -> str:
    ranks = ", ".join(f"rank {rank} (after {calls} collective Cohort call(s))" for rank, calls in sorted(gone.items()))
    return (
        f"Cohort.{method} cannot complete: {ranks} exited (its process ended) without reaching it. Every rank must call"
        " the same collective methods in the same order; a rank that ends early leaves the others waiting."
    )


def _timed_out(
    method: str, rank: int, missing: list[int], gone: dict[int, int], timeout: float, wait_source: str
) -> str:
    if any(r in gone for r in missing):
        return _exit_message(method, {r: gone[r] for r in missing if r in gone})
    return (
        f"Cohort.{method} must be called on every rank, but {_ranks(missing)} did not reach it within {timeout:g} s"
        f" (rank {rank} waited). A guard such as `if cohort.is_global_zero:` around a collective method deadlocks:"
        f" call it on every rank (Cohort.save writes once by itself). The wait is set by {wait_source}."
    )


def _explain(verdict: dict[str, Any], method: str, rank: int) -> str:
    kind = verdict["kind"]
    if kind == "mismatch":
        return verdict["text"]
    if kind == "exited":
        return _exit_message(method, {verdict["rank"]: verdict["calls"]})
    return (
        f"Cohort.{method} cannot complete on rank {rank}: rank {verdict['rank']} stopped waiting for this call (at"
        f" Cohort.{verdict['method']}), because {_ranks(verdict['missing'])} had not reached it in time."
    )


# ---------------------------------------------------------------------- this process's agreement
_state: dict[str, Any] = {"group": None, "agreement": None, "exit_notice": False}


def agreement_of_this_process() -> Agreement | None:
    """The agreement over the default process group (None without one, or at world size 1)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return None
    group = dist.group.WORLD
    known = _state["group"]
    if known is None or known() is not group:  # a new process group starts a new sequence of calls
        _state["group"] = weakref.ref(group)
        _state["agreement"] = Agreement(
            dist.distributed_c10d._get_default_store, dist.get_rank(), dist.get_world_size()
        )
    return _state["agreement"]


def notice_exit() -> None:
    """Arrange (once per process) for the other ranks to learn that this one exits (see the module's docstring)."""
    if agreement_of_this_process() is None or _state["exit_notice"]:
        return
    _state["exit_notice"] = True
    atexit.register(_announce_exit)
    # A process forked by multiprocessing ends with os._exit after running these finalizers, not the atexit handlers.
    multiprocessing_util.Finalize(None, _announce_exit, exitpriority=100)


def _announce_exit() -> None:
    if _state.get("announced"):
        return
    _state["announced"] = True
    agreement = _state["agreement"]
    known = _state["group"]
    if agreement is None or known is None or not dist.is_initialized() or known() is not dist.group.WORLD:
        return  # the process group ended before: nobody can wait for this process in it
    try:
        agreement.mark_exited()
    except Exception:  # the store's host may have exited already; nothing is waiting then
        pass


def agreement_timeout(strategy: Any, patient: bool) -> tuple[float, str]:
    """How long a collective Cohort call waits for the other ranks, and what sets it.

    ``barrier`` (``patient``) waits as long as the strategy's collectives (``timeout=``): work on rank zero alone before
    a barrier is a correct program. The other methods wait ``PHALANX_COHORT_AGREEMENT_TIMEOUT`` seconds at most.
    """
    given = getattr(strategy, "collective_timeout", None)
    collective = given.total_seconds() if isinstance(given, timedelta) else None
    if patient:
        if collective is None:
            collective = dist.distributed_c10d.default_pg_timeout.total_seconds()
        return collective, f"the strategy's timeout= ({collective:g} s), as for the collective itself"
    raw = os.environ.get(AGREEMENT_TIMEOUT_ENV)
    try:
        limit = DEFAULT_AGREEMENT_TIMEOUT if raw is None else float(raw)
    except ValueError:
        limit = math.nan
    if not limit > 0 or math.isinf(limit):
        raise ValueError(f"{AGREEMENT_TIMEOUT_ENV}={raw!r} must be a number of seconds > 0 (default 120).")
    if collective is not None and collective < limit:
        return collective, f"the strategy's timeout= ({collective:g} s), shorter than {AGREEMENT_TIMEOUT_ENV}"
    return limit, f"the environment variable {AGREEMENT_TIMEOUT_ENV} ({limit:g} s)"


def describe_module(module: Any) -> dict[str, str]:
    """A module's class and a digest of its parameters' names, shapes and dtypes: what the ranks compare at setup."""
    layout = hashlib.blake2b(digest_size=8)
    count = 0
    for name, parameter in module.named_parameters(remove_duplicate=False):
        layout.update(f"{name}:{tuple(parameter.shape)}:{parameter.dtype};".encode())
        count += 1
    return {"module": type(module).__qualname__, "parameters": f"{count} tensors, layout {layout.hexdigest()}"}


def agree_on_call(
    cohort: Any,
    method: str,
    arguments: dict[str, Any] | Callable[[], dict[str, Any]] | None = None,
    *,
    patient: bool = False,
) -> None:
    """Fail fast, on every rank that got here, when a collective Cohort method runs on some ranks only, ranks run
    different ones, or pass different ``arguments`` (a dict, or a callable making it: called only at world size > 1).
    Nothing at world size 1."""
    if cohort.world_size <= 1:
        return
    agreement = agreement_of_this_process()
    if agreement is None:
        return
    timeout, wait_source = agreement_timeout(cohort.strategy, patient)
    described = arguments() if callable(arguments) else (arguments or {})
    agreement.agree(method, {name: str(value) for name, value in described.items()}, timeout, wait_source)
