"""Entry-point plugins of every kind, healthy and hostile: what registers, what is skipped with a warning naming the
plugin, what a lookup then says, and that a Trainer naming phalanx's own names loads none of them."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from phalanx.strategies.ddp import DDPStrategy
from phalanx.strategies.single_device import SingleDeviceStrategy
from phalanx.utilities.registry import Registry

GROUP = "phalanx.tests.plugin_kinds"

# Each kind is one distribution `kind-<kind>` whose module `kind_<kind>` holds the plugin; its entry point `plugin`
# comes first in its entry_points.txt, and a healthy entry point `healthy` of the same distribution comes after it.
_HEALTHY = '''
from phalanx.strategies.single_device import SingleDeviceStrategy


class Plugged(SingleDeviceStrategy):
    """A third-party strategy."""

    @classmethod
    def register_strategies(cls, registry):
        registry.register(NAME, cls, description="plugged in")


def register(registry):
    registry.register("healthy_" + NAME, Plugged)


def register_function(registry):
    registry.register(NAME, Plugged)


class NoHook:
    """A class without a register_strategies hook."""
'''

# kind: (what the module adds to _HEALTHY, the object the entry point names, the error its warning shows or None)
KINDS = {
    "class_with_hook": ("", "Plugged", None),
    "function": ("", "register_function", None),
    "import_error": (
        "raise ImportError('needs libfoo, which is not installed')",
        "Plugged",
        "ImportError: needs libfoo",
    ),
    "missing_object": ("", "NoSuchObject", "AttributeError"),
    "constant": ("VALUE = 3", "VALUE", "a 'int' object, which is neither a class with a register_strategies"),
    "class_without_hook": ("", "NoHook", "the class 'NoHook', which is neither a class with a register_strategies"),
    "replaces_ddp": (
        "def register_bad(registry):\n    registry.register('ddp', Plugged, override=True)",
        "register_bad",
        "it registers the strategy name 'ddp', which is phalanx's own",
    ),
    "replaces_single_device": (
        "def register_bad(registry):\n    registry.register('SINGLE_DEVICE', Plugged)",
        "register_bad",
        "it registers the strategy name 'SINGLE_DEVICE', which is phalanx's own",
    ),
    "fails_half_way": (
        "def register_bad(registry):\n    registry.register(NAME, Plugged)\n    raise RuntimeError('half-way')",
        "register_bad",
        "RuntimeError: half-way",
    ),
}


def _install(root: Path, kind: str, extra: str, target: str, entry_points: str | None = None) -> None:
    module = f"kind_{kind}"
    source = f"NAME = {kind!r}\n{textwrap.dedent(_HEALTHY)}\n{extra}\n"
    if extra.startswith("raise"):  # fails at import: put the failure first
        source = f"{extra}\n{source}"
    (root / f"{module}.py").write_text(source)
    if not extra.startswith("raise"):
        (root / f"{module}_ok.py").write_text(f"from {module} import register\n")
    else:
        (root / f"{module}_ok.py").write_text(f"NAME = {kind!r}\n{textwrap.dedent(_HEALTHY)}")
    dist_info = root / f"{module}-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kind-{kind}\nVersion: 0.1\n")
    lines = entry_points or f"[{GROUP}]\nplugin = {module}:{target}\nhealthy = {module}_ok:register\n"
    (dist_info / "entry_points.txt").write_text(lines)


@pytest.fixture
def plugins_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A folder on sys.path that ``_install`` puts distributions in; their modules are forgotten afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield tmp_path
    for name in [name for name in sys.modules if name.startswith("kind_")]:
        del sys.modules[name]
    importlib.invalidate_caches()


def _registry_with_builtins() -> Registry:
    # phalanx's own names are those registered outside a plugin's registration.
    registry = Registry("strategy", GROUP)
    registry.register("ddp", DDPStrategy)
    registry.register("single_device", SingleDeviceStrategy)
    return registry


def _recorded(action):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = action()
    return result, [str(warning.message) for warning in caught]


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_of_plugin_registers_or_is_skipped_naming_itself(plugins_dir: Path, kind: str) -> None:
    extra, target, error = KINDS[kind]
    _install(plugins_dir, kind, extra, target)
    registry = _registry_with_builtins()
    names, messages = _recorded(registry.available)
    assert f"healthy_{kind}" in names  # a broken plugin does not stop the entry points after it
    assert registry.get_class("ddp") is DDPStrategy and registry.get_class("single_device") is SingleDeviceStrategy
    if error is None:
        assert messages == []
        assert registry.get_class(kind).__name__ == "Plugged"
        return
    assert kind not in names  # all or nothing: a plugin that fails half-way leaves none of its names
    assert len(messages) == 1, messages
    for part in (f"distribution 'kind-{kind}'", "entry point 'plugin'", f"module 'kind_{kind}'", error, GROUP):
        assert part in messages[0]
    assert "still work" in messages[0]
    # Asked for a name only the broken plugin could provide, the error names the plugin and what it failed with.
    with pytest.raises(ValueError, match=f"Unknown strategy '{kind}'") as raised:
        _recorded(lambda: registry.get(kind))
    for part in (f"distribution 'kind-{kind}'", "entry point 'plugin'", error):
        assert part in str(raised.value)
    # Each entry point is tried once: listing again neither warns again nor loses the healthy names.
    names_again, messages_again = _recorded(registry.available)
    assert messages_again == [] and names_again == names


def test_a_plugin_cannot_take_a_name_another_plugin_registered(plugins_dir: Path) -> None:
    _install(plugins_dir, "first", "", "Plugged")
    _install(
        plugins_dir,
        "second",
        "def register_bad(registry):\n    registry.register('first', Plugged, override=True)",
        "register_bad",
        entry_points=f"[{GROUP}]\nplugin = kind_second:register_bad\n",
    )
    registry = _registry_with_builtins()
    names, messages = _recorded(registry.available)
    # The first one loaded keeps the name (the order is the distributions' order on sys.path); the other is skipped.
    winner = registry.get_class("first").__module__.removeprefix("kind_")
    loser = {"first": "second", "second": "first"}[winner]
    assert len(messages) == 1
    assert f"distribution 'kind-{loser}'" in messages[0]
    assert f"already registered by entry point 'plugin' of distribution 'kind-{winner}'" in messages[0]


def test_a_plugin_installed_after_a_failed_load_registers_at_the_next_miss(plugins_dir: Path) -> None:
    _install(plugins_dir, "import_error", *KINDS["import_error"][:2])
    registry = _registry_with_builtins()
    _, messages = _recorded(lambda: "late" in registry)
    assert len(messages) == 1
    _install(plugins_dir, "late", "", "Plugged")
    importlib.invalidate_caches()
    found, messages = _recorded(lambda: "late" in registry)
    assert found and messages == []
    assert registry.get_class("healthy_late").__module__ == "kind_late"


def _install_in_phalanx_groups(root: Path) -> None:
    _install(
        root,
        "trainer_broken",
        "raise ImportError('needs libfoo, which is not installed')",
        "Plugged",
        entry_points="[phalanx.strategies]\ntrainer_broken = kind_trainer_broken:Plugged\n\n"
        "[phalanx.accelerators]\ntrainer_broken = kind_trainer_broken:Plugged\n",
    )
    _install(root, "trainer_ok", "", "Plugged", entry_points="[phalanx.strategies]\nok = kind_trainer_ok:Plugged\n")


# Run in a fresh process (phalanx's registries as a program meets them), the two distributions on sys.path; prints,
# for each Trainer built, its strategy's module (or the error), the kind_ modules imported so far and the warnings.
_TRAINERS = """
import json, sys, warnings
import phalanx

def build(**arguments):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer = phalanx.Trainer(logger=False, enable_progress_bar=False, **arguments)
            outcome = type(trainer.strategy).__module__
        except Exception as error:
            outcome = f"{type(error).__name__}: {error}"
    loaded = sorted(name for name in sys.modules if name.startswith("kind_"))
    return {"outcome": outcome, "loaded": loaded, "warnings": [str(w.message) for w in caught]}

print(json.dumps([build(**arguments) for arguments in json.loads(sys.argv[1])]))
"""


def _trainers(root: Path, arguments: list[dict]) -> list[dict]:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), *sys.path])}
    command = [sys.executable, "-c", _TRAINERS, json.dumps(arguments)]
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_trainers_naming_phalanx_names_load_no_plugin_and_a_plugin_name_skips_a_broken_one(tmp_path: Path) -> None:
    _install_in_phalanx_groups(tmp_path)
    own = [{}, {"strategy": "ddp", "devices": 1}, {"accelerator": "cpu", "strategy": "single_device"}, {"devices": 1}]
    asked = [{"strategy": "trainer_ok"}, {"strategy": "trainer_broken"}, {"accelerator": "trainer_broken"}]
    results = _trainers(tmp_path, own + asked)
    for arguments, result in zip(own, results):
        assert result == {"outcome": result["outcome"], "loaded": [], "warnings": []}, arguments
        assert result["outcome"].startswith("phalanx.strategies."), arguments
    plugged, broken_strategy, broken_accelerator = results[len(own) :]
    assert plugged["outcome"] == "kind_trainer_ok" and plugged["loaded"] == ["kind_trainer_ok"]
    assert len(plugged["warnings"]) == 1 and "distribution 'kind-trainer_broken'" in plugged["warnings"][0]
    for result, kind in ((broken_strategy, "strategy"), (broken_accelerator, "accelerator")):
        assert result["outcome"].startswith(f"ValueError: Unknown {kind} 'trainer_broken'")
        assert "distribution 'kind-trainer_broken'" in result["outcome"]
        assert "ImportError: needs libfoo" in result["outcome"]
    assert broken_strategy["warnings"] == []  # warned once, when the strategies' plugins were first loaded
    assert len(broken_accelerator["warnings"]) == 1  # the accelerators' group loads it on its own first miss
