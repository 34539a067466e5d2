"""DeviceStatsMonitor: the device's memory and utilisation (and the host's CPU and memory), logged every few steps."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from phalanx.callbacks.callback import Callback
from phalanx.utilities.messages import shown

if TYPE_CHECKING:
    from phalanx.module import TrainingModule
    from phalanx.trainer.trainer import Trainer


def cpu_stats() -> dict[str, float]:
    """The host's CPU use, memory use and swap use, in percent (``psutil``), under Lightning's names."""
    import psutil  # an optional dependency, loaded only by those who monitor the CPU

    return {
        "cpu_vm_percent": psutil.virtual_memory().percent,
        "cpu_percent": psutil.cpu_percent(),
        "cpu_swap_percent": psutil.swap_memory().percent,
    }


def _psutil_missing() -> bool:
    try:
        import psutil  # noqa: F401 - an optional dependency: only whether it imports matters here
    except ImportError:
        return True
    return False


class DeviceStatsMonitor(Callback):
    """Logs device statistics at the batch hooks of training, validation and test, as Lightning's
    ``DeviceStatsMonitor`` does: ``DeviceStatsMonitor.{hook}/{statistic}`` (``on_train_batch_start``,
    ``on_train_batch_end``, ``on_validation_batch_start``...), every ``log_every_n_steps`` optimizer steps, at the
    loggers' step.

    The statistics are the accelerator's (:meth:`~phalanx.accelerators.Accelerator.get_device_stats`: on CUDA
    ``torch.cuda.memory_stats`` — ``allocated_bytes.all.current``, ``reserved_bytes.all.peak``... — and, with
    ``pynvml`` installed, ``utilization.gpu`` in percent) and, on the CPU, the host's ``cpu_percent``,
    ``cpu_vm_percent`` and ``cpu_swap_percent`` (needs ``psutil``). Reading them waits for nothing on the device.

    Args:
        cpu_stats: None: the host's statistics only when training on the CPU; True: also with an accelerator;
            False: never (on the CPU then nothing is logged).

    Raises:
        ValueError: At fit's set-up, when the Trainer has no logger.
        ModuleNotFoundError: At fit's set-up, when the CPU is to be monitored and ``psutil`` is not installed.
    """

    def __init__(self, cpu_stats: bool | None = None) -> None:
        if cpu_stats not in (None, True, False):
            raise TypeError(f"cpu_stats={shown(cpu_stats)} is not valid; pass None, True or False.")
        self._cpu_stats = cpu_stats
        self._no_utilization = False  # set once reading the GPU's utilisation failed (no pynvml): not tried again

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if stage != "fit":
            return
        if not trainer.loggers:
            raise ValueError(
                "DeviceStatsMonitor needs a logger to write to, but the Trainer has none (logger=False); pass"
                " logger=True (or a logger), or remove the DeviceStatsMonitor callback."
            )
        on_cpu = trainer.strategy.root_device.type == "cpu"
        if (self._cpu_stats or (self._cpu_stats is None and on_cpu)) and _psutil_missing():
            raise ModuleNotFoundError(
                "DeviceStatsMonitor monitors the CPU with psutil, which is not installed: pip install psutil, or pass"
                " cpu_stats=False."
            )

    def _log(self, trainer: Trainer, hook: str, count: int) -> None:
        """Log at ``hook`` when ``count`` (the optimizer step in training, the batch in evaluation, counted from 1)
        is a multiple of ``log_every_n_steps``, or a stop is requested (Lightning's cadence)."""
        every = trainer.log_every_n_steps
        if not every or not trainer.loggers or (count % every != 0 and not trainer.should_stop):
            return
        device = trainer.strategy.root_device
        stats: dict[str, Any] = {}
        if device.type == "cpu":
            if self._cpu_stats is not False:
                stats = cpu_stats()
        else:
            stats = dict(trainer.strategy.accelerator.get_device_stats(device)) if trainer.strategy.accelerator else {}
            if device.type == "cuda" and not self._no_utilization:
                self._add_utilization(stats, device)
            if self._cpu_stats:
                stats.update(cpu_stats())
        if not stats:
            return
        for logger in trainer.loggers:
            separator = getattr(logger, "group_separator", "/")  # Lightning's Logger attribute, "/" by default
            prefixed = {f"{type(self).__qualname__}.{hook}{separator}{name}": value for name, value in stats.items()}
            logger.log_metrics(prefixed, step=trainer.fit_loop.batches_stepped)

    def _add_utilization(self, stats: dict[str, Any], device: torch.device) -> None:
        try:
            stats["utilization.gpu"] = torch.cuda.utilization(device)
        except (ModuleNotFoundError, RuntimeError):  # pynvml (or amdsmi) missing, or the driver refuses
            self._no_utilization = True

    def on_train_batch_start(self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int) -> None:
        self._log(trainer, "on_train_batch_start", trainer.fit_loop.batches_stepped + 1)

    def on_train_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, *_: Any) -> None:
        self._log(trainer, "on_train_batch_end", trainer.fit_loop.batches_stepped + 1)

    def on_validation_batch_start(
        self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int, *_: Any
    ) -> None:
        self._log(trainer, "on_validation_batch_start", batch_idx + 1)

    def on_validation_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int, *_: Any
    ) -> None:
        self._log(trainer, "on_validation_batch_end", batch_idx + 1)

    def on_test_batch_start(
        self, trainer: Trainer, module: TrainingModule, batch: Any, batch_idx: int, *_: Any
    ) -> None:
        self._log(trainer, "on_test_batch_start", batch_idx + 1)

    def on_test_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int, *_: Any
    ) -> None:
        self._log(trainer, "on_test_batch_end", batch_idx + 1)


__all__ = ["DeviceStatsMonitor", "cpu_stats"]
