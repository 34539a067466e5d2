"""Start several runs of the same work at the same instant, in threads or in forked processes, and collect results."""

from __future__ import annotations

import multiprocessing
import threading
from typing import Any, Callable


def in_threads(work: Callable[[int, Any], Any], runs: int, timeout: float = 20) -> dict[int, Any]:
    """``work(run, barrier)`` in ``runs`` threads released together by the barrier; an error in any is raised here."""
    barrier = threading.Barrier(runs)
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def one(run: int) -> None:
        try:
            results[run] = work(run, barrier)
        except BaseException as error:  # raised below: an assertion inside a thread would be lost
            errors.append(error)

    threads = [threading.Thread(target=one, args=(run,)) for run in range(runs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    assert not any(thread.is_alive() for thread in threads), "a run did not finish"
    if errors:
        raise errors[0]
    return results


def in_processes(work: Callable[[int, Any], Any], runs: int, timeout: float = 20) -> dict[int, Any]:
    """``work(run, barrier)`` in ``runs`` forked processes released together (forked: no re-import, so they start
    within milliseconds); a run that failed gives the text of its error instead of a result."""
    context = multiprocessing.get_context("fork")
    barrier, queue = context.Barrier(runs), context.Queue()

    def one(run: int) -> None:
        try:
            queue.put((run, work(run, barrier)))
        except BaseException as error:  # noqa: BLE001 - reported to the parent, which asserts on it
            queue.put((run, f"error: {error!r}"))

    processes = [context.Process(target=one, args=(run,)) for run in range(runs)]
    for process in processes:
        process.start()
    try:
        return dict(queue.get(timeout=timeout) for _ in range(runs))
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
