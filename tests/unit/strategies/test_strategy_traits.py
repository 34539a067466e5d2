"""``Strategy.traits``: the loop-facing flags as one declared object. Every registered strategy declares what its
separate properties said before (the table was read from those properties at 76e875f), a strategy written against
the old properties still works for a release (with a DeprecationWarning), and the drivers read only ``traits``."""

from __future__ import annotations

import ast
import dataclasses
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from phalanx.strategies import STRATEGY_REGISTRY, FSDPStrategy, SingleDeviceStrategy, StrategyTraits
from phalanx.strategies.traits import TRAIT_NAMES

DEEPSPEED = {"handles_gradient_accumulation", "restore_checkpoint_after_setup", "needs_train_batch_size"}
DEEPSPEED |= {"wraps_module_with_optimizers"}
ZERO3 = DEEPSPEED | {"pads_evaluation", "allows_inference_mode"}
SHARDED = {"restore_checkpoint_after_setup", "restores_optimizer", "pads_evaluation", "allows_inference_mode"}
XLA = {"allows_inference_mode"}

#: Every registered strategy, built with its registered arguments, and the flags that differ from the defaults.
CHANGED: dict[str, set[str]] = {
    **{name: set() for name in STRATEGY_REGISTRY.available() if name.startswith("ddp")},
    "single_device": set(),
    "example_single_device": set(),
    **{
        name: DEEPSPEED for name in ("deepspeed", "deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_2_offload")
    },
    **{name: ZERO3 for name in ("deepspeed_stage_3", "deepspeed_stage_3_offload", "deepspeed_stage_3_offload_nvme")},
    **{name: SHARDED for name in ("fsdp", "fsdp_cpu_offload", "model_parallel", "hsdp_ft")},
    **{name: XLA for name in ("single_xla", "xla", "xla_debug", "xla_spmd", "xla_spmd_dp")},
    "xla_fsdp": XLA | {"restore_checkpoint_after_setup"},
    "hivemind": {"handles_gradient_accumulation", "wraps_module_with_optimizers"},
}
DEFAULTS = StrategyTraits()


#: The strategies the Cohort cannot drive (``StrategyTraits.cohort_unsupported`` holds the reason, as text); ddp_ft,
#: which was one, forms each step's quorum before the training forward since the Cohort drives it (issue 36).
COHORT_UNSUPPORTED = {"hsdp_ft"}


def _expected(changed: set[str]) -> dict[str, bool]:
    """The flags (not the Cohort's reason, which is text) a strategy whose changed flags are ``changed`` declares."""
    return {name: getattr(DEFAULTS, name) != (name in changed) for name in TRAIT_NAMES}


def _build(name: str) -> Any:
    if name.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    if name in INTEGRATIONS and name not in STRATEGY_REGISTRY:
        pytest.skip(f"the integration that registers {name!r} is not installed")
    if name == "hivemind":
        pytest.importorskip("phalanx_hivemind")
        return STRATEGY_REGISTRY.get(name, target_batch_size=8)
    return STRATEGY_REGISTRY.get(name)


#: Registered by the integrations under integrations/ (installed in CI, not phalanx's own).
INTEGRATIONS = {"hivemind", "example_single_device"}


def test_every_registered_strategy_is_in_the_table() -> None:
    assert set(STRATEGY_REGISTRY.available()) - INTEGRATIONS == set(CHANGED) - INTEGRATIONS


@pytest.mark.parametrize(("name", "changed"), sorted(CHANGED.items()))
def test_traits_equal_the_flags_each_strategy_declared_before(name: str, changed: set[str]) -> None:
    strategy = _build(name)
    assert {flag: getattr(strategy.traits, flag) for flag in TRAIT_NAMES} == _expected(changed)
    # The deprecated properties still answer, and say the same.
    assert {flag: getattr(strategy, flag) for flag in TRAIT_NAMES} == _expected(changed)
    reason = strategy.traits.cohort_unsupported
    assert isinstance(reason, str) and reason if name in COHORT_UNSUPPORTED else reason is None


def _define_old_style(base: type, flag: str, value: bool) -> type:
    return type(f"Old{base.__name__}", (base,), {flag: property(lambda self: value)})


@pytest.mark.parametrize("flag", TRAIT_NAMES)
def test_overriding_a_separate_property_is_deprecated_and_still_read(flag: str) -> None:
    value = not getattr(DEFAULTS, flag)
    with pytest.warns(DeprecationWarning, match=rf"overrides the Strategy property '{flag}'.*declare_traits\(\)"):
        cls = _define_old_style(SingleDeviceStrategy, flag, value)
    strategy = cls(device=torch.device("cpu"))
    assert strategy.traits == dataclasses.replace(DEFAULTS, **{flag: value})
    # A subclass of it declares nothing old itself: no warning, and the override still counts.
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        sub = type("Sub", (cls,), {})
    assert getattr(sub(device=torch.device("cpu")).traits, flag) is value


def test_an_old_override_wins_over_what_the_built_in_parent_declares() -> None:
    with pytest.warns(DeprecationWarning, match="'pads_evaluation'"):
        cls = _define_old_style(FSDPStrategy, "pads_evaluation", False)
    traits = cls().traits
    assert traits == StrategyTraits(**{**_expected(SHARDED), "pads_evaluation": False})


def test_an_old_override_may_call_the_base_property() -> None:
    with pytest.warns(DeprecationWarning) as warned:

        class OldStyle(SingleDeviceStrategy):
            """A strategy written before ``traits``: it overrides the separate properties."""

            @property
            def handles_gradient_accumulation(self) -> bool:
                return True

            @property
            def allows_inference_mode(self) -> bool:
                return not super().allows_inference_mode  # the base property must not recurse through traits

    assert len(warned) == 2 and {w.filename for w in warned} == {__file__}  # points at the class statement
    strategy = OldStyle(device=torch.device("cpu"))
    assert strategy.traits == dataclasses.replace(
        DEFAULTS, handles_gradient_accumulation=True, allows_inference_mode=False
    )


def test_declared_traits_are_what_the_deprecated_properties_read() -> None:
    class Declared(SingleDeviceStrategy):
        def declare_traits(self) -> StrategyTraits:
            return dataclasses.replace(super().declare_traits(), requires_equal_batches=True)

    strategy = Declared(device=torch.device("cpu"))
    assert strategy.traits.requires_equal_batches and strategy.requires_equal_batches
    with pytest.raises(dataclasses.FrozenInstanceError):
        strategy.traits.requires_equal_batches = False  # type: ignore[misc]


# ------------------------------------------------------------------ the drivers read only ``traits``
PHALANX = Path(__file__).resolve().parents[3] / "phalanx"
DRIVERS = ("trainer", "cohort", "callbacks", "plugins", "testing", "data")


def old_flag_reads(source: str) -> list[str]:
    """``x.<flag>`` attribute reads that do not go through ``traits`` (``strategy.traits.<flag>`` is the one way)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in TRAIT_NAMES:
            owner = node.value
            if not (isinstance(owner, ast.Attribute) and owner.attr == "traits"):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize(
    ("source", "reads"),
    [
        ("if trainer.strategy.handles_gradient_accumulation: pass", 1),
        ("x = self._strategy.pads_evaluation or strategy.requires_equal_batches", 2),
        ("x = getattr(strategy, 'restores_optimizer')", 0),  # not a pattern the drivers use; the table tests cover it
        ("if trainer.strategy.traits.handles_gradient_accumulation: pass", 0),
        ("'''``requires_equal_batches``'''", 0),
    ],
)
def test_the_read_finder_finds_old_reads(source: str, reads: int) -> None:
    assert len(old_flag_reads(source)) == reads


@pytest.mark.parametrize("package", DRIVERS)
def test_drivers_read_the_flags_only_through_traits(package: str) -> None:
    found = {
        str(path.relative_to(PHALANX)): reads
        for path in sorted((PHALANX / package).rglob("*.py"))
        if (reads := old_flag_reads(path.read_text()))
    }
    assert found == {}, f"read strategy.traits.<flag> instead: {found}"
