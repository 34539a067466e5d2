"""Run a reader on hostile input in a forked child with an address-space limit and an alarm, as an attacker's file
would be met in production: a reader that allocates what the file claims fails there (not in the test process), and
one that blocks is killed instead of hanging the suite.
"""

from __future__ import annotations

import gc
import os
import pickle
import resource
import select
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

#: Address space the child may add to what it inherited: every attack asks for far more (1 GiB and up).
HEADROOM = 384 << 20
#: Seconds before the child is killed: every reader here decides in well under one.
ALARM = 20


@dataclass
class Outcome:
    """What the child did: ``error`` is the exception type's name (None when it returned), ``message`` its text."""

    error: str | None
    message: str
    read_bytes: int  # bytes the child read through read(2) and friends (/proc/self/io rchar), -1 where unknown

    def __str__(self) -> str:
        return f"{self.error}: {self.message}" if self.error else "returned normally"


def _address_space() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _rchar() -> int:
    try:
        with open("/proc/self/io") as handle:
            return next(int(line.split()[1]) for line in handle if line.startswith("rchar:"))
    except (OSError, StopIteration):
        return -1


def run_bounded(function: Callable[[], Any], *, headroom: int = HEADROOM, seconds: int = ALARM) -> Outcome:
    """Call ``function`` in a forked child limited to ``headroom`` more bytes of address space and ``seconds``."""
    if not sys.platform.startswith("linux"):
        import pytest

        pytest.skip("address-space limits and /proc are Linux's")
    limit = _address_space() + headroom
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        # Objects inherited from the parent (process groups, engines, compiled kernels of earlier tests) may hold
        # state of threads that did not survive the fork: the child's garbage collector must never finalise them (CI
        # saw a segfault "Garbage-collecting" here after an earlier test had left a DeepSpeed engine behind).
        gc.freeze()
        os.close(read_end)
        try:
            resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
            signal.alarm(seconds)  # the default action ends the process
            if "torch" in sys.modules:  # the parent's OpenMP threads did not survive the fork: run on this one only
                sys.modules["torch"].set_num_threads(1)
            before = _rchar()
            try:
                function()
                result = (None, "", _rchar() - before)
            except BaseException as error:  # noqa: BLE001 - reported to the parent
                result = (type(error).__name__, str(error)[:4000], _rchar() - before)
            os.write(write_end, pickle.dumps(result))
        finally:
            os._exit(0)
    os.close(write_end)
    data, deadline = b"", time.monotonic() + seconds + 30
    while time.monotonic() < deadline:
        ready, _, _ = select.select([read_end], [], [], 1.0)
        if ready:
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                break
            data += chunk
    else:
        os.kill(pid, signal.SIGKILL)
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    if not data:
        cause = f"killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else "no result"
        return Outcome("ChildDied", f"{cause} (hung past {seconds} s, or crashed)", -1)
    return Outcome(*pickle.loads(data))
