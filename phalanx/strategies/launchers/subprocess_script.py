"""Starts ranks 1..N-1 by running the user's command line again, each with its rank in the environment."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from phalanx.plugins.environments.cluster_environment import ClusterEnvironment
from phalanx.strategies.launchers.launcher import Launcher, WorkerState

_PARENT_PID = "PHALANX_LAUNCHER_PID"
_POLL_SECONDS = 0.2
_PREEMPTED = 75  # phalanx.trainer.preemption.PREEMPTED_EXIT_CODE: a preempted child stops on purpose, like this process


def script_command() -> list[str]:
    """The command that started this process, re-runnable: ``python script.py args`` or ``python -m pkg args``."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name not in ("__main__", None):
        # `python -m package.module` (or a console script entry point that imports it)
        module = spec.name[: -len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return [sys.executable, "-m", module, *sys.argv[1:]]
    script = os.path.abspath(sys.argv[0])
    if not os.path.exists(script):
        raise RuntimeError(
            f"strategy='ddp' re-runs your script for each extra process, but {sys.argv[0]!r} is not a file (interactive"
            " session or notebook?). Use strategy='ddp_spawn' or 'ddp_notebook', or run a script."
        )
    return [sys.executable, script, *sys.argv[1:]]


class SubprocessScriptLauncher(Launcher):
    """Local rank 0 starts the other local ranks as new interpreters running the same command line.

    Local rank 0 watches its children: if one exits with an error, the rest are killed and this process exits with
    status 1. The children watch local rank 0 the same way, so no process is left waiting for a peer that is gone.
    """

    def __init__(self, cluster_environment: ClusterEnvironment, num_processes: int, num_nodes: int) -> None:
        self.cluster_environment = cluster_environment
        self.num_processes = num_processes
        self.num_nodes = num_nodes
        self.procs: list[subprocess.Popen] = []
        self._watchdog: threading.Thread | None = None
        self._stopping = False

    @property
    def is_interactive_compatible(self) -> bool:
        """A notebook has no script to re-run."""
        return False

    def launch(
        self, function: Callable[..., Any], *args: Any, worker_state: WorkerState | None = None, **kwargs: Any
    ) -> Any:
        """Start the children (once), then run ``function`` in this process (which keeps its state: nothing to carry
        back)."""
        if not self.cluster_environment.creates_processes_externally and not self.procs:
            local_rank = self.cluster_environment.local_rank()
            if local_rank != 0:
                # Only local rank 0 starts the others: from any other process, the job would get extra processes.
                raise RuntimeError(
                    f"This process has local rank {local_rank} but was asked to start the job's other processes,"
                    " which only local rank 0 does. Either LOCAL_RANK was set by hand, or the cluster environment"
                    f" ({type(self.cluster_environment).__name__}) says creates_processes_externally=False while"
                    " something else started this process."
                )
            self._start_children()
        return function(*args, **kwargs)

    def _start_children(self) -> None:
        environment = self.cluster_environment
        os.environ["MASTER_ADDR"] = environment.main_address
        os.environ["MASTER_PORT"] = str(environment.main_port)
        os.environ["NODE_RANK"] = str(environment.node_rank())
        os.environ["LOCAL_RANK"] = "0"
        os.environ["WORLD_SIZE"] = str(self.num_processes * self.num_nodes)
        if self.num_processes == 1:
            # Nothing to re-run on this node: one process per node works from a notebook or `python -c` too.
            return
        command = script_command()
        for local_rank in range(1, self.num_processes):
            child_environment = {**os.environ, "LOCAL_RANK": str(local_rank), _PARENT_PID: str(os.getpid())}
            self.procs.append(subprocess.Popen(command, env=child_environment))
        self._watchdog = threading.Thread(target=self._watch_children, name="phalanx-launcher-watchdog", daemon=True)
        self._watchdog.start()
        atexit.register(self._wait_for_children)

    def _watch_children(self) -> None:
        while not self._stopping:
            for proc in self.procs:
                code = proc.poll()
                if code is not None and code not in (0, _PREEMPTED):
                    self._stopping = True
                    print(
                        f"[phalanx] a process of this job exited with status {code}; stopping the others.",
                        file=sys.stderr,
                        flush=True,
                    )
                    self.kill()
                    os._exit(1)
            time.sleep(_POLL_SECONDS)

    def _wait_for_children(self) -> None:
        # At a normal exit of local rank 0, the children are finishing the same script: wait for them.
        self._stopping = True
        codes = [proc.wait() for proc in self.procs]
        if any(code not in (0, _PREEMPTED) for code in codes):
            os._exit(1)

    def kill(self, signum: int = signal.SIGKILL) -> None:
        """Kill every child (idempotent)."""
        self._stopping = True
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, signum)
                except ProcessLookupError:
                    pass


def watch_launcher_parent() -> None:
    """In a child started by SubprocessScriptLauncher: exit as soon as the launching process is gone."""
    parent = os.environ.get(_PARENT_PID)
    if parent is None or getattr(watch_launcher_parent, "started", False):
        return
    watch_launcher_parent.started = True  # type: ignore[attr-defined]
    parent_pid = int(parent)

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(_POLL_SECONDS)

    threading.Thread(target=watch, name="phalanx-parent-watchdog", daemon=True).start()
