"""Names Lightning Fabric has and phalanx will not offer (the ``dp`` strategy, Transformer Engine precision, the
bitsandbytes and Transformer Engine plugins): the Cohort and the Trainer refuse each with a message naming what to
use, and the migration guide lists each one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from phalanx import Cohort, Trainer
from phalanx.plugins import NOT_OFFERED
from phalanx.strategies.resolve import NOT_OFFERED_PRECISIONS, NOT_OFFERED_STRATEGIES

GUIDE = (Path(__file__).parents[3] / "docs" / "migrating-from-lightning.md").read_text()


def _lightning_plugin(name: str) -> Any:
    """An object of a class named as Lightning's plugin, from Lightning's package (no Lightning import needed)."""
    return type(name, (), {"__module__": "lightning_fabric.plugins.precision"})()


CASES = [
    pytest.param({"strategy": "dp"}, ValueError, "use strategy='ddp' (one process per device", id="dp"),
    pytest.param({"strategy": "DP"}, ValueError, "use strategy='ddp'", id="dp-upper-case"),
    *[
        pytest.param({"precision": name}, ValueError, "use precision='bf16-mixed' or 'bf16-true'", id=name)
        for name in NOT_OFFERED_PRECISIONS
    ],
    *[
        pytest.param(
            {"plugins": [_lightning_plugin(name)]},
            TypeError,
            f"plugins[0]={name}(...) is Lightning's plugin, which phalanx does not offer; use",
            id=name,
        )
        for name in NOT_OFFERED
    ],
]


@pytest.mark.parametrize("driver", [Cohort, Trainer])
@pytest.mark.parametrize(("arguments", "error", "text"), CASES)
def test_each_name_is_refused_with_what_to_use(driver, arguments, error, text):
    with pytest.raises(error, match=r"(is not offered by phalanx|which phalanx does not offer)") as raised:
        driver(accelerator="cpu", **arguments)
    assert text in str(raised.value)


@pytest.mark.parametrize("name", sorted(NOT_OFFERED))
def test_importing_a_plugin_that_is_not_offered_says_what_to_use(name):
    with pytest.raises(ImportError, match=f"Lightning's {name} is not offered in phalanx.plugins; use"):
        exec(f"from phalanx.plugins import {name}", {})


@pytest.mark.parametrize("name", [*NOT_OFFERED_STRATEGIES, *NOT_OFFERED_PRECISIONS, *NOT_OFFERED])
def test_the_migration_guide_lists_each_name(name):
    assert any(quoted in GUIDE for quoted in (f"`{name}`", f'"{name}"', f"{name}(")), name


def test_the_names_are_fabrics():
    pytest.importorskip("lightning_fabric", reason="Lightning Fabric (the oracle) is not installed")
    from typing import get_args

    import lightning_fabric.plugins as fabric_plugins
    from lightning_fabric.connector import _PRECISION_INPUT_STR
    from lightning_fabric.strategies import STRATEGY_REGISTRY

    assert set(NOT_OFFERED_STRATEGIES) <= set(STRATEGY_REGISTRY.available_strategies())
    assert set(NOT_OFFERED_PRECISIONS) <= set(get_args(_PRECISION_INPUT_STR))
    assert all(hasattr(fabric_plugins, name) for name in NOT_OFFERED)
