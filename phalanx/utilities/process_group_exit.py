"""Ending the process group at interpreter exit without the sporadic gloo abort.

When a collective finishes, the gloo worker thread that ran it drops its reference to the work a moment after the
caller's ``wait()`` returns. If that reference was the last one to a tensor whose Python object outlived Python's own
references, freeing it takes the GIL. Should the main thread have begun finalising the interpreter by then, CPython
ends the worker thread by unwinding it, the unwind through gloo's C++ frames calls std::terminate, and a job that
finished its work dies with "terminate called without an active exception" (torch 2.13: about 1 short DDP job in 12
here; a core dump shows ``~AsyncWork`` -> ``decref`` -> ``take_gil`` -> ``pthread_exit``; pytorch/pytorch#190489).
``destroy_process_group()`` alone does not help: DistributedDataParallel keeps the group and its threads alive.

The remedy is to let those threads finish while the interpreter is still whole: at exit, the main thread sleeps
briefly, without the GIL, before destroying the group. A barrier would not do: gloo's barrier holds the works still
in flight when it was queued and releases them, on a worker thread, after it returns.
"""

from __future__ import annotations

import atexit
import time

import torch

WORKER_DRAIN_SECONDS = 0.1
_state = {"registered": False}


def destroy_process_group_at_exit() -> None:
    """Arrange (once per process) for the default process group to be ended cleanly when the interpreter exits."""
    if not _state["registered"]:
        atexit.register(_end_process_group)
        _state["registered"] = True


def _end_process_group() -> None:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    time.sleep(WORKER_DRAIN_SECONDS)
    torch.distributed.destroy_process_group()
