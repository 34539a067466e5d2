"""What ``self.log`` records: per-step values and per-epoch aggregates, kept as tensors until someone reads them.

A torchmetrics ``Metric`` is logged as Lightning logs it: its forward value (the batch's) as the step value, its
``compute()`` over the epoch (synchronised across processes by torchmetrics itself) as the epoch value, and it is
reset when its results are.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from phalanx.utilities.metric_objects import check_metric_attribute, is_metric, is_metric_collection
from phalanx.utilities.rank_zero import rank_zero_warn

if TYPE_CHECKING:
    from phalanx.strategies.strategy import Strategy

_REDUCTIONS = ("mean", "sum", "max", "min")
# Hooks in which self.log aggregates per step unless told otherwise; everything else aggregates per epoch (as in
# Lightning).
_STEP_HOOKS = frozenset(
    {
        "training_step",
        "on_train_batch_start",
        "on_train_batch_end",
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "on_before_zero_grad",
        "optimizer_step",
        "optimizer_zero_grad",
    }
)
# Once per epoch or stage: a value logged there has no step, so on_step=True is refused (Lightning refuses it too).
_EPOCH_HOOKS = frozenset(
    f"on_{stage}_{when}" for stage in ("train", "validation", "test") for when in ("start", "epoch_start", "epoch_end")
)


class _LoggedMetric:
    """One logged name: its options, its latest step value and its running epoch aggregate."""

    __slots__ = (
        "name",
        "prog_bar",
        "logger",
        "on_step",
        "on_epoch",
        "reduce_fx",
        "sync_dist",
        "dataloader_idx",
        "step_value",
        "total",
        "count",
        "metric",
        "computed",
    )

    def __init__(
        self, name: str, prog_bar: bool, logger: bool, on_step: bool, on_epoch: bool, reduce_fx: str, sync_dist: bool
    ) -> None:
        self.name = name
        self.prog_bar = prog_bar
        self.logger = logger
        self.on_step = on_step
        self.on_epoch = on_epoch
        self.reduce_fx = reduce_fx
        self.sync_dist = sync_dist
        self.dataloader_idx: int | None = None  # the dataloader its name is suffixed with
        self.step_value: Tensor | None = None
        self.total: Tensor | None = None
        self.count = 0.0
        self.metric: Any = None  # the torchmetrics Metric logged under this name, if it is one
        self.computed: Tensor | None = None  # its compute() of this epoch, until it is logged again

    def accumulate(self, value: Tensor, batch_size: int) -> None:
        if self.total is None:
            self.total = value * batch_size if self.reduce_fx == "mean" else value.clone()
        elif self.reduce_fx == "mean":
            self.total = self.total + value * batch_size
        elif self.reduce_fx == "sum":
            self.total = self.total + value
        elif self.reduce_fx == "max":
            self.total = torch.maximum(self.total, value)
        else:
            self.total = torch.minimum(self.total, value)
        self.count += batch_size

    def epoch_value(self, strategy: Strategy) -> Tensor | None:
        if self.metric is not None:
            if self.computed is None:
                # Every rank gets here for every metric in the same order, as torchmetrics' gathering needs.
                self.computed = _scalar(self.name, self.metric.compute(), "compute() value")
            return self.computed
        if self.total is None:
            return None
        total = self.total
        if self.reduce_fx == "mean":
            count = torch.tensor(self.count, dtype=total.dtype, device=total.device)
            if self.sync_dist:
                total = strategy.reduce(total, reduce_op="sum")
                count = strategy.reduce(count, reduce_op="sum")
            return total / count
        if self.sync_dist:
            total = strategy.reduce(total, reduce_op=self.reduce_fx)
        return total


def infer_batch_size(batch: Any) -> int:
    """The first dimension of the first tensor found in ``batch`` (1 when there is none)."""
    if isinstance(batch, Tensor):
        return batch.shape[0] if batch.ndim else 1
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            size = infer_batch_size(item)
            if size != -1:
                return size
        return 1 if batch is not None else -1
    return -1


class LoggedResults:
    """The metrics logged during one stage (training, validation, test) of a run.

    A value is kept per hook and name, as in Lightning: the same name logged in ``training_step`` and again in
    ``on_train_epoch_end`` is two metrics, and at the epoch's end the one logged last replaces the other under that
    name. ``training=False`` (validation, test): step values reach the loggers and the progress bar, not the
    callbacks.
    """

    def __init__(self, strategy: Strategy, multiple_dataloaders: bool = False, training: bool = True) -> None:
        self._strategy = strategy
        self._metrics: dict[tuple[str | None, str], _LoggedMetric] = {}
        self.training = training
        self.multiple_dataloaders = multiple_dataloaders
        self.dataloader_idx: int = 0
        self.batch: Any = None
        self._batch_size: int | None = None
        self.step_updated = False

    def new_batch(self, batch: Any, dataloader_idx: int = 0) -> None:
        """Point batch-size inference at the batch about to be processed."""
        self.batch = batch
        self._batch_size = None
        self.dataloader_idx = dataloader_idx

    def log(
        self,
        fx_name: str | None,
        name: str,
        value: Any,
        *,
        prog_bar: bool,
        logger: bool,
        on_step: bool | None,
        on_epoch: bool | None,
        reduce_fx: str,
        sync_dist: bool,
        batch_size: int | None,
        add_dataloader_idx: bool,
        metric_attribute: str | None = None,
    ) -> None:
        """Record ``value`` under ``name`` (see ``TrainingModule.log``)."""
        if self.multiple_dataloaders and add_dataloader_idx:
            name = f"{name}/dataloader_idx_{self.dataloader_idx}"
        is_object = not isinstance(value, Tensor) and is_metric(value)
        metric = self._metrics.get((fx_name, name))
        if metric is None:
            # A Metric synchronises itself (torchmetrics gathers its states in compute()): sync_dist is not applied to
            # it, as in Lightning, and it counts as synchronised.
            sync_dist = sync_dist or is_object
            metric = self._new_metric(fx_name, name, prog_bar, logger, on_step, on_epoch, reduce_fx, sync_dist)
            if self.multiple_dataloaders and add_dataloader_idx:
                metric.dataloader_idx = self.dataloader_idx
        if is_object or metric.metric is not None:
            self._follow(metric, fx_name, value, metric_attribute)
            return
        value = self._as_tensor(name, value)
        if metric.on_step:
            metric.step_value = self._strategy.reduce(value, reduce_op=reduce_fx) if sync_dist else value
            self.step_updated = True
        if metric.on_epoch:
            if batch_size is None:
                if self._batch_size is None:
                    self._batch_size = max(infer_batch_size(self.batch), 1)
                batch_size = self._batch_size
            metric.accumulate(value, batch_size)

    def _new_metric(
        self,
        fx_name: str | None,
        name: str,
        prog_bar: bool,
        logger: bool,
        on_step: bool | None,
        on_epoch: bool | None,
        reduce_fx: str,
        sync_dist: bool,
    ) -> _LoggedMetric:
        if not isinstance(name, str) or not name:
            raise ValueError(f"self.log needs a non-empty string name, got {name!r}.")
        if reduce_fx not in _REDUCTIONS:
            raise ValueError(f"self.log({name!r}, ..., reduce_fx={reduce_fx!r}): choose one of {_REDUCTIONS}.")
        step_default = fx_name in _STEP_HOOKS
        on_step = step_default if on_step is None else on_step
        on_epoch = (not step_default) if on_epoch is None else on_epoch
        if not on_step and not on_epoch:
            raise ValueError(f"self.log({name!r}, ...) with on_step=False and on_epoch=False would record nothing.")
        if on_step and fx_name in _EPOCH_HOOKS:
            raise ValueError(
                f"self.log({name!r}, ..., on_step=True) in {fx_name}: that hook runs once per epoch, so there is no"
                " step value to log. Drop on_step=True (the value is kept per epoch there), or log it in a step hook"
                " such as training_step or validation_step."
            )
        metric = _LoggedMetric(name, prog_bar, logger, on_step, on_epoch, reduce_fx, sync_dist)
        if on_epoch and not sync_dist and self._strategy.world_size > 1:
            rank_zero_warn(
                f"self.log({name!r}, ...) aggregates over the epoch without sync_dist=True: with several processes each"
                " rank keeps its own value (and callbacks may decide differently per rank). Pass sync_dist=True."
            )
        self._metrics[(fx_name, name)] = metric
        return metric

    def _follow(self, metric: _LoggedMetric, fx_name: str | None, value: Any, metric_attribute: str | None) -> None:
        """Log the torchmetrics Metric ``value`` under ``metric``'s name: its forward value now, compute() later."""
        plain_before = metric.metric is None and (metric.total is not None or metric.step_value is not None)
        if plain_before or not is_metric(value):
            raise TypeError(
                f"self.log({metric.name!r}, ...) in {fx_name} got a torchmetrics Metric and plain values for one name."
                " Log either a Metric or numbers and tensors under a name."
            )
        if value is not metric.metric:
            if metric_attribute is None:
                check_metric_attribute(self._strategy.module, value, metric.name.partition("/dataloader_idx_")[0])
            metric.metric = value
        metric.computed = None  # an update since the last compute() changes it
        if metric.on_step:
            forward = value._forward_cache  # None when only update() ran: no step value, as in Lightning
            metric.step_value = None if forward is None else _scalar(metric.name, forward, "forward value")
            self.step_updated = self.step_updated or forward is not None

    def _as_tensor(self, name: str, value: Any) -> Tensor:
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"self.log({name!r}, ...) got a tensor of shape {tuple(value.shape)}; log scalars (one element)."
                )
            value = value.detach()
            if not value.is_floating_point():
                value = value.float()
            return value.reshape(())
        if isinstance(value, numbers.Number) and not isinstance(value, complex):
            return torch.tensor(float(value))
        if is_metric_collection(value):
            raise TypeError(
                f"self.log({name!r}, ...) got a torchmetrics MetricCollection; log it with self.log_dict(collection),"
                " which logs each of its metrics under its own name."
            )
        kind = type(value).__name__
        raise TypeError(
            f"self.log({name!r}, ...) got {kind}; log a number, a one-element tensor or a torchmetrics Metric."
        )

    def _names(self, metric: _LoggedMetric, kind: str) -> str:
        if metric.on_step and metric.on_epoch:
            head, _, tail = metric.name.partition("/dataloader_idx_")
            suffixed = f"{head}_{kind}"
            return f"{suffixed}/dataloader_idx_{tail}" if tail else suffixed
        return metric.name

    def step_metrics(self) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
        """Return (callback, logger, progress bar) metrics from the latest step values (no callback metrics outside
        training, as in Lightning: callbacks see the epoch values of validation and test)."""
        self.step_updated = False
        callback: dict[str, Tensor] = {}
        logged: dict[str, Tensor] = {}
        bar: dict[str, Tensor] = {}
        for metric in self._metrics.values():
            if metric.step_value is None or metric.dataloader_idx not in (None, self.dataloader_idx):
                continue  # as in Lightning, a step reports the values of the dataloader it ran on
            key = self._names(metric, "step")
            if self.training:
                callback[key] = metric.step_value
                callback[metric.name] = metric.step_value
            if metric.logger:
                logged[key] = metric.step_value
            if metric.prog_bar:
                bar[key] = metric.step_value
        return callback, logged, bar

    def epoch_metrics(self) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
        """Return (callback, logger, progress bar) metrics from the epoch aggregates (synchronised if asked)."""
        callback: dict[str, Tensor] = {}
        logged: dict[str, Tensor] = {}
        bar: dict[str, Tensor] = {}
        for metric in self._metrics.values():
            value = metric.epoch_value(self._strategy) if metric.on_epoch else None
            if value is None:
                continue
            key = self._names(metric, "epoch")
            callback[key] = value
            callback[metric.name] = value
            if metric.logger:
                logged[key] = value
            if metric.prog_bar:
                bar[key] = value
        return callback, logged, bar

    def reset(self) -> None:
        """Forget everything (an epoch or stage ended, or a new one begins), and reset the torchmetrics Metrics
        logged, as Lightning does at the same points."""
        for metric in self._metrics.values():
            if metric.metric is not None:
                metric.metric.reset()
        self._metrics.clear()
        self.step_updated = False


def _scalar(name: str, value: Any, what: str) -> Tensor:
    """A logged Metric's forward or compute() value, detached; refused unless it is a one-element tensor."""
    if not isinstance(value, Tensor) or value.numel() != 1:
        shown = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(
            f"self.log({name!r}, <Metric>): its {what} is {shown}, but a logged Metric must give one number."
            " Log a Metric that reduces to one value (e.g. average='macro'), or log the parts of compute() yourself."
        )
    return value.detach().reshape(())
