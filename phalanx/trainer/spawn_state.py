"""What the Trainer carries back from the worker of global rank 0 when its strategy's launcher started new processes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from phalanx.trainer.trainer import Trainer


class TrainerWorkerState:
    """The Trainer's ``WorkerState``: after a spawned or forked run, the main process holds what rank 0 ended with.

    That is the module's weights, the progress counters, the callback metrics, the logged metrics, the callbacks'
    state (best model path, ...) with the folder each checkpoint callback resolved, and the loggers' versions, as if
    the run had happened in this process: a later stage logs to the same version and finds the same checkpoints.
    """

    def __init__(self, trainer: Trainer, module: torch.nn.Module | None) -> None:
        self._trainer = trainer
        # The module the user passed lives in the main process; in a worker this is that worker's copy.
        self._module = module

    def collect(self) -> dict[str, Any]:
        """In the worker of global rank 0: the state of its Trainer and module."""
        trainer = self._trainer
        module = trainer.strategy.module
        return {
            "state_dict": module.state_dict() if module is not None else None,
            "fit_loop": trainer.fit_loop.state_dict(),
            "callback_metrics": dict(trainer.callback_metrics),
            "logged_metrics": dict(trainer.logged_metrics),
            # By state key, not by position: configure_callbacks() added or replaced callbacks in this worker only.
            "callbacks": [
                (callback.state_key, callback.state_dict(), getattr(callback, "dirpath", None))
                for callback in trainer.callbacks
            ],
            "best_model_path": getattr(trainer.checkpoint_callback, "best_model_path", None),
            "loggers": [logger.worker_state() for logger in trainer.loggers],
            "ckpt_path": trainer.ckpt_path,
            "status": str(trainer.state.status),
            "preempted": trainer.preempted,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """In the main process: load rank 0's weights into the user's module and its progress into this Trainer."""
        module, trainer = self._module, self._trainer
        if module is not None and state["state_dict"] is not None:
            weights = state["state_dict"]
            if set(weights) - set(module.state_dict()) and callable(getattr(module, "configure_model", None)):
                # Layers made in configure_model exist only in the workers, which ran it: make them here too.
                with torch.no_grad():
                    module.configure_model()
            module.load_state_dict(weights)
        loop = trainer.fit_loop
        progress = state["fit_loop"]
        loop.current_epoch, loop.global_step = progress["epoch"], progress["global_step"]
        # A later fit continues from here (inside an interrupted epoch too, rebuilding its data order).
        loop.batches_stepped, loop._epoch_start_rng = progress["batches_stepped"], progress["epoch_start_rng"]
        loop.batches_done, loop.total_batches, loop.phase = (
            progress["batches_done"],
            progress["total_batches"],
            progress["phase"],
        )
        loop._epoch_open = progress["epoch_open"]
        trainer._metrics.callback = state["callback_metrics"]
        trainer._run.preempted = state["preempted"]
        trainer._metrics.logged = state["logged_metrics"]
        trainer._run.ckpt_path = state["ckpt_path"]
        for logger, logger_state in zip(trainer.loggers, state["loggers"]):
            logger.load_worker_state(logger_state)
        _restore_callbacks(trainer, state["callbacks"], state["best_model_path"])


def _restore_callbacks(trainer: Trainer, states: list[tuple[str, dict[str, Any], Any]], best_model_path: Any) -> None:
    """Give each of the main process's callbacks the state of the worker's callback with its state key (in order,
    for callbacks sharing one); a callback the worker did not have (configure_callbacks replaced it there) keeps its
    own, except that the checkpoint callback takes the best model path of the worker's, as Lightning's does."""
    by_key: dict[str, list[tuple[dict[str, Any], Any]]] = {}
    for key, callback_state, folder in states:
        by_key.setdefault(key, []).append((callback_state, folder))
    for callback in trainer.callbacks:
        found = by_key.get(callback.state_key)
        if not found:
            if callback is trainer.checkpoint_callback and best_model_path:
                callback.best_model_path = best_model_path  # type: ignore[attr-defined]
            continue
        callback_state, folder = found.pop(0)
        if folder is not None and getattr(callback, "dirpath", folder) is None:
            # The folder rank 0 resolved (from its logger's version): with it set here, the state below loads as it
            # is (instead of waiting for a set-up in this process) and later stages write to the same folder.
            callback.dirpath = folder  # type: ignore[attr-defined]
        if callback_state:
            callback.load_state_dict(callback_state)


__all__ = ["TrainerWorkerState"]
