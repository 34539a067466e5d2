"""Unknown strategy and accelerator names: the closest names, or the package that registers the name."""

from __future__ import annotations

import re

import pytest

import phalanx
from phalanx.accelerators import ACCELERATOR_REGISTRY
from phalanx.strategies import STRATEGY_REGISTRY


@pytest.fixture
def without_hivemind(monkeypatch):
    """The registry as it is where phalanx-hivemind is not installed (it is, in the test environment)."""
    monkeypatch.setattr(STRATEGY_REGISTRY, "_entries", dict(STRATEGY_REGISTRY._entries))
    monkeypatch.setattr(STRATEGY_REGISTRY, "_plugins", dict(STRATEGY_REGISTRY._plugins))
    STRATEGY_REGISTRY._load_entry_points()  # each entry point is loaded once: removing its name keeps it away
    STRATEGY_REGISTRY.remove("hivemind")


@pytest.mark.parametrize(
    ("name", "suggested"),
    [
        ("ddpp", "'ddp'"),
        ("DDP_spwan", "'ddp_spawn'"),
        ("fsdp_offload", "'fsdp_cpu_offload'"),
        ("deepspeed_stage3", "'deepspeed_stage_3'"),
        ("single_devices", "'single_device'"),
        ("atuo", "'auto'"),
    ],
)
def test_a_misspelt_strategy_name_gets_the_closest_names(name, suggested):
    with pytest.raises(ValueError, match=rf"Unknown strategy '{name}'\. Did you mean [^?]*{suggested}") as error:
        phalanx.Trainer(strategy=name, accelerator="cpu", logger=False)
    assert "Choose 'auto' or one of [" in str(error.value)


@pytest.mark.parametrize(("name", "suggested"), [("cpuu", "'cpu'"), ("cdua", "'cuda'"), ("gpus", "'gpu'")])
def test_a_misspelt_accelerator_name_gets_the_closest_names(name, suggested):
    with pytest.raises(ValueError, match=rf"Unknown accelerator '{name}'\. Did you mean [^?]*{suggested}"):
        phalanx.Trainer(accelerator=name, logger=False)


@pytest.mark.parametrize("name", ["nope", "banana_strategy"])
def test_a_name_like_no_other_gets_only_the_list(name):
    with pytest.raises(ValueError, match=rf"Unknown strategy '{name}'\. Choose 'auto' or one of \[") as error:
        phalanx.Trainer(strategy=name, accelerator="cpu", logger=False)
    assert "Did you mean" not in str(error.value)
    with pytest.raises(KeyError, match=rf"Unknown strategy '{name}'\. Registered strategies: .*ddp"):
        STRATEGY_REGISTRY[name]


@pytest.mark.parametrize("name", ["hivemind", "HiveMind"])
def test_hivemind_names_its_package_where_it_is_not_installed(without_hivemind, name):
    hint = r"comes from a separate package, not installed here: install phalanx-hivemind "
    hint += r"\(`pip install \./integrations/phalanx-hivemind` in a phalanx checkout\)"
    with pytest.raises(ValueError, match=rf"Unknown strategy '{name}'\. Strategy '{name}' {hint}"):
        phalanx.Trainer(strategy=name, accelerator="cpu", logger=False)
    with pytest.raises(KeyError, match=hint):
        STRATEGY_REGISTRY[name]
    with pytest.raises(ValueError, match=hint):
        phalanx.Cohort(strategy=name, accelerator="cpu")


def test_the_registries_suggest_from_their_own_names():
    assert STRATEGY_REGISTRY.suggestion("fsdp_cpu_ofload") == " Did you mean 'fsdp_cpu_offload'?"
    assert ACCELERATOR_REGISTRY.suggestion("mpss") == " Did you mean 'mps'?"
    assert ACCELERATOR_REGISTRY.suggestion("quantum") == ""


def test_several_close_names_read_as_a_list():
    suggestion = ACCELERATOR_REGISTRY.suggestion("hpu", ("gpu",))
    assert re.fullmatch(r" Did you mean '(\w+)', '(\w+)' or '(\w+)'\?", suggestion)
    assert sorted(re.findall(r"'(\w+)'", suggestion)) == ["cpu", "gpu", "tpu"]
