"""fit() on data that gives no batch returns at once with a warning naming the cause, whatever stops the run."""

from __future__ import annotations

import signal
import time
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

import pytest
import torch
from phalanx_testing import Regressor, parameters_of, quiet_trainer, regression_data, same_parameters
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

# fit() on these tiny models returns in milliseconds (once warm); a regression (the epoch loop spinning) fails on
# RETURNS_WITHIN_S, and the alarm at TIME_LIMIT_S cuts a hang off so that it cannot stall the test run.
RETURNS_WITHIN_S = 1.0
TIME_LIMIT_S = 5.0


@pytest.fixture(scope="module", autouse=True)
def _warm_up():
    # The first fit of a process imports and initialises what later ones reuse: keep that out of the timings.
    quiet_trainer(max_steps=1).fit(Regressor(), DataLoader(regression_data(8), batch_size=4))


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise TimeoutError in the main thread after ``seconds``: a hang fails the test instead of stalling CI."""

    def on_alarm(signum: int, frame: Any) -> None:
        raise TimeoutError(f"fit did not return within {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class NothingIterable(IterableDataset):
    def __iter__(self) -> Iterator[Any]:
        return iter(())


def empty_tensor_dataset() -> TensorDataset:
    return TensorDataset(torch.zeros(0, 4), torch.zeros(0, 1))


DATA = {
    "DataLoader over an empty list": (lambda: DataLoader([], batch_size=4), {}, "dataset (list) is empty"),
    "DataLoader over an empty dataset": (
        lambda: DataLoader(empty_tensor_dataset(), batch_size=4),
        {},
        "TensorDataset) is empty",
    ),
    "limit_train_batches=0": (
        lambda: DataLoader(regression_data(16), batch_size=4),
        {"limit_train_batches": 0},
        "limit_train_batches=0",
    ),
    "limit_train_batches=0.0": (
        lambda: DataLoader(regression_data(16), batch_size=4),
        {"limit_train_batches": 0.0},
        "limit_train_batches=0.0",
    ),
    "IterableDataset that yields nothing": (
        lambda: DataLoader(NothingIterable(), batch_size=4),
        {},
        "over NothingIterable) yielded nothing",
    ),
    "limit 0.0 on data without a length": (
        lambda: DataLoader(NothingIterable(), batch_size=4),
        {"limit_train_batches": 0.0},
        "limit_train_batches=0.0",
    ),
    "empty generator": (lambda: (batch for batch in []), {}, "generator, an iterator"),
    "drop_last, fewer samples than a batch": (
        lambda: DataLoader(regression_data(3), batch_size=4, drop_last=True),
        {},
        "drop_last=True drops the only, partial batch",
    ),
}
STOPS = {
    "max_steps, max_epochs=-1": {"max_steps": 5, "max_epochs": -1},
    "max_steps, max_epochs=None": {"max_steps": 5},
    "max_steps and max_time": {"max_steps": 5, "max_time": {"hours": 1}},
    "max_time only": {"max_time": {"hours": 1}, "max_epochs": -1},
}


@pytest.mark.parametrize("stop", list(STOPS.values()), ids=list(STOPS))
@pytest.mark.parametrize("make_data, limits, cause", list(DATA.values()), ids=list(DATA))
def test_fit_on_data_without_batches_warns_and_returns(make_data, limits, cause, stop):
    model = Regressor()
    before = parameters_of(model)
    trainer = quiet_trainer(num_sanity_val_steps=0, **limits, **stop)
    started = time.monotonic()
    with warnings.catch_warnings(record=True) as caught, time_limit(TIME_LIMIT_S):
        warnings.simplefilter("always")
        trainer.fit(model, make_data())
    assert time.monotonic() - started < RETURNS_WITHIN_S
    messages = [str(w.message) for w in caught if "no batch" in str(w.message)]
    assert len(messages) == 1, [str(w.message) for w in caught]
    assert cause in messages[0]
    assert trainer.global_step == 0
    assert same_parameters(before, parameters_of(model))


def test_a_generator_is_used_up_after_one_epoch_and_fit_stops_there():
    batches = [(torch.randn(4, 4), torch.randn(4, 1)) for _ in range(3)]
    trainer = quiet_trainer(max_steps=100, max_epochs=-1)
    with (
        pytest.warns(UserWarning, match=r"Epoch 1 trained no batch \(the training data is a generator, an iterator"),
        time_limit(TIME_LIMIT_S),
    ):
        trainer.fit(Regressor(), (batch for batch in batches))
    assert trainer.global_step == 3


def test_on_train_batch_start_skipping_every_epoch_without_an_epoch_limit_stops():
    class SkipsEverything(Regressor):
        def on_train_batch_start(self, batch, batch_idx):
            return -1

    trainer = quiet_trainer(max_steps=5, max_epochs=-1)
    with pytest.warns(UserWarning, match="on_train_batch_start returned -1"), time_limit(TIME_LIMIT_S):
        trainer.fit(SkipsEverything(), DataLoader(regression_data(16), batch_size=4))
    assert trainer.global_step == 0
    # With an epoch limit the hook may train in a later epoch: the epochs run as asked.
    trainer = quiet_trainer(max_epochs=3)
    with time_limit(TIME_LIMIT_S):
        trainer.fit(SkipsEverything(), DataLoader(regression_data(16), batch_size=4))
    assert trainer.current_epoch == 3


def test_an_empty_list_of_dataloaders_is_refused_at_once():
    with pytest.raises(ValueError, match="fit\\(\\) needs training data"), time_limit(TIME_LIMIT_S):
        quiet_trainer(max_steps=5, max_epochs=-1).fit(Regressor(), [])
