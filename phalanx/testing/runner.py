"""Starting the ranks of a conformance run, waiting for them (never forever), and merging what they report."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from phalanx.testing.report import CHECKS_BY_DRIVER, DRIVERS, ConformanceReport, last_started, merge, read_rank
from phalanx.testing.worker import WorkerSpec, worker_main
from phalanx.utilities.checks import check_int_at_least, is_number

START_METHODS = ("spawn", "forkserver", "fork")
#: Once a rank has ended with an error, how long the others get to finish before they are stopped (they may be
#: waiting in a collective the failed rank will never join).
PEER_GRACE_S = 20.0


def run_conformance(
    make_strategy: Callable[[], Any],
    *,
    processes: int = 1,
    checks: tuple[str, ...] | list[str] | None = None,
    timeout: float = 300.0,
    workdir: str | os.PathLike | None = None,
    start_method: str = "spawn",
    resume_atol: float = 0.0,
    drivers: tuple[str, ...] | list[str] = DRIVERS,
) -> ConformanceReport:
    """Run the conformance checks on ``processes`` CPU processes (gloo); return the report (raise for bad arguments).

    ``make_strategy`` builds the strategy in each process (a Strategy subclass, or a module-level function or
    ``functools.partial``: spawned processes receive it pickled). ``drivers`` selects what drives the strategy:
    ``"trainer"`` (``Trainer.fit`` with its defaults on, the checks of ``CHECKS``) and ``"cohort"`` (a hand-written
    ``phalanx.Cohort`` loop with save, load and resume, the checks of ``COHORT_CHECKS``). ``checks`` selects check
    names; each driver runs those it has.
    ``timeout`` bounds the whole run in seconds: ranks still running then are stopped and their unfinished checks
    fail. ``workdir`` keeps the run's checkpoints and per-rank results (in a new subdirectory); by default they go to
    a temporary directory removed afterwards. ``resume_atol`` is the largest weight difference allowed between the
    resumed and the uninterrupted fit (0: bitwise equal).
    """
    _check_arguments(make_strategy, processes, timeout, start_method, resume_atol)
    selected = selected_checks(checks, drivers)
    own_directory = workdir is None
    if workdir is not None and not Path(workdir).is_dir():
        raise ValueError(f"workdir={str(workdir)!r} is not an existing directory.")
    directory = Path(tempfile.mkdtemp(prefix="phalanx-conformance-", dir=None if own_directory else workdir))
    try:
        spec = WorkerSpec(make_strategy, processes, selected, str(directory), _free_port(), float(resume_atol))
        stopped = _launch(spec, start_method, timeout)
        ranks = [read_rank(directory, rank) for rank in range(processes)]
        return merge(_strategy_name(make_strategy), processes, selected, ranks, stopped)
    finally:
        if own_directory:
            shutil.rmtree(directory, ignore_errors=True)  # only the directory this call created


def check_strategy(make_strategy: Callable[[], Any], **options: Any) -> ConformanceReport:
    """Run the conformance checks (options of ``run_conformance``); raise StrategyConformanceError listing failures."""
    report = run_conformance(make_strategy, **options)
    report.assert_passed()
    return report


def selected_checks(checks: Any, drivers: Any) -> dict[str, tuple[str, ...]]:
    """Driver -> the checks it runs, from ``checks=`` and ``drivers=`` (raise for names that are not valid)."""
    if isinstance(drivers, str) or not isinstance(drivers, (tuple, list)):
        raise TypeError(f"drivers={drivers!r} must be a list of driver names; choose from {list(DRIVERS)}.")
    unknown_drivers = [driver for driver in drivers if driver not in DRIVERS]
    if unknown_drivers or not drivers:
        raise ValueError(
            f"drivers={list(drivers)!r} is not valid: {unknown_drivers or 'empty'}; choose from {list(DRIVERS)}."
        )
    names = list(dict.fromkeys(name for driver in DRIVERS for name in CHECKS_BY_DRIVER[driver]))
    if isinstance(checks, str):
        raise TypeError(f"checks={checks!r} must be a list of check names, not a string; choose from {names}.")
    wanted = names if checks is None else list(checks)
    unknown = [check for check in wanted if check not in names]
    if unknown or not wanted:
        raise ValueError(f"checks={wanted!r} is not valid: {unknown or 'empty'}; choose from {names}.")
    selected = {
        driver: tuple(check for check in CHECKS_BY_DRIVER[driver] if check in wanted)
        for driver in DRIVERS
        if driver in drivers
    }
    selected = {driver: driver_checks for driver, driver_checks in selected.items() if driver_checks}
    if not selected:
        raise ValueError(
            f"checks={wanted!r} has no check that drivers={list(drivers)!r} run; their checks:"
            f" { {driver: list(CHECKS_BY_DRIVER[driver]) for driver in drivers} }."
        )
    return selected


def _check_arguments(make_strategy: Any, processes: Any, timeout: Any, start_method: Any, resume_atol: Any) -> None:
    if not callable(make_strategy):
        raise TypeError(
            "make_strategy must be a Strategy subclass or a function returning a Strategy instance, got"
            f" {type(make_strategy).__name__}."
        )
    check_int_at_least("processes", processes, 1, " (the kit runs 1 or more CPU processes)")
    if not is_number(timeout) or not timeout > 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds.")
    if start_method not in START_METHODS or start_method not in multiprocessing.get_all_start_methods():
        raise ValueError(
            f"start_method={start_method!r} is not valid here; choose one of"
            f" {[m for m in START_METHODS if m in multiprocessing.get_all_start_methods()]}."
        )
    if not is_number(resume_atol) or resume_atol < 0:
        raise ValueError(f"resume_atol={resume_atol!r} must be a number >= 0.")
    if start_method != "fork":
        try:
            pickle.dumps(make_strategy)
        except Exception as error:  # noqa: BLE001 - any pickling failure means the same thing here
            raise TypeError(
                f"make_strategy ({make_strategy!r}) cannot be pickled ({error}); with start_method={start_method!r}"
                " each process receives it pickled: pass the Strategy class, a module-level function or a"
                " functools.partial."
            ) from None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _strategy_name(make_strategy: Any) -> str:
    target = getattr(make_strategy, "func", make_strategy)  # functools.partial
    return getattr(target, "__qualname__", None) or type(target).__name__


def _launch(spec: WorkerSpec, start_method: str, timeout: float) -> dict[int, str]:
    """Start every rank and wait; returns, per rank that had to be stopped or died, why."""
    context = multiprocessing.get_context(start_method)
    workers = [
        context.Process(  # type: ignore[attr-defined]  # every start method's context has Process
            target=worker_main, args=(rank, spec), name=f"phalanx-conformance-rank{rank}"
        )
        for rank in range(spec.processes)
    ]
    for worker in workers:
        worker.start()
    failed_peer: int | None = None
    reasons: dict[int, str] = {}
    try:
        failed_peer = _wait(workers, time.monotonic() + timeout, spec)
    finally:
        for rank, worker in enumerate(workers):
            step = None
            if worker.is_alive():
                _stop(worker)
                step = last_started(Path(spec.directory), rank) or "start-up"
                why = (
                    f"rank {failed_peer} ended with an error {PEER_GRACE_S:g} s earlier"
                    if failed_peer is not None
                    else f"the run reached its {timeout:g} s timeout"
                )
                reasons[rank] = (
                    f"stopped while running {step!r}: {why} (a collective that not every rank joins waits forever)"
                )
            elif worker.exitcode not in (0, None):
                step = last_started(Path(spec.directory), rank) or "start-up"
                reasons[rank] = f"the process died with exit code {worker.exitcode} while running {step!r}"
    return reasons


def _wait(workers: list[Any], deadline: float, spec: WorkerSpec) -> int | None:
    """Wait until every worker ended or ``deadline``; returns the rank that ended with an error first, if one did."""
    failed: int | None = None
    while any(worker.is_alive() for worker in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
        if failed is None:
            failed = next(
                (
                    rank
                    for rank, worker in enumerate(workers)
                    if not worker.is_alive() and (worker.exitcode != 0 or _reported_fatal(spec, rank))
                ),
                None,
            )
            if failed is not None:
                deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
    return failed


def _stop(worker: Any) -> None:
    worker.terminate()
    worker.join(5)
    if worker.is_alive():
        worker.kill()
        worker.join(5)


def _reported_fatal(spec: WorkerSpec, rank: int) -> bool:
    found = read_rank(Path(spec.directory), rank)
    return bool(found and found.get("fatal"))
