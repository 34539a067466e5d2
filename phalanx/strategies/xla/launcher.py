"""Starts one replica per XLA device through torch_xla's own launcher and brings rank 0's results back.

``torch_xla.launch`` starts one process per TPU chip (on the CPU runtime: one process), and inside it one thread per
device that process addresses. Threads share every object they are given, so each replica first takes its own deep
copy of what the driver passed (the strategy, the function and its arguments: under the Trainer, the Trainer and the
module), the way spawned processes each unpickle their own; it also gets its own rank for the rank-zero helpers.
"""

from __future__ import annotations

import copy
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from phalanx.accelerators import xla as xla_accelerator  # read through the module on use: tests replace device_type
from phalanx.strategies.launchers.launcher import Launcher, WorkerState
from phalanx.strategies.launchers.multiprocessing import (
    _apply_global_settings,
    _cpu,
    _global_settings,
    _read_results,
    _to_bytes,
)
from phalanx.strategies.xla._collectives import PeerReplicaFailed, join_replica_threads, threads_share_process
from phalanx.utilities.rank_zero import use_thread_rank

XLA_START_METHODS = ("spawn", "fork")
_COPY_LOCK = threading.Lock()


class XLALauncher(Launcher):
    """Runs the driver's function on every XLA device with ``torch_xla.launch`` (a new process, unless one device)."""

    def __init__(self, strategy: Any, start_method: str = "spawn") -> None:
        if start_method not in XLA_START_METHODS:
            raise ValueError(
                f"start_method={start_method!r} is not valid for the XLA launcher; choose one of {XLA_START_METHODS}."
            )
        self._strategy = strategy
        self._start_method = start_method

    @property
    def is_interactive_compatible(self) -> bool:
        """Fork works from a notebook; spawn needs importable code."""
        return self._start_method == "fork"

    def launch(
        self, function: Callable[..., Any], *args: Any, worker_state: WorkerState | None = None, **kwargs: Any
    ) -> Any:
        """Run ``function`` on every device, restore rank 0's ``worker_state`` here, return its result."""
        torch_xla = xla_accelerator.import_torch_xla()
        single = self._strategy.num_processes == 1
        if single or torch.distributed.is_torchelastic_launched():
            # torch_xla runs this process's replica right here (one device, or one process per device started by
            # torchrun): nothing to copy, nothing to bring back.
            box: list[Any] = []
            with _variables(self._environment(threads=False)):
                torch_xla.launch(
                    _run_here, args=(box, self._strategy, function, args, kwargs), debug_single_process=single
                )
            return box[0]
        private = tempfile.mkdtemp(prefix="phalanx-xla-results-")
        results_path = os.path.join(private, "results.pt")
        payload = (self._strategy, function, args, kwargs, worker_state)
        try:
            try:
                with _variables(self._environment(threads=True)):
                    torch_xla.launch(
                        _run_replica,
                        args=(payload, results_path, _global_settings()),
                        start_method=self._start_method,
                    )
            except Exception as error:
                # torch_xla re-raises the error of the first replica in rank order, which may only say that another
                # replica failed: raise the one that failed first.
                first = _read_failure(private)
                if first is not None:
                    raise first from error
                raise
            worker_output = _read_results(results_path)
        finally:
            shutil.rmtree(private, ignore_errors=True)
        if worker_state is not None:
            worker_state.restore(worker_output["state"])
        return worker_output["result"]

    def _environment(self, threads: bool) -> dict[str, str]:
        variables = dict(getattr(self._strategy, "launch_environment", dict)())
        if threads and xla_accelerator.device_type() == "CPU":
            # Replicas are threads of one process there. Buffer donation can make a thread's graph launch wait, inside
            # the lock that serialises launches (see xla_collectives), for a collective that needs the other thread.
            variables["XLA_ENABLE_PARAM_ALIASING"] = "0"
        return variables

    def kill(self, signum: int = signal.SIGKILL) -> None:
        """torch_xla's launcher ends its process pool itself when a replica fails."""


@contextmanager
def _variables(variables: dict[str, str]) -> Iterator[None]:
    """Set the variables the user did not set, for the launched process (which reads them at start); then unset."""
    added = [name for name in variables if name not in os.environ]
    for name in added:
        os.environ[name] = variables[name]
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _run_here(
    index: int, box: list[Any], strategy: Any, function: Callable[..., Any], args: tuple, kwargs: dict
) -> None:
    strategy._launched = True
    box.append(function(*args, **kwargs))


def _run_replica(index: int, payload: tuple, results_path: str, settings: dict[str, Any]) -> None:
    import torch_xla.runtime as xr

    barrier = None
    if threads_share_process():
        with _COPY_LOCK:
            # torch's switches are process-wide (set concurrently from two threads, they have crashed the process):
            # the first replica thread sets them.
            _apply_settings_once(settings)
            # The threads of this process received the same objects: each replica trains its own copy.
            payload = copy.deepcopy(payload)
        use_thread_rank(xr.global_ordinal())
        barrier = join_replica_threads(xr.addressable_device_count(), payload[0].replica_timeout.total_seconds())
    else:
        _apply_settings_once(settings)
    strategy, function, args, kwargs, worker_state = payload
    strategy._launched = True
    try:
        result = function(*args, **kwargs)
    except BaseException as error:
        if barrier is not None:
            if not isinstance(error, PeerReplicaFailed):
                print(f"[phalanx] XLA replica {xr.global_ordinal()} failed:\n{traceback.format_exc()}", file=sys.stderr)
                _record_failure(os.path.dirname(results_path), error)
            # The other threads stop at their next graph cut instead of waiting for this one.
            barrier.abort()
        if isinstance(error, RuntimeError) and "device_ready_queues_" in str(error):
            raise RuntimeError(
                "torch's autograd engine cannot run on XLA devices in a process forked after a backward pass ran in"
                " the launching process: use XLAStrategy(start_method='spawn') (the default), or start training"
                " before any other backward pass in that process."
            ) from error
        raise
    if strategy.global_rank == 0:
        state = _cpu(worker_state.collect()) if worker_state is not None else None
        with open(results_path, "wb") as results:
            results.write(_to_bytes({"result": _cpu(result), "state": state}))


_SETTINGS_APPLIED = False


def _apply_settings_once(settings: dict[str, Any]) -> None:
    global _SETTINGS_APPLIED
    if not _SETTINGS_APPLIED:
        _apply_global_settings(settings)
        _SETTINGS_APPLIED = True


def _record_failure(directory: str, error: BaseException) -> None:
    """Keep the first replica failure (the directory is the launch's private one, see MultiProcessingLauncher)."""
    try:
        with open(os.path.join(directory, "failure.pickle"), "xb") as file:
            file.write(pickle.dumps(error))
    except (FileExistsError, pickle.PicklingError, TypeError, AttributeError):
        pass  # another replica failed first, or the error cannot travel: torch_xla's own report stands


def _read_failure(directory: str) -> BaseException | None:
    path = os.path.join(directory, "failure.pickle")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as file:
        # Written a moment ago by this job's own replica into a directory only this user can enter.
        return pickle.loads(file.read())
