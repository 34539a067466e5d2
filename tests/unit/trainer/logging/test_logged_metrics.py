"""The Trainer's published metrics (phalanx.trainer.logging.metrics): what callbacks, loggers and the progress bar see,
and when the loggers receive it, driven without a Trainer."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from phalanx.trainer.logging.metrics import LoggedMetrics


class _Results:
    """Stands in for LoggedResults: fixed step and epoch triples (callback, logged, progress bar)."""

    def __init__(self, step: tuple[dict, dict, dict], epoch: tuple[dict, dict, dict]) -> None:
        self.step, self.epoch = step, epoch

    def step_metrics(self) -> tuple[dict, dict, dict]:
        return self.step

    def epoch_metrics(self) -> tuple[dict, dict, dict]:
        return self.epoch


class _Logger:
    def __init__(self) -> None:
        self.metrics: list[tuple[dict[str, float], int]] = []
        self.hparams: list[dict[str, Any]] = []
        self.calls: list[str] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.metrics.append((metrics, step))

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.hparams.append(params)
        self.calls.append("log_hyperparams")

    def log_graph(self, model: Any) -> None:
        self.calls.append("log_graph")

    def save(self) -> None:
        self.calls.append("save")


def _trainer(loggers: int = 1, datamodule: Any = None, world_size: int = 1, sharded: bool = False) -> SimpleNamespace:
    traits = SimpleNamespace(pads_evaluation=sharded, requires_equal_batches=False)
    return SimpleNamespace(
        loggers=[_Logger() for _ in range(loggers)],
        current_epoch=2,
        fit_loop=SimpleNamespace(batches_stepped=7),
        datamodule=datamodule,
        strategy=SimpleNamespace(world_size=world_size, traits=traits),
    )


T = torch.tensor
STEP = ({"a": T(1.0), "b": T(2.0)}, {"a": T(1.0)}, {"b": T(2.0)})
EPOCH = ({"a_epoch": T(3.0)}, {"a_epoch": T(3.0)}, {})


def test_step_values_are_published_at_once_and_sent_to_loggers_only_when_logged():
    trainer = _trainer(loggers=2)
    metrics = LoggedMetrics(trainer)
    metrics.publish_step(_Results(STEP, EPOCH))
    assert (metrics.callback, metrics.logged, metrics.progress_bar) == STEP
    assert all(logger.metrics == [] for logger in trainer.loggers)
    metrics.log_step()
    for logger in trainer.loggers:
        assert logger.metrics == [({"a": 1.0, "epoch": 2.0}, 7)]
    metrics.log_step()  # nothing new since: nothing sent
    assert all(len(logger.metrics) == 1 for logger in trainer.loggers)


def test_epoch_aggregates_are_published_added_to_the_step_values_and_returned():
    metrics = LoggedMetrics(_trainer())
    results = _Results(STEP, EPOCH)
    metrics.publish_step(results)
    returned = metrics.publish_epoch(results)
    assert returned == EPOCH[0]
    assert set(metrics.callback) == {"a", "b", "a_epoch"}
    assert set(metrics.logged) == {"a", "a_epoch"}
    assert set(metrics.progress_bar) == {"b"}


@pytest.mark.parametrize(("epoch", "sent"), [(EPOCH, [({"a_epoch": 3.0, "epoch": 2.0}, 7)]), (({}, {}, {}), [])])
def test_log_epoch_sends_the_logged_aggregates(epoch, sent):
    trainer = _trainer()
    LoggedMetrics(trainer).log_epoch(_Results(STEP, epoch))
    assert trainer.loggers[0].metrics == sent


def test_reset_starts_new_dictionaries_and_keeps_pending_step_values():
    trainer = _trainer()
    metrics = LoggedMetrics(trainer)
    metrics.publish_step(_Results(STEP, EPOCH))
    kept = metrics.callback
    metrics.reset()
    assert (metrics.callback, metrics.logged, metrics.progress_bar) == ({}, {}, {})
    assert kept == STEP[0]  # a dictionary read before the reset keeps its values
    metrics.log_step()
    assert trainer.loggers[0].metrics == [({"a": 1.0, "epoch": 2.0}, 7)]


@pytest.mark.parametrize(
    ("module_hparams", "log_hyperparams", "datamodule_hparams", "expected"),
    [
        ({"lr": 0.1}, True, None, [{"lr": 0.1}]),
        ({"lr": 0.1}, True, {"batch_size": 4}, [{"lr": 0.1, "batch_size": 4}]),
        ({"lr": 0.1}, False, {"batch_size": 4}, [{"batch_size": 4}]),
        ({"lr": 0.1}, False, None, []),
        # As Lightning: a module without hyperparameters logs its (empty) set, which TensorBoard's hp_metric needs.
        ({}, True, None, [{}]),
    ],
)
def test_hyperparameters_of_the_module_and_datamodule_reach_the_loggers(
    module_hparams, log_hyperparams, datamodule_hparams, expected
):
    datamodule = SimpleNamespace(hparams=datamodule_hparams) if datamodule_hparams is not None else None
    trainer = _trainer(datamodule=datamodule)
    module = SimpleNamespace(hparams=module_hparams, _log_hyperparams=log_hyperparams)
    LoggedMetrics(trainer).log_hyperparameters(module)
    assert trainer.loggers[0].hparams == expected
    assert trainer.loggers[0].calls == ["log_hyperparams"] * len(expected) + ["log_graph", "save"]


@pytest.mark.parametrize(
    ("world_size", "sharded", "graph"), [(1, False, True), (2, False, True), (1, True, True), (2, True, False)]
)
def test_the_graph_is_not_traced_where_forward_passes_run_collectives_on_several_processes(world_size, sharded, graph):
    trainer = _trainer(world_size=world_size, sharded=sharded)
    LoggedMetrics(trainer).log_hyperparameters(SimpleNamespace(hparams={}, _log_hyperparams=True))
    assert ("log_graph" in trainer.loggers[0].calls) == graph


def test_without_loggers_nothing_is_sent_and_nothing_fails():
    trainer = _trainer(loggers=0)
    metrics = LoggedMetrics(trainer)
    results = _Results(STEP, EPOCH)
    metrics.publish_step(results)
    metrics.log_step()
    metrics.log_epoch(results)
    metrics.log_hyperparameters(SimpleNamespace(hparams={"lr": 0.1}))
    assert metrics.callback == STEP[0]
