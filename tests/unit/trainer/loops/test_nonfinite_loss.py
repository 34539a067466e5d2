"""Trainer(nonfinite_loss=...) and Trainer(detect_anomaly=...): a NaN or infinite loss never trains on silently."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from typing import Any

import pytest
import torch
from phalanx_testing import Regressor, parameters_of, quiet_trainer, same_parameters
from torch import nn
from torch.utils.data import DataLoader

from phalanx.strategies import SingleDeviceStrategy, StrategyTraits

BATCHES = 8


def batches(n: int = BATCHES) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 4, generator=generator), torch.randn(4, 1, generator=generator)) for _ in range(n)]


def loader(items: list[Any]) -> DataLoader:
    return DataLoader(items, batch_size=None)  # each item is a whole batch, in order


class BadLossAt(Regressor):
    """Its loss is multiplied by ``value`` (NaN or inf) at the training_step calls listed in ``bad``."""

    def __init__(self, bad: tuple[int, ...] = (), value: float = math.nan) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.bad, self.value, self.calls = bad, value, 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.calls += 1
        return loss * self.value if self.calls - 1 in self.bad else loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def fit(mode: str, data: list[Any], model: BadLossAt, **kwargs: Any) -> tuple[Any, list[str]]:
    trainer = quiet_trainer(max_epochs=1, nonfinite_loss=mode, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader(data))
    return trainer, [str(w.message) for w in caught if "NaN or infinite" in str(w.message)]


def all_finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


K = 3  # the batch (and, before it, the number of optimizer steps) whose loss is not finite


@pytest.mark.parametrize("value", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("mode", ["skip", "stop", "raise", "warn", "ignore"])
def test_each_mode_on_a_loss_that_turns_non_finite_at_step_k(mode, value):
    data = batches()
    model = BadLossAt(bad=(K,), value=value)
    if mode == "raise":
        with pytest.raises(FloatingPointError, match=rf"at global step {K} \(epoch 0, batch_idx {K}\)"):
            fit(mode, data, model)
        assert all_finite(model)
        return
    trainer, warned = fit(mode, data, model)
    if mode == "skip":
        # Equal, bit for bit, to a run that never saw batch K.
        reference = BadLossAt()
        fit("ignore", data[:K] + data[K + 1 :], reference)
        assert all_finite(model) and same_parameters(parameters_of(model), parameters_of(reference))
        assert trainer.global_step == BATCHES - 1 and trainer.fit_loop.nonfinite.skipped == 1
        assert len(warned) == 1 and f"global step {K}" in warned[0]
    elif mode == "stop":
        reference = BadLossAt()
        fit("ignore", data[:K], reference)
        assert trainer.global_step == K and trainer.should_stop
        assert all_finite(model) and same_parameters(parameters_of(model), parameters_of(reference))
        assert len(warned) == 1 and "training stops" in warned[0]
    elif mode == "warn":
        assert trainer.global_step == BATCHES  # trained on, with NaN weights from step K
        assert (
            len(warned) == 1
            and f"at least once in the {BATCHES} batches between global step 0 and {BATCHES}" in warned[0]
        )
    else:
        assert trainer.global_step == BATCHES and warned == []


@pytest.mark.parametrize("bad", [4, 5], ids=["first of its window", "second of its window"])
def test_skip_drops_the_whole_gradient_accumulation_window(bad):
    data = batches()
    model = BadLossAt(bad=(bad,))
    trainer, _ = fit("skip", data, model, accumulate_grad_batches=2)
    reference = BadLossAt()
    fit("ignore", data[:4] + data[6:], reference, accumulate_grad_batches=2)
    assert trainer.global_step == BATCHES // 2 - 1
    assert same_parameters(parameters_of(model), parameters_of(reference))


def test_warn_reads_the_device_flag_only_where_the_loop_reads_values_anyway(monkeypatch):
    reads = {"count": 0}
    original = torch.Tensor.item

    def counting_item(self: torch.Tensor) -> Any:
        reads["count"] += 1
        return original(self)

    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    counts = {}
    for mode in ("ignore", "warn"):
        reads["count"] = 0
        fit(mode, batches(), BadLossAt(), log_every_n_steps=50)
        counts[mode] = reads["count"]
    # One read at the epoch's end (log_every_n_steps=50 is never reached), not one per step.
    assert counts["warn"] - counts["ignore"] <= 1


class ReadsInTurn(SingleDeviceStrategy):
    """Records whether the warn-mode flag is read inside ``host_reads`` (where XLA replica threads take turns)."""

    def __init__(self) -> None:
        super().__init__(device=torch.device("cpu"))
        self.reading, self.flag_reads_inside, self.flag_reads_outside = False, 0, 0

    @contextlib.contextmanager
    def host_reads(self) -> Any:
        self.reading = True
        try:
            yield
        finally:
            self.reading = False


def test_warn_reads_the_device_flag_inside_the_strategys_host_reads(monkeypatch):
    strategy = ReadsInTurn()
    original = torch.isfinite

    def watched(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.ndim == 0 and not tensor.requires_grad:  # the running sum of the losses
            if strategy.reading:
                strategy.flag_reads_inside += 1
            else:
                strategy.flag_reads_outside += 1
        return original(tensor)

    monkeypatch.setattr(torch, "isfinite", watched)
    fit("warn", batches(), BadLossAt(), log_every_n_steps=50, strategy=strategy)
    assert strategy.flag_reads_inside >= 1 and strategy.flag_reads_outside == 0


def test_warn_reports_at_the_logging_interval_with_the_step_range():
    trainer, warned = fit("warn", batches(), BadLossAt(bad=(5,)), log_every_n_steps=2)
    assert len(warned) == 1 and "between global step 4 and 6" in warned[0]
    assert trainer.global_step == BATCHES


class OtherRankVotes(SingleDeviceStrategy):
    """A single process that plays a second rank whose loss is not finite at its ``bad``-th vote."""

    def __init__(self, bad: int) -> None:
        super().__init__(device=torch.device("cpu"))
        self.bad, self.votes = bad, 0

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002
        self.votes += 1
        other = self.votes - 1 != self.bad
        return (decision and other) if all else (decision or other)


@pytest.mark.parametrize("mode", ["stop", "raise", "skip"])
def test_every_rank_takes_the_decision_of_the_rank_that_saw_the_non_finite_loss(mode):
    model = BadLossAt()  # finite everywhere on this rank
    if mode == "raise":
        with pytest.raises(FloatingPointError, match="finite here but NaN or infinite on another process"):
            fit(mode, batches(), model, strategy=OtherRankVotes(bad=K))
        return
    trainer, _ = fit(mode, batches(), model, strategy=OtherRankVotes(bad=K))
    assert trainer.global_step == (K if mode == "stop" else BATCHES - 1)


class ManualBadLoss(BadLossAt):
    def __init__(self, bad: tuple[int, ...] = ()) -> None:
        super().__init__(bad=bad)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss


def test_manual_optimization_refuses_skip_and_checks_the_returned_loss_otherwise():
    with pytest.raises(ValueError, match="nonfinite_loss='skip' needs automatic optimization"):
        quiet_trainer(max_epochs=1, nonfinite_loss="skip").fit(ManualBadLoss(), loader(batches()))
    with pytest.raises(FloatingPointError, match="batch_idx 2"):
        fit("raise", batches(), ManualBadLoss(bad=(2,)))
    trainer, warned = fit("stop", batches(), ManualBadLoss(bad=(2,)))
    assert trainer.fit_loop.batches_done == 3 and len(warned) == 1


def test_skip_is_refused_where_the_strategy_accumulates_gradients_itself():
    class Accumulating(SingleDeviceStrategy):
        def declare_traits(self) -> StrategyTraits:
            return dataclasses.replace(super().declare_traits(), handles_gradient_accumulation=True)

    trainer = quiet_trainer(max_epochs=1, nonfinite_loss="skip", strategy=Accumulating(device=torch.device("cpu")))
    with pytest.raises(ValueError, match="cannot skip a batch under Accumulating"):
        trainer.fit(BadLossAt(), loader(batches()))


class NaNBackward(BadLossAt):
    """A finite loss whose backward is NaN: d/dw sqrt(w * 0) = inf * 0."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        weight = self.net[0].weight
        return torch.sqrt(weight * 0).sum() + super().training_step(batch, batch_idx)


def test_detect_anomaly_names_the_operation_whose_backward_is_nan():
    with pytest.raises(RuntimeError, match="returned nan values"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's "Anomaly Detection has been enabled"
            quiet_trainer(max_epochs=1, detect_anomaly=True).fit(NaNBackward(), loader(batches()))
    trainer = quiet_trainer(max_epochs=1)
    with pytest.warns(
        UserWarning, match="The training loss was NaN or infinite"
    ):  # without it: only the default warning
        trainer.fit(NaNBackward(), loader(batches()))
    assert trainer.global_step == BATCHES
    assert not torch.is_anomaly_enabled()
