"""The fit loop's position given to a strategy through RunSettings: what a healthy replica group sends, and where a
joining group's loop goes when it loads it before training (ddp_ft's rejoin, without its processes)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from phalanx_testing import Regressor, loaders, quiet_trainer

from phalanx.strategies import RunSettings, SingleDeviceStrategy

BATCHES = 6  # per epoch


class JoiningStrategy(SingleDeviceStrategy):
    """Loads ``position`` into the loop when training starts, as ddp_ft does with a peer's; records the position the
    loop reports at each optimizer step."""

    def __init__(self, position: dict[str, int] | None) -> None:
        super().__init__()
        self.position = position
        self.reported: list[dict[str, int]] = []

    def setup(self, settings: RunSettings) -> None:
        self.settings = settings
        super().setup(settings)

    def on_train_start(self) -> None:
        if self.position is not None:
            assert self.settings.load_loop_position is not None
            self.settings.load_loop_position(self.position)

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        assert self.settings.loop_position is not None
        self.reported.append(self.settings.loop_position())
        return super().optimizer_step(optimizer, closure, model, **kwargs)


class RecordingRegressor(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.trained: list[tuple[int, int]] = []  # (epoch, batch index) of each training_step
        self.epochs_started: list[int] = []

    def on_train_epoch_start(self) -> None:
        self.epochs_started.append(self.current_epoch)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.trained.append((self.current_epoch, batch_idx))
        return super().training_step(batch, batch_idx)


def _fit(position: dict[str, int] | None, max_steps: int, accumulate: int = 1) -> tuple[Any, Any, Any]:
    model, strategy = RecordingRegressor(), JoiningStrategy(position)
    trainer = quiet_trainer(
        strategy=strategy,
        max_steps=max_steps,
        limit_train_batches=BATCHES,
        num_sanity_val_steps=0,
        accumulate_grad_batches=accumulate,
    )
    train, _ = loaders(n=64, batch_size=8, shuffle=False)
    trainer.fit(model, train)
    return trainer, strategy, model


def _position(global_step: int, epoch: int, batch: int) -> dict[str, int]:
    done = epoch * BATCHES + batch
    return {"global_step": global_step, "epoch": epoch, "batches_done": batch, "total_batches": done,
            "batches_stepped": global_step}  # fmt: skip


@pytest.mark.parametrize(
    ("position", "expected_first"),
    [(_position(3, 0, 3), (0, 3)), (_position(6, 1, 0), (1, 0)), (_position(8, 1, 2), (1, 2))],
    ids=["inside the first epoch", "at an epoch start", "inside the second epoch"],
)
def test_a_loaded_position_moves_the_loop_before_its_first_batch(position, expected_first):
    trainer, strategy, model = _fit(position, max_steps=10)
    epoch, batch = expected_first
    assert model.trained[0] == expected_first
    assert model.epochs_started[0] == epoch  # the joined epoch is opened, as a fresh one is
    # From there on every batch once, and the same counters as a run that had trained up to there.
    steps = 10 - position["global_step"]
    flat = [e * BATCHES + b for e, b in model.trained]
    assert flat == list(range(epoch * BATCHES + batch, epoch * BATCHES + batch + steps))
    assert trainer.global_step == 10
    assert strategy.reported[0] == position


@pytest.mark.parametrize("accumulate", [1, 2, 3])
def test_the_position_sent_names_the_first_batch_of_the_step_being_taken(accumulate):
    _, strategy, _ = _fit(None, max_steps=2, accumulate=accumulate)
    assert strategy.reported == [_position(step, 0, step * accumulate) for step in range(2)]


@pytest.mark.parametrize("broken", [{}, {"global_step": "3"}, {**_position(1, 0, 1), "epoch": None}])
def test_a_position_without_its_integer_counters_is_refused(broken):
    with pytest.raises(ValueError, match="needs the integer counters"):
        _fit(broken, max_steps=2)


class CatchingUpStrategy(JoiningStrategy):
    """At its optimizer step number ``at``, takes ``peer`` (a position ahead) as ddp_ft does when it healed mid-run."""

    def __init__(self, at: int, peer: dict[str, int]) -> None:
        super().__init__(None)
        self.at, self.peer = at, peer
        self.caught_up: bool | None = None

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if len(self.reported) == self.at:
            assert self.settings.catch_up_loop_position is not None
            self.caught_up = self.settings.catch_up_loop_position(self.peer)
        return super().optimizer_step(optimizer, closure, model, **kwargs)


@pytest.mark.parametrize(
    ("at", "behind", "accumulate"),
    [(1, 1, 1), (2, 2, 1), (0, 1, 2)],
    ids=["one step behind", "two steps behind", "one step behind, accumulating 2"],
)
def test_a_group_behind_its_peers_takes_their_counters_inside_a_step(at, behind, accumulate):
    # Its loop goes on with the peer's counters: the epoch ends with the peer's, the run ends at max_steps with
    # `behind` fewer steps trained here (the batches not read are the epoch's last ones).
    peer = _position(at + behind, 0, (at + behind) * accumulate)
    model, strategy = RecordingRegressor(), CatchingUpStrategy(at, peer)
    trainer = quiet_trainer(strategy=strategy, max_steps=8 // accumulate, limit_train_batches=BATCHES,
                            num_sanity_val_steps=0, accumulate_grad_batches=accumulate)  # fmt: skip
    trainer.fit(model, loaders(n=64, batch_size=8, shuffle=False)[0])
    assert strategy.caught_up is True
    steps = 8 // accumulate
    assert trainer.global_step == steps and len(strategy.reported) == steps - behind
    assert strategy.reported[at + 1] == _position(at + behind + 1, 0, (at + behind + 1) * accumulate)
    first_epoch = [batch for epoch, batch in model.trained if epoch == 0]
    read = (at + 1) * accumulate  # up to the catch-up's step, then from the peer's next batch to the epoch's end
    assert first_epoch == [*range(read), *range(read + behind * accumulate, BATCHES)]
    assert [batch for epoch, batch in model.trained if epoch == 1] == list(range(len(model.trained) - len(first_epoch)))


@pytest.mark.parametrize(
    "peer", [_position(7, 1, 1), _position(0, 0, 0)], ids=["a peer in another epoch", "a peer behind this group"]
)
def test_a_position_the_loop_cannot_take_inside_a_step_leaves_it_unchanged(peer):
    model, strategy = RecordingRegressor(), CatchingUpStrategy(2, peer)
    trainer = quiet_trainer(strategy=strategy, max_steps=8, limit_train_batches=BATCHES, num_sanity_val_steps=0)
    trainer.fit(model, loaders(n=64, batch_size=8, shuffle=False)[0])
    assert strategy.caught_up is False
    assert strategy.reported == [_position(step, step // BATCHES, step % BATCHES) for step in range(8)]
