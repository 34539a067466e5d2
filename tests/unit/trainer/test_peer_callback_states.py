"""The callbacks' states given to a strategy through RunSettings (``callback_states`` / ``load_callback_states``): what
a healthy ddp_ft replica group sends and a rejoining one loads, as a checkpoint's "callbacks" entry holds them (ddp_ft's
transfer without its processes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from phalanx_testing import Regressor, loaders, quiet_trainer

import phalanx
from phalanx.callbacks import EarlyStopping, ModelCheckpoint
from phalanx.strategies import RunSettings, SingleDeviceStrategy


class Counter(phalanx.Callback):
    """A user's callback with state: the training batches it saw."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.batches += 1

    def state_dict(self) -> dict[str, Any]:
        return {"batches": self.batches}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches = state_dict["batches"]


class Stateless(phalanx.Callback):
    """A callback with nothing to send (an empty state_dict)."""


class JoiningStrategy(SingleDeviceStrategy):
    """Loads ``received`` into its driver's callbacks when training starts, as ddp_ft does with a peer's, and then
    calls ``after_load``."""

    def __init__(self, received: dict[str, Any] | None = None, after_load: Callable[[], Any] | None = None) -> None:
        super().__init__()
        self.received, self.after_load = received, after_load
        self.loaded: Any = None

    def setup(self, settings: RunSettings) -> None:
        self.settings = settings
        super().setup(settings)

    def on_train_start(self) -> None:
        if self.received is not None:
            assert self.settings.load_callback_states is not None
            self.settings.load_callback_states(self.received)
            self.loaded = self.after_load() if self.after_load else None


def _fit(callbacks: list[Any], strategy: JoiningStrategy, epochs: int) -> phalanx.Trainer:
    trainer = quiet_trainer(
        strategy=strategy,
        max_epochs=epochs,
        limit_train_batches=3,
        callbacks=callbacks,
        enable_checkpointing=any(isinstance(callback, ModelCheckpoint) for callback in callbacks),
    )
    trainer.fit(Regressor(), *loaders(n=32, batch_size=8))
    return trainer


def _score(value: Any) -> float | None:
    return None if value is None else float(value)


CALLBACKS = [
    pytest.param(
        lambda folder: EarlyStopping("val_loss", patience=50, min_delta=10.0),  # never improves by 10: wait counts up
        lambda cb: (cb.wait_count, _score(cb.best_score)),
        id="EarlyStopping",
    ),
    pytest.param(
        lambda folder: ModelCheckpoint(folder, monitor="val_loss", save_top_k=2),
        lambda cb: (_score(cb.best_model_score), {path: float(score) for path, score in cb.best_k_models.items()}),
        id="top-k ModelCheckpoint",
    ),
    pytest.param(lambda folder: Counter(), lambda cb: cb.batches, id="a user's callback"),
]


@pytest.mark.parametrize(("make", "attributes"), CALLBACKS)
def test_a_joining_driver_takes_the_callback_states_of_its_peer(
    make: Callable[[Path], Any], attributes: Callable[[Any], Any], tmp_path: Path
) -> None:
    peer_callback = make(tmp_path)
    peer = _fit([peer_callback, Stateless()], JoiningStrategy(), epochs=3)
    assert peer.strategy.settings.callback_states is not None
    sent = peer.strategy.settings.callback_states()
    # The same entries as the "callbacks" entry of the peer's checkpoint: one serialisation.
    peer.save_checkpoint(tmp_path / "peer.ckpt")
    saved = torch.load(tmp_path / "peer.ckpt", weights_only=False)["callbacks"]
    assert sent.keys() == saved.keys() == {peer_callback.state_key}
    fresh = attributes(make(tmp_path))
    assert attributes(peer_callback) != fresh  # the peer's state is not a new callback's
    joining_callback = make(tmp_path)
    strategy = JoiningStrategy(sent, lambda: attributes(joining_callback))
    _fit([joining_callback, Stateless()], strategy, epochs=1)
    assert strategy.loaded == attributes(peer_callback)


def test_a_state_no_callback_claims_is_ignored_and_a_callback_without_one_keeps_its_own(tmp_path: Path) -> None:
    counter = Counter()
    strategy = JoiningStrategy({"SomeoneElse": {"x": 1}}, lambda: counter.batches)
    _fit([counter], strategy, epochs=1)
    assert strategy.loaded == 0 and counter.batches == 3


@pytest.mark.parametrize(
    "state",
    [{"wait_count": 1}, {"wait_count": "one", "stopped_epoch": 0, "best_score": 1.0, "patience": 3}],
    ids=["missing keys", "a count that is not an int"],
)
def test_a_damaged_peer_state_is_refused_naming_its_entry(state: dict[str, Any]) -> None:
    stopping = EarlyStopping("val_loss")
    with pytest.raises(
        ValueError,
        match=r"The state\['callbacks'\]\[.EarlyStopping.*that a peer replica group sent could not be loaded",
    ):
        _fit([stopping], JoiningStrategy({stopping.state_key: state}), epochs=1)
    assert stopping.wait_count == 0  # nothing of the damaged state was taken
