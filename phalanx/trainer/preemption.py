"""Preemption: a signal (SIGTERM, SIGUSR1, ...) becomes a checkpoint, a clean stop and a distinct exit status."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import threading
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

from phalanx.utilities.checks import check_int_at_least
from phalanx.utilities.rank_zero import rank_zero_info, rank_zero_warn

if TYPE_CHECKING:
    from phalanx.trainer.trainer import Trainer

#: Exit status of a process that stopped because it was preempted (EX_TEMPFAIL: "try again later").
PREEMPTED_EXIT_CODE = 75
_DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_REQUEUE_COMMAND = "scontrol requeue {job_id}"


class Preemption:
    """How ``fit`` reacts to being told to stop: on any of ``signals``, every rank saves a checkpoint at the next
    step boundary, training stops, and the process exits with :data:`PREEMPTED_EXIT_CODE` (``exit=True``).

    With several processes the ranks agree through one tiny all-reduce every ``check_every_n_steps`` batches (the
    only cost on steps without a signal); one process checks a flag every step, at no cost. Under SLURM the job is
    requeued (``scontrol requeue $SLURM_JOB_ID``; the ``PHALANX_REQUEUE_COMMAND`` environment variable replaces the
    command, with ``{job_id}`` substituted) when ``requeue`` is True, or when it is None and the SLURM environment
    has ``auto_requeue``.
    """

    def __init__(
        self,
        *,
        signals: Sequence[int] = _DEFAULT_SIGNALS,
        check_every_n_steps: int = 10,
        exit: bool = True,
        requeue: bool | None = None,
    ) -> None:  # noqa: A002
        check_int_at_least("check_every_n_steps", check_every_n_steps, 1)
        valid = set(signal.valid_signals())
        for signum in signals:
            if signum not in valid or signum in (signal.SIGKILL, signal.SIGSTOP):
                raise ValueError(
                    f"{signum!r} cannot be handled; use signals such as SIGTERM, SIGUSR1, SIGUSR2, SIGINT."
                )
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.check_every_n_steps = check_every_n_steps
        self.exit = exit
        self.requeue = requeue
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    # ------------------------------------------------------------------ signal handlers (installed during fit)
    def install(self) -> None:
        """Route the signals to this object (main thread only: Python delivers signals there)."""
        self.received = None
        if threading.current_thread() is not threading.main_thread():
            rank_zero_warn(
                "fit() runs outside the main thread: preemption signals cannot be handled and keep their "
                "default effect."
            )
            return
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def uninstall(self) -> None:
        """Give the signals their previous handlers back."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: the checkpoint is written at the next step boundary, where every rank can take part.
        self.received = signal.Signals(signum)

    # ------------------------------------------------------------------ at step boundaries
    def requested(self, trainer: Trainer, batches: int) -> bool:
        """Whether all ranks now agree to stop (called after every batch with the same count on every rank)."""
        strategy = trainer.strategy
        if strategy.world_size == 1:
            return self.received is not None
        if batches % self.check_every_n_steps:
            return False
        return strategy.reduce_boolean_decision(self.received is not None, all=False)

    def requeue_job(self, trainer: Trainer) -> None:
        """On rank 0 under SLURM (when enabled), ask SLURM to run the job again."""
        environment = getattr(trainer.strategy, "cluster_environment", None)
        job_id = os.environ.get("SLURM_JOB_ID")
        enabled = self.requeue if self.requeue is not None else bool(getattr(environment, "auto_requeue", False))
        if not enabled or job_id is None or not trainer.is_global_zero:
            return
        command = shlex.split(os.environ.get("PHALANX_REQUEUE_COMMAND", _REQUEUE_COMMAND).format(job_id=job_id))
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as error:
            rank_zero_warn(f"Requeueing SLURM job {job_id} with {command} failed: {error}")
            return
        if result.returncode == 0:
            rank_zero_info(f"Requeued SLURM job {job_id}.")
        else:
            rank_zero_warn(
                f"Requeueing SLURM job {job_id} with {command} failed ({result.returncode}): {result.stderr.strip()}"
            )


def save_preempted(trainer: Trainer, preemption: Preemption) -> None:
    """Once all ranks agree a preemption signal came (``PreemptionHandler.requested``, which the fit loop asks after
    every batch): save a checkpoint together, requeue the job if asked and mark the Trainer preempted (the fit loop
    then stops)."""
    signame = preemption.received.name if preemption.received is not None else "a signal on another rank"
    path = os.path.join(
        trainer.checkpoint_dir, f"preempted-epoch={trainer.current_epoch}-step={trainer.global_step}.ckpt"
    )
    rank_zero_info(f"Preempted ({signame}): saving {path} and stopping.")
    trainer.save_checkpoint(path)
    preemption.requeue_job(trainer)
    trainer._run.preempted = True
