"""A strategy's traits are checked once, when the Trainer or the Cohort takes the strategy, and every error names the
strategy: a flag that is not True or False (the string "no" would count as True), a ``declare_traits()`` that does
not return a StrategyTraits, and a deprecated per-flag property that contradicts a ``declare_traits()`` written beside
or below it. A deprecated property of a subclass still overrides what a built-in parent declares (for one release)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

import pytest
import torch

import phalanx
from phalanx.strategies import FSDPStrategy, SingleDeviceStrategy, StrategyTraits
from phalanx.strategies.traits import TRAIT_NAMES, check_traits

DEFAULTS = StrategyTraits()
DRIVERS: dict[str, Callable[[Any], Any]] = {
    "Trainer": lambda strategy: phalanx.Trainer(accelerator="cpu", strategy=strategy, logger=False),
    "Cohort": lambda strategy: phalanx.Cohort(accelerator="cpu", strategy=strategy),
}
#: Values a flag might be given that are not True or False; each would count as one of them by accident.
NOT_BOOLS = ["no", "False", "", 0, 1, None, 0.0]


def _declaring(traits: Callable[[StrategyTraits], Any]) -> Any:
    class Declaring(SingleDeviceStrategy):
        def declare_traits(self) -> Any:
            return traits(super().declare_traits())

    return Declaring(device=torch.device("cpu"))


def _old_style(base: type, flag: str, value: Any, **namespace: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        cls = type("OldStyle", (base,), {flag: property(lambda self: value), **namespace})
    return cls(device=torch.device("cpu")) if base is SingleDeviceStrategy else cls()


@pytest.mark.parametrize("value", NOT_BOOLS, ids=repr)
@pytest.mark.parametrize("flag", TRAIT_NAMES)
@pytest.mark.parametrize("driver", list(DRIVERS))
def test_a_declared_flag_that_is_not_a_bool_is_refused(driver: str, flag: str, value: Any) -> None:
    strategy = _declaring(lambda traits: dataclasses.replace(traits, **{flag: value}))
    with pytest.raises(TypeError, match=rf"Declaring\.declare_traits\(\) declares {flag}=.*a trait is True or False"):
        DRIVERS[driver](strategy)


@pytest.mark.parametrize(
    "returned",
    [lambda traits: dataclasses.asdict(traits), lambda traits: None, lambda traits: tuple(dataclasses.astuple(traits))],
    ids=["dict", "None", "tuple"],
)
@pytest.mark.parametrize("driver", list(DRIVERS))
def test_declare_traits_must_return_strategy_traits(driver: str, returned: Callable[[StrategyTraits], Any]) -> None:
    with pytest.raises(TypeError, match=r"Declaring\.declare_traits\(\) returned .*it must return a StrategyTraits"):
        DRIVERS[driver](_declaring(returned))


@pytest.mark.parametrize("value", ["no", 1, None], ids=repr)
@pytest.mark.parametrize("flag", TRAIT_NAMES)
def test_a_deprecated_property_that_is_not_a_bool_is_refused(flag: str, value: Any) -> None:
    strategy = _old_style(SingleDeviceStrategy, flag, value)
    with pytest.raises(TypeError, match=rf"OldStyle\.{flag} \(a deprecated trait property\) returned"):
        DRIVERS["Trainer"](strategy)


@pytest.mark.parametrize("flag", TRAIT_NAMES)
@pytest.mark.parametrize("driver", list(DRIVERS))
def test_a_deprecated_property_contradicting_declare_traits_beside_it_is_refused(driver: str, flag: str) -> None:
    declared = not getattr(DEFAULTS, flag)

    def declare_traits(self: Any) -> StrategyTraits:
        return dataclasses.replace(SingleDeviceStrategy.declare_traits(self), **{flag: declared})

    strategy = _old_style(SingleDeviceStrategy, flag, not declared, declare_traits=declare_traits)
    with pytest.raises(ValueError, match=rf"OldStyle declares {flag}={declared} in declare_traits\(\), but its"):
        DRIVERS[driver](strategy)


@pytest.mark.parametrize("flag", TRAIT_NAMES)
def test_a_deprecated_property_agreeing_with_declare_traits_or_overriding_a_parent_is_accepted(flag: str) -> None:
    value = not getattr(DEFAULTS, flag)

    def declare_traits(self: Any) -> StrategyTraits:
        return dataclasses.replace(SingleDeviceStrategy.declare_traits(self), **{flag: value})

    agreeing = _old_style(SingleDeviceStrategy, flag, value, declare_traits=declare_traits)
    assert getattr(DRIVERS["Trainer"](agreeing).strategy.traits, flag) is value
    # Written for the old contract on top of a built-in strategy: the property still wins for a release.
    overriding = _old_style(FSDPStrategy, flag, not getattr(FSDPStrategy().traits, flag))
    assert getattr(overriding.traits, flag) is not getattr(FSDPStrategy().traits, flag)
    check_traits(overriding)


@pytest.mark.parametrize("value", [0, True, b"reason", ["reason"]], ids=repr)
@pytest.mark.parametrize("driver", list(DRIVERS))
def test_cohort_unsupported_is_none_or_a_reason_as_text(driver: str, value: Any) -> None:
    strategy = _declaring(lambda traits: dataclasses.replace(traits, cohort_unsupported=value))
    with pytest.raises(TypeError, match=r"declares cohort_unsupported=.*None \(the Cohort can drive the strategy\)"):
        DRIVERS[driver](strategy)


def test_the_cohort_refuses_a_strategy_it_cannot_drive_with_the_reason_and_the_trainer_takes_it() -> None:
    strategy = _declaring(lambda traits: dataclasses.replace(traits, cohort_unsupported="its quorum needs the Trainer"))
    with pytest.raises(ValueError, match=r"The Cohort cannot drive Declaring: its quorum needs the Trainer"):
        phalanx.Cohort(accelerator="cpu", strategy=strategy).setup(torch.nn.Linear(2, 1))
    assert DRIVERS["Trainer"](strategy).strategy is strategy
