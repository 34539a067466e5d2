"""Starts every rank with torch.multiprocessing (spawn, fork or forkserver) and brings rank 0's results back."""

from __future__ import annotations

import io
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
from typing import Any, Callable

import torch

from phalanx.strategies.launchers.launcher import Launcher, WorkerState
from phalanx.utilities.apply import apply_to_tensors
from phalanx.utilities.metric_objects import own_metric_states
from phalanx.utilities.seed import seed_everything

START_METHODS = ("spawn", "fork", "forkserver")


class MultiProcessingLauncher(Launcher):
    """The main process starts N workers, waits for them, then takes over rank 0's result and state.

    Each worker runs ``function`` with its own copy of the launcher's strategy (the same object that ``function``
    and ``worker_state`` reach in that worker). What rank 0 ended with comes back through ``worker_state``: under
    the Trainer, the module's weights, the progress counters, the callback metrics and the callbacks' state.
    """

    def __init__(self, strategy: Any, start_method: str = "spawn") -> None:
        if start_method not in START_METHODS:
            raise ValueError(
                f"start_method={start_method!r} is not valid for the multiprocessing launcher; choose one of"
                f" {START_METHODS}."
            )
        if start_method not in multiprocessing.get_all_start_methods():
            raise ValueError(
                f"start_method={start_method!r} is not available on this platform; available:"
                f" {multiprocessing.get_all_start_methods()}."
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
        """Run ``function`` in ``num_processes`` new processes, restore the ``worker_state`` of this node's first
        (rank 0 on a single machine) here, return its result."""
        # A spawned worker re-imports the main script while `_inheriting` is set: an unguarded fit() lands here.
        bootstrapping = getattr(multiprocessing.current_process(), "_inheriting", False)
        if (bootstrapping or multiprocessing.parent_process() is not None) and self._start_method != "fork":
            raise RuntimeError(
                f"strategy with start_method={self._start_method!r} was asked to start processes from inside a worker"
                ' process. Your script is missing an `if __name__ == "__main__":` guard around the code that calls'
                " Trainer.fit (each spawned process imports the script again)."
            )
        if self._start_method == "fork" and torch.cuda.is_available() and torch.cuda.is_initialized():
            raise RuntimeError(
                "Cannot fork processes after CUDA was initialised in the main process (CUDA does not survive a fork)."
                " Use strategy='ddp_spawn' or 'ddp', or avoid touching CUDA before Trainer.fit."
            )
        environment = self._strategy.cluster_environment
        os.environ["MASTER_ADDR"] = environment.main_address
        os.environ["MASTER_PORT"] = str(environment.main_port)
        # Rank 0's results travel through a file, not a pipe: a pipe blocks the writer once its buffer (64 KiB) is
        # full, while this process is still waiting for the workers to exit. The file is read with
        # weights_only=False (it may hold any predict_step output), so nobody else may be able to put it there: it
        # lives in a directory only this user can enter (mkdtemp: mode 0700, a fresh name), which another local
        # user cannot list, write or swap a file into, whatever the permissions of the temporary directory above.
        private = tempfile.mkdtemp(prefix="phalanx-results-")
        results_path = os.path.join(private, "results.pt")
        try:
            _start_processes(
                _run_rank,
                # One pickle for all of them: in a worker, the strategy is the one `function` and `worker_state` use.
                args=(
                    self._strategy,
                    function,
                    args,
                    kwargs,
                    results_path,
                    self._start_method,
                    _global_settings(),
                    worker_state,
                ),
                nprocs=self._strategy.num_processes,
                start_method=self._start_method,
            )
            worker_output = _read_results(results_path)
        finally:
            shutil.rmtree(private, ignore_errors=True)
        if worker_state is not None:
            worker_state.restore(worker_output["state"])
        return worker_output["result"]

    def kill(self, signum: int = signal.SIGKILL) -> None:
        """torch.multiprocessing stops the remaining workers itself when one fails."""


def _global_settings() -> dict[str, Any]:
    """torch's process-wide switches as set in the main process (``Trainer(deterministic=, benchmark=)``, the user)."""
    return {
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def _apply_global_settings(settings: dict[str, Any]) -> None:
    # A spawned interpreter starts with torch's defaults: without this, deterministic=True would not hold in the
    # ranks that actually train.
    torch.use_deterministic_algorithms(settings["deterministic"], warn_only=settings["deterministic_warn_only"])
    torch.backends.cudnn.benchmark = settings["cudnn_benchmark"]
    torch.backends.cudnn.deterministic = settings["cudnn_deterministic"]
    torch.set_float32_matmul_precision(settings["float32_matmul_precision"])


def _run_rank(
    local_rank: int,
    strategy: Any,
    function: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    results_path: str,
    start_method: str,
    settings: dict[str, Any],
    worker_state: WorkerState | None,
) -> None:
    os.environ["LOCAL_RANK"] = str(local_rank)
    _apply_global_settings(settings)
    if start_method == "fork":
        # A forked child inherits the parent's OpenMP thread pool in a broken state (libgomp is not fork-safe): its
        # first parallel region, e.g. DDP flattening a large buffer to broadcast it, would wait forever. One thread,
        # as torch's own forked DataLoader workers do.
        torch.set_num_threads(1)
    seed = os.environ.get("PHALANX_GLOBAL_SEED")
    if seed is not None and start_method != "fork":
        # A spawned interpreter starts with fresh generators; give it the seed the main process chose.
        seed_everything(int(seed), workers=os.environ.get("PHALANX_SEED_WORKERS") == "1")
    strategy._launched_local_rank = local_rank
    _own_module_tensors(args)
    result = function(*args, **kwargs)
    # The first worker of each node hands back to the main process of its node (each node runs one): global rank 0
    # alone would leave the other nodes' main processes without results.
    if local_rank == 0:
        payload = {"result": _cpu(result), "state": _cpu(worker_state.collect()) if worker_state is not None else None}
        _write_results(results_path, _to_bytes(payload), strategy.global_rank)


def _start_processes(function: Callable[..., Any], args: tuple, nprocs: int, start_method: str) -> None:
    """torch.multiprocessing.start_processes, with a clear error where torch's own hand-back of a worker's error
    failed: it keeps each worker's traceback in a file of the temporary directory, empty or cut short when that write
    failed (a full TMPDIR), which it then reports as ``EOFError: Ran out of input``."""
    try:
        torch.multiprocessing.start_processes(function, args=args, nprocs=nprocs, start_method=start_method, join=True)
    except (EOFError, pickle.UnpicklingError) as error:  # raised there only by unpickling that file
        directory = tempfile.gettempdir()
        raise RuntimeError(
            f"A worker process failed, and its error could not be handed back: torch.multiprocessing found the file it"
            f" keeps the worker's traceback in, in the temporary directory {directory}, empty or cut short"
            f" ({type(error).__name__}: {error}). {_room_in(directory)} The worker printed its own traceback on its"
            f" standard error, above."
        ) from error


def _room_in(directory: str) -> str:
    """What a message says of the room left on the file system of ``directory`` (TMPDIR)."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return f"Check that {directory} can be written (TMPDIR chooses it)."
    full = "it is full" if free < 1 << 20 else "check its space and quota"
    return (
        f"Its file system has {free} bytes free ({full}): free space there, or point TMPDIR at a file system with room."
    )


def _write_results(path: str, data: bytes, rank: int) -> None:
    try:
        with open(path, "wb") as results:
            results.write(data)
    except OSError as error:
        raise RuntimeError(
            f"Rank {rank} could not hand its results back to the main process: writing {len(data)} bytes to {path}"
            f" failed ({error}). {_room_in(os.path.dirname(path))}"
        ) from error


def _own_module_tensors(args: tuple) -> None:
    """Give this worker its own copy of each module tensor that arrived in shared memory.

    torch.multiprocessing hands tensors to spawned workers through shared memory, so without this every rank's
    optimizer would step the same storage and each update would land world_size times. Data tensors (datasets) stay
    shared: they are only read.
    """
    for module in (arg for arg in args if isinstance(arg, torch.nn.Module)):
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                if tensor.is_shared():
                    tensor.data = tensor.data.clone()
        own_metric_states(module)  # torchmetrics states are plain attributes: shared the same way


def _to_bytes(payload: dict[str, Any]) -> bytes:
    # Plain bytes, not shared-memory tensors: this worker exits before the main process reads them.
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def _read_results(path: str) -> dict[str, Any]:
    """What this node's first worker wrote into the private directory (see ``launch``), refusing a file this user
    does not own, and saying which file is missing or cut short, and why it may be."""
    try:
        results = open(path, "rb")
    except FileNotFoundError:
        raise RuntimeError(
            f"The workers ended without error, but the results the first worker of this node writes are not at {path}."
        ) from None
    with results:
        info = os.fstat(results.fileno())
        if hasattr(os, "getuid") and info.st_uid != os.getuid():
            raise RuntimeError(
                f"{path} belongs to user id {info.st_uid}, not to this process's user: refusing to unpickle it."
            )
        data = results.read()
    try:
        return _from_bytes(data)
    except (EOFError, RuntimeError, pickle.UnpicklingError) as error:
        raise RuntimeError(
            f"The results the first worker of this node wrote to {path} are cut short ({len(data)} bytes) and cannot"
            f" be read ({type(error).__name__}: {error}). {_room_in(os.path.dirname(path))}"
        ) from error


def _from_bytes(data: bytes) -> dict[str, Any]:
    # Written by our own worker a moment ago into a directory only this user can write (not a file from
    # elsewhere), and it may hold any predict_step output, which weights_only=True would refuse.
    return torch.load(io.BytesIO(data), weights_only=False)


def _cpu(state: Any) -> Any:
    return apply_to_tensors(state, lambda t: t.detach().cpu())
