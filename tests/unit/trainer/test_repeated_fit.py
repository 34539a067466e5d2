"""A second ``fit`` on the same Trainer continues from its progress (current_epoch, global_step), as in Lightning."""

from __future__ import annotations

import logging

import pytest
from phalanx_testing import Regressor, loaders, parameters_of, quiet_trainer, same_parameters

import phalanx


class Recording(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.trained: list[tuple[int, int]] = []

    def training_step(self, batch, batch_idx):
        self.trained.append((self.current_epoch, batch_idx))
        return super().training_step(batch, batch_idx)

    def on_fit_start(self):
        self.calls.append("on_fit_start")

    def on_train_start(self):
        self.calls.append("on_train_start")

    def on_train_end(self):
        self.calls.append("on_train_end")

    def on_fit_end(self):
        self.calls.append("on_fit_end")


def _batches(epochs: range, batch_indices: range = range(4)) -> list[tuple[int, int]]:
    return [(epoch, index) for epoch in epochs for index in batch_indices]


# (limits of the first fit, limits changed before the second, progress after it, the (epoch, batch_idx) it trains)
CASES = [
    ({"max_epochs": 2}, {}, (2, 8), []),
    ({"max_epochs": 2}, {"max_epochs": 3}, (3, 12), _batches(range(2, 3))),
    ({"max_epochs": 5, "max_steps": 6}, {}, (1, 6), []),
    # stopped inside epoch 1 after its batch 1: the second fit goes on at its batch 2
    ({"max_epochs": 5, "max_steps": 6}, {"max_steps": 10}, (2, 10), [(1, 2), (1, 3), (2, 0), (2, 1)]),
    ({"max_epochs": 5, "max_steps": 6}, {"max_steps": 20}, (5, 20), [(1, 2), (1, 3), *_batches(range(2, 5))]),
    ({"max_epochs": -1, "max_steps": 4}, {"max_steps": 8}, (2, 8), _batches(range(1, 2))),
]


@pytest.mark.parametrize(("first", "changed", "progress", "second_batches"), CASES)
def test_second_fit_continues_from_the_trainers_progress(first, changed, progress, second_batches):
    train, _ = loaders(n=32, batch_size=8)  # 4 batches per epoch
    model = Recording()
    trainer = quiet_trainer(num_sanity_val_steps=0, **first)
    trainer.fit(model, train)
    model.calls.clear()
    model.trained.clear()
    for name, value in changed.items():
        setattr(trainer, name, value)
    trainer.fit(model, train)
    assert (trainer.current_epoch, trainer.global_step) == progress
    assert model.trained == second_batches
    train_hooks = ["on_train_start", "on_train_end"] if second_batches else []
    assert model.calls == ["on_fit_start", *train_hooks, "on_fit_end"]
    assert trainer.state.status == "finished"


def test_second_fit_at_its_limit_leaves_the_weights_and_says_why(caplog):
    train, _ = loaders(n=32, batch_size=8)
    model = Recording()
    trainer = quiet_trainer(max_epochs=1, num_sanity_val_steps=0)
    trainer.fit(model, train)
    weights = parameters_of(model)
    with caplog.at_level(logging.INFO):
        trainer.fit(model, train)
    assert same_parameters(weights, parameters_of(model))
    assert "max_epochs=1 is reached (current_epoch=1)" in caplog.text


@pytest.mark.parametrize("first_max_steps", [2, 4, 6, 11])
def test_fit_stopped_inside_an_epoch_then_continued_equals_one_fit(first_max_steps):
    def fresh() -> tuple[Recording, object]:
        phalanx.seed_everything(0)
        return Recording(), loaders(n=32, batch_size=8, shuffle=True)[0]

    model, train = fresh()
    quiet_trainer(max_steps=12, num_sanity_val_steps=0).fit(model, train)
    continued, train = fresh()
    trainer = quiet_trainer(max_steps=first_max_steps, num_sanity_val_steps=0)
    trainer.fit(continued, train)
    trainer.max_steps = 12
    trainer.fit(continued, train)
    assert continued.trained == model.trained
    assert same_parameters(parameters_of(continued), parameters_of(model))
