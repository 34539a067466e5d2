"""The name -> class registry: registration, lookup, errors, and third-party entry points."""

from __future__ import annotations

import functools
import importlib
import sys
import textwrap
from pathlib import Path

import pytest

from phalanx.accelerators.registry import ACCELERATOR_REGISTRY
from phalanx.strategies.registry import STRATEGY_REGISTRY
from phalanx.strategies.single_device import SingleDeviceStrategy
from phalanx.utilities.registry import Registry


class _Thing:
    def __init__(self, size: int = 1, colour: str = "red") -> None:
        self.size = size
        self.colour = colour


def _registry() -> Registry:
    # An entry-point group nobody installs, so that only what the test registers is there.
    return Registry("thing", "phalanx.tests.no_such_group")


def test_register_with_description_and_default_kwargs_and_get_with_overrides() -> None:
    registry = _registry()
    registry.register("big_thing", _Thing, description="A big thing.", size=10)
    assert registry.description("big_thing") == "A big thing."
    assert registry.init_params("big_thing") == {"size": 10}
    assert registry.get_class("big_thing") is _Thing
    thing = registry.get("big_thing")
    assert (thing.size, thing.colour) == (10, "red")
    thing = registry.get("big_thing", size=3, colour="blue")
    assert (thing.size, thing.colour) == (3, "blue")
    assert registry.get("big_thing").size == 10  # overrides do not stick


def test_init_params_returns_a_copy() -> None:
    registry = _registry()
    registry.register("t", _Thing, size=2)
    registry.init_params("t")["size"] = 99
    assert registry.get("t").size == 2


def test_lookup_is_case_insensitive() -> None:
    registry = _registry()
    registry.register("Single_Device", _Thing)
    assert "SINGLE_DEVICE" in registry
    assert isinstance(registry.get("SINGLE_DEVICE"), _Thing)
    assert registry.available() == ["single_device"]
    assert isinstance(STRATEGY_REGISTRY.get("SINGLE_DEVICE"), SingleDeviceStrategy)


def test_duplicate_registration_raises_unless_override() -> None:
    registry = _registry()
    registry.register("t", _Thing, size=1)
    with pytest.raises(ValueError, match=r"'T' is already registered \(to _Thing\); pass override=True"):
        registry.register("T", dict)
    registry.register("T", _Thing, override=True, size=5)
    assert registry.get("t").size == 5
    assert len(registry) == 1


def test_duplicate_registration_of_a_partial_names_it() -> None:
    registry = _registry()
    registry.register("p", functools.partial(_Thing, size=3))
    with pytest.raises(ValueError, match="already registered"):
        registry.register("p", _Thing)


def test_unknown_name_lists_the_known_names() -> None:
    registry = _registry()
    registry.register("alpha", _Thing)
    registry.register("beta", _Thing)
    with pytest.raises(ValueError, match=r"Unknown thing 'gamma'. Registered things: alpha, beta"):
        registry.get("gamma")
    with pytest.raises(ValueError, match="single_device"):
        STRATEGY_REGISTRY.get("no_such_strategy")
    with pytest.raises(ValueError, match=r"Registered strategies: .*single_device"):
        STRATEGY_REGISTRY.get_class("no_such_strategy")
    with pytest.raises(
        ValueError, match=r"Registered accelerators: .*cpu, cuda, .*mps, .*tpu, .*xla"
    ):  # plug-ins may sort between
        ACCELERATOR_REGISTRY.get("ipu")


def test_bad_names_raise_type_error() -> None:
    registry = _registry()
    with pytest.raises(TypeError):
        registry.register("", _Thing)
    with pytest.raises(TypeError):
        registry.register(3, _Thing)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        registry.get(3)  # type: ignore[arg-type]
    assert 3 not in registry


def test_decorator_form_returns_the_class_unchanged() -> None:
    registry = _registry()

    @registry.register("decorated", description="Made by a decorator.", colour="green")
    class Decorated(_Thing):
        pass

    assert isinstance(Decorated, type)  # the decorator returns the class itself
    assert registry.get_class("decorated") is Decorated
    assert registry.get("decorated").colour == "green"
    assert registry.description("decorated") == "Made by a decorator."


def test_remove_forgets_the_name() -> None:
    registry = _registry()
    registry.register("t", _Thing)
    registry.remove("T")
    assert "t" not in registry
    registry.remove("never-registered")  # no error
    assert registry.available() == []


# ------------------------------------------------------------------ entry points


_FAKE_PLUGIN = '''
from phalanx.accelerators.cpu import CPUAccelerator
from phalanx.strategies.single_device import SingleDeviceStrategy


class FakeStrategy(SingleDeviceStrategy):
    """A third-party strategy."""

    @classmethod
    def register_strategies(cls, registry):
        registry.register("fake", cls, description="A fake third-party strategy.", device="cpu")


class FakeAccelerator(CPUAccelerator):
    """A third-party accelerator."""

    name = "fake_accel"

    @classmethod
    def register_accelerators(cls, registry):
        registry.register("fake_accel", cls, description="A fake third-party accelerator.")


def register_everything(registry):
    registry.register("from_function", FakeStrategy, description="Registered by a plain function.")
'''


@pytest.fixture
def fake_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """An installed distribution 'fakeplugin' declaring phalanx entry points, importable from ``tmp_path``."""
    (tmp_path / "fakeplugin_mod.py").write_text(textwrap.dedent(_FAKE_PLUGIN))
    dist_info = tmp_path / "fakeplugin-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeplugin\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(
        "[phalanx.strategies]\nfake = fakeplugin_mod:FakeStrategy\n\n"
        "[phalanx.accelerators]\nfake_accel = fakeplugin_mod:FakeAccelerator\n\n"
        "[phalanx.tests.functions]\nanything = fakeplugin_mod:register_everything\n\n"
        "[phalanx.tests.broken]\nbroken = fakeplugin_mod:_FAKE_CONSTANT\n"
    )
    with (tmp_path / "fakeplugin_mod.py").open("a") as handle:
        handle.write("\n_FAKE_CONSTANT = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield tmp_path
    sys.modules.pop("fakeplugin_mod", None)
    importlib.invalidate_caches()


def test_a_fresh_strategy_registry_finds_an_entry_point_strategy(fake_distribution: Path) -> None:
    registry = Registry("strategy", "phalanx.strategies")
    assert "fake" in registry
    strategy_class = registry.get_class("FAKE")
    assert strategy_class.__name__ == "FakeStrategy"
    assert issubclass(strategy_class, SingleDeviceStrategy)
    assert registry.description("fake") == "A fake third-party strategy."
    strategy = registry.get("fake")
    assert strategy.root_device.type == "cpu"
    assert "fake" in registry.available()


def test_a_fresh_accelerator_registry_finds_an_entry_point_accelerator(fake_distribution: Path) -> None:
    registry = Registry("accelerator", "phalanx.accelerators")
    assert "fake_accel" in registry.available()  # beside any installed plug-in (CI installs integrations/)
    accelerator = registry.get("fake_accel")
    assert type(accelerator).__name__ == "FakeAccelerator"
    assert accelerator.parse_devices(2) == 2


def test_entry_point_may_be_a_plain_registering_function(fake_distribution: Path) -> None:
    registry = Registry("thing", "phalanx.tests.functions")
    assert registry.available() == ["from_function"]
    assert registry.description("from_function") == "Registered by a plain function."


def test_entry_point_that_is_neither_class_nor_callable_is_skipped_and_named(fake_distribution: Path) -> None:
    registry = Registry("thing", "phalanx.tests.broken")
    with pytest.warns(
        UserWarning, match=r"entry point 'broken' of distribution 'fakeplugin'.*register_things\(registry\)"
    ):
        assert registry.available() == []
    with pytest.raises(ValueError, match=r"Unknown thing 'anything'.*'broken' of distribution 'fakeplugin'"):
        registry.get("anything")


def test_entry_points_are_not_loaded_for_names_already_registered(fake_distribution: Path) -> None:
    registry = Registry("strategy", "phalanx.strategies")
    registry.register("local", _Thing)
    assert isinstance(registry.get("local"), _Thing)
    assert "fakeplugin_mod" not in sys.modules  # a hit does not scan installed distributions
    assert "fake" in registry  # a miss does
    assert "fakeplugin_mod" in sys.modules


def test_registries_index_like_lightnings_dictionaries() -> None:
    from phalanx.accelerators.registry import ACCELERATOR_REGISTRY
    from phalanx.strategies import DDPStrategy
    from phalanx.strategies.registry import STRATEGY_REGISTRY

    entry = STRATEGY_REGISTRY["DDP_Spawn"]
    assert entry["strategy"] is DDPStrategy and entry["strategy_name"] == "ddp_spawn"
    assert entry["init_params"] == {"start_method": "spawn"} and "spawn" in entry["description"]
    entry["init_params"]["start_method"] = "fork"  # a copy: the registry keeps its defaults
    assert STRATEGY_REGISTRY.init_params("ddp_spawn") == {"start_method": "spawn"}
    assert "ddp" in STRATEGY_REGISTRY and "nope" not in STRATEGY_REGISTRY
    assert list(STRATEGY_REGISTRY) == STRATEGY_REGISTRY.keys() == STRATEGY_REGISTRY.available()
    assert dict(STRATEGY_REGISTRY.items())["ddp"]["strategy"] is DDPStrategy
    assert len(STRATEGY_REGISTRY.values()) == len(STRATEGY_REGISTRY)
    assert ACCELERATOR_REGISTRY["cpu"]["accelerator_name"] == "cpu"
    with pytest.raises(KeyError, match="Unknown strategy 'nope'. Registered strategies: .*ddp"):
        STRATEGY_REGISTRY["nope"]
