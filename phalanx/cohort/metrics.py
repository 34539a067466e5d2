"""Logging from a Cohort loop: ``cohort.log`` / ``cohort.log_dict``, and ``self.log`` of a TrainingModule that a Cohort
set up.

Every rank may call them (``sync_dist=True`` needs every rank to, as in the Trainer); only global rank zero converts
the values to numbers and hands them to the loggers, so the other ranks pay no host-device synchronisation. A
torchmetrics ``Metric`` is written as its ``compute()``, which torchmetrics synchronises across processes (every rank
must log it then); a Cohort has no epochs, so the loop resets it (``metric.reset()``) when its epoch ends.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable

from torch import Tensor, nn

from phalanx.cohort.guards import report_nonfinite
from phalanx.utilities.cleanup import method_calls, run_every
from phalanx.utilities.metric_objects import is_metric, is_metric_collection, loggable_items

if TYPE_CHECKING:
    from phalanx.cohort.cohort import Cohort
    from phalanx.loggers.logger import Logger
    from phalanx.strategies.strategy import Strategy

REDUCE_OPS = ("mean", "sum", "max", "min")

# The Cohort that set each module up. Weak both ways: the module keeps no Cohort alive, and deep copies or pickles of
# the module carry nothing of it.
_COHORTS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Cohort]] = weakref.WeakKeyDictionary()


def attach(module: nn.Module, cohort: Cohort) -> None:
    """Record that ``cohort`` runs ``module`` (its ``self.log`` and ``self.device_mesh`` then reach the Cohort)."""
    _COHORTS[module] = weakref.ref(cohort)


def cohort_of(module: nn.Module) -> Cohort | None:
    """The live Cohort that set ``module`` up, or None."""
    reference = _COHORTS.get(module)
    return reference() if reference is not None else None


def resolve_loggers(loggers: Any) -> list[Logger]:
    """``Cohort(loggers=...)``: None, one phalanx Logger, or a list or tuple of them."""
    # Lazy for import time: `from phalanx import Cohort` does not load phalanx.loggers.
    from phalanx.loggers.logger import logger_list

    if loggers is None:
        return []
    return logger_list(
        loggers,
        argument="Cohort(loggers",
        choices="None, a phalanx Logger (e.g. phalanx.loggers.CSVLogger(save_dir=...)) or a list of them",
    )


def share_logger_states(loggers: list[Logger], strategy: Strategy) -> None:
    """Every rank adopts the version or run id of rank 0's loggers (``phalanx.loggers.logger.share_logger_states``)."""
    # Lazy for import time: `from phalanx import Cohort` does not load phalanx.loggers.
    from phalanx.loggers.logger import share_logger_states as share

    share(loggers, strategy)


class LoggerWorkerState:
    """The Cohort's ``WorkerState``: what rank 0's loggers end with in a spawned worker (their version or run id),
    taken over by the loggers of the process that called ``launch``, so that they name the same run afterwards."""

    def __init__(self, loggers: list[Logger]) -> None:
        self._loggers = loggers

    def collect(self) -> dict[str, Any]:
        """In the worker of global rank 0: each logger's ``worker_state()``."""
        return {"loggers": [logger.worker_state() for logger in self._loggers]}

    def restore(self, state: dict[str, Any]) -> None:
        """In the launching process: each logger takes over its counterpart's state."""
        for logger, logger_state in zip(self._loggers, state["loggers"]):
            logger.load_worker_state(logger_state)


def check_metrics(metrics: Any, step: Any, caller: str) -> dict[str, Any]:
    """``metrics`` as a dict of names to numbers, one-element tensors or torchmetrics Metrics (checked without reading
    tensor values); a MetricCollection as its metrics."""
    if is_metric_collection(metrics):
        metrics = loggable_items(metrics)
    if not isinstance(metrics, Mapping):
        raise TypeError(f"{caller} takes a mapping of names to values, got {type(metrics).__name__}.")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"{caller}(step={step!r}): step must be an int >= 0, or None for the Cohort's global_step.")
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"{caller}: metric names must be non-empty str, got {name!r}.")
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"{caller}: metric {name!r} must be a number or a one-element tensor, got a tensor of shape"
                    f" {list(value.shape)}."
                )
        elif is_metric_collection(value):
            raise TypeError(f"{caller}: metric {name!r} is a MetricCollection; log it with log_dict(collection).")
        elif (isinstance(value, complex) or not isinstance(value, (int, float))) and not is_metric(value):
            kind = type(value).__name__
            raise TypeError(
                f"{caller}: metric {name!r} must be a number or a one-element tensor (or a Metric), got {kind}."
            )
    return dict(metrics)


def computed(metrics: dict[str, Any], caller: str) -> tuple[dict[str, Any], set[str]]:
    """``metrics`` with each torchmetrics Metric replaced by its ``compute()``, and the names that were Metrics.

    torchmetrics gathers the Metric's states from every process in ``compute()``: every rank must get here.
    """
    # In the mapping's order, the same on every rank (a set's order is not): the gathers must pair up across ranks.
    names = [name for name, value in metrics.items() if is_metric(value)]
    values = dict(metrics)
    for name in names:
        value = metrics[name].compute()
        if not isinstance(value, Tensor) or value.numel() != 1:
            shown = f"a tensor of shape {list(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(
                f"{caller}: the compute() of metric {name!r} gave {shown}; log a Metric that gives one number."
            )
        values[name] = value
    return values, set(names)


class CohortLogging:
    """The logging half of a Cohort: ``loggers``, ``log``, ``log_dict``, and what ``self.log`` of its module calls."""

    _loggers: list[Logger]
    _optimizer_steps: int
    is_global_zero: bool
    all_reduce: Callable[..., Any]

    @property
    def loggers(self) -> list[Logger]:
        """The loggers given as ``Cohort(loggers=...)``."""
        return list(self._loggers)

    @property
    def logger(self) -> Logger | None:
        """The first logger, or None."""
        return self._loggers[0] if self._loggers else None

    def log(self, name: str, value: Any, step: int | None = None) -> None:
        """Write ``value`` (a number or one-element tensor) as ``name`` to the loggers, on global rank zero only."""
        self._write({name: value}, step, "Cohort.log")

    def log_dict(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Write ``metrics`` as one entry (one CSV row) at ``step`` (default: ``global_step``), on global rank zero."""
        self._write(metrics, step, "Cohort.log_dict")

    def _write(self, metrics: Any, step: int | None, caller: str) -> None:
        metrics = check_metrics(metrics, step, caller)
        if not self._loggers:
            return
        metrics, _ = computed(metrics, caller)
        if not self.is_global_zero:
            return  # the other ranks never read the values: no device synchronisation for them
        report_nonfinite(self, caller.removeprefix("Cohort."))
        values = {
            name: value.detach().item() if isinstance(value, Tensor) else value for name, value in metrics.items()
        }
        for logger in self._loggers:
            logger.log_metrics(values, step=self._optimizer_steps if step is None else step)

    def _log_from_module(
        self,
        metrics: Mapping[str, Any],
        method: str,
        *,
        prog_bar: bool = False,
        logger: bool | None = None,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: Any = "mean",
        sync_dist: bool = False,
        batch_size: int | None = None,
        add_dataloader_idx: bool = True,
        metric_attribute: str | None = None,
    ) -> None:
        """``self.log`` / ``self.log_dict`` of the module this Cohort set up (the Trainer's keywords, same meaning
        where a Cohort has one).

        ``prog_bar``, ``on_step``, ``on_epoch``, ``batch_size``, ``add_dataloader_idx`` and ``metric_attribute`` belong
        to the Trainer's progress bar and epoch aggregation, which a Cohort does not have: values are written as they
        are logged, at the Cohort's ``global_step``. ``logger=False`` writes nothing; ``sync_dist=True`` reduces
        across processes first with ``reduce_fx`` (every process must log then, as under the Trainer). A torchmetrics
        ``Metric`` is written as its ``compute()``, which synchronises it (``sync_dist`` does not apply to it).
        """
        caller = f"self.{method}"
        metrics = check_metrics(metrics, None, caller)
        if logger is False or not self._loggers:
            return
        metrics, synchronised = computed(metrics, caller)
        if sync_dist:
            if reduce_fx not in REDUCE_OPS:
                raise ValueError(
                    f"{caller}(..., sync_dist=True, reduce_fx={reduce_fx!r}) under a Cohort: choose one of"
                    f" {list(REDUCE_OPS)}."
                )
            metrics = {
                name: value if name in synchronised else self.all_reduce(value, reduce_op=reduce_fx)
                for name, value in metrics.items()
            }
        self._write(metrics, None, caller)

    def _finalize_loggers(self, status: str, handling: BaseException | None = None) -> None:
        # Every logger is finalised, also after one raised; the error that ended the function (``handling``) stays
        # the one raised, with the loggers' failures as notes (without one, the first failure is raised).
        run_every(method_calls(self._loggers, "finalize", status), handling=handling)
