"""A name -> class registry with default keyword arguments and entry-point discovery."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, TypeVar

from phalanx.utilities.rank_zero import rank_zero_warn

_T = TypeVar("_T")


@dataclass
class _Plugin:
    """One entry point of a registry's group, and what came of loading it (``error`` None: it registered)."""

    distribution: str
    entry_point: str
    module: str
    error: str | None = None

    def __str__(self) -> str:
        return f"entry point {self.entry_point!r} of distribution {self.distribution!r} (module {self.module!r})"


class _PluginRefused(Exception):
    """Raised inside a plugin's registration when it registers a name it may not take."""


def _plural(word: str) -> str:
    """English plural of a registry kind: 'strategy' -> 'strategies', 'accelerator' -> 'accelerators'."""
    return word[:-1] + "ies" if word.endswith("y") else word + "s"


def _name_of(factory: Any) -> str:
    """A readable name for a class, function or ``functools.partial``."""
    return getattr(factory, "__qualname__", None) or getattr(factory, "__name__", None) or repr(factory)


class Registry(Generic[_T]):
    """Maps lower-case names to a class (or factory) plus default keyword arguments and a description."""

    def __init__(self, kind: str, entry_point_group: str, packages: dict[str, str] | None = None) -> None:
        self._kind = kind
        self._entry_point_group = entry_point_group
        # Names that separate packages register, with how to install each: the error for such a name says so.
        self._packages = {name.lower(): install for name, install in (packages or {}).items()}
        self._entries: dict[str, dict[str, Any]] = {}
        # Every entry point tried so far, keyed by (distribution, name, value): each is loaded once, and one that
        # appears later (a package installed since) is loaded at the next miss.
        self._plugins: dict[tuple[str, str, str], _Plugin] = {}
        self._loading: _Plugin | None = None  # the plugin whose registration is running

    def register(
        self,
        name: str,
        factory: Callable[..., _T] | None = None,
        *,
        description: str = "",
        override: bool = False,
        **init_params: Any,
    ) -> Callable[..., Any]:
        """Register ``factory`` under ``name`` (usable as a decorator when ``factory`` is omitted)."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"A {self._kind} name must be a non-empty string, got {name!r}")
        key = name.lower()

        def do_register(target: Callable[..., _T]) -> Callable[..., _T]:
            if key in self._entries and self._loading is not None:
                # A plugin never replaces a name, override or not: `strategy="ddp"` must mean phalanx's DDP.
                owner = self._entries[key]["plugin"]
                taken_by = "phalanx's own" if owner is None else f"already registered by {owner}"
                raise _PluginRefused(f"it registers the {self._kind} name {name!r}, which is {taken_by}")
            if key in self._entries and not override:
                raise ValueError(
                    f"{self._kind.capitalize()} {name!r} is already registered"
                    f" (to {_name_of(self._entries[key]['factory'])}); pass override=True to replace it."
                )
            self._entries[key] = {
                "factory": target,
                "description": description,
                "init_params": init_params,
                "plugin": self._loading,
            }
            return target

        if factory is not None:
            return do_register(factory)
        return do_register

    def remove(self, name: str) -> None:
        """Forget ``name``."""
        self._entries.pop(name.lower(), None)

    def get(self, name: str, **overrides: Any) -> _T:
        """Instantiate the entry for ``name`` with its default keyword arguments updated by ``overrides``."""
        entry = self._lookup(name)
        return entry["factory"](**{**entry["init_params"], **overrides})

    def get_class(self, name: str) -> Callable[..., _T]:
        """Return the class (or factory) registered under ``name``."""
        return self._lookup(name)["factory"]

    def init_params(self, name: str) -> dict[str, Any]:
        """Return a copy of the default keyword arguments registered for ``name``."""
        return dict(self._lookup(name)["init_params"])

    def description(self, name: str) -> str:
        """Return the description registered for ``name``."""
        return self._lookup(name)["description"]

    def available(self) -> list[str]:
        """Return the registered names, sorted."""
        self._load_entry_points()
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        if name.lower() not in self._entries:
            self._load_entry_points()
        return name.lower() in self._entries

    def __len__(self) -> int:
        return len(self.available())

    # Lightning users index the registries as dictionaries: ``STRATEGY_REGISTRY["ddp"]["init_params"]``.
    def __getitem__(self, name: str) -> dict[str, Any]:
        """The entry for ``name`` as Lightning lays it out: ``{kind}``, ``{kind}_name``, ``description``,
        ``init_params``."""
        try:
            entry = self._lookup(name)
        except ValueError as error:
            raise KeyError(str(error)) from None
        key = self._kind.replace(" ", "_")
        return {
            key: entry["factory"],
            f"{key}_name": name.lower(),
            "description": entry["description"],
            "init_params": dict(entry["init_params"]),
        }

    def __iter__(self) -> Iterator[str]:
        return iter(self.available())

    def keys(self) -> list[str]:
        """The registered names, sorted (as ``available()``)."""
        return self.available()

    def values(self) -> list[dict[str, Any]]:
        """Every entry, laid out as ``registry[name]``."""
        return [self[name] for name in self.available()]

    def items(self) -> list[tuple[str, dict[str, Any]]]:
        """``(name, registry[name])`` for every registered name."""
        return [(name, self[name]) for name in self.available()]

    @property
    def _register_hook(self) -> str:
        return f"register_{_plural(self._kind.replace(' ', '_'))}"

    def _lookup(self, name: str) -> dict[str, Any]:
        if not isinstance(name, str):
            raise TypeError(f"A {self._kind} name must be a string, got {type(name).__name__}")
        key = name.lower()
        if key not in self._entries:
            self._load_entry_points()
        if key not in self._entries:
            raise ValueError(
                f"Unknown {self._kind} {name!r}.{self.suggestion(name)}"
                f" Registered {_plural(self._kind)}: {', '.join(self.available())}.{self.failed_plugins_note()}"
            )
        return self._entries[key]

    def failed_plugins_note(self) -> str:
        """For an unknown-name error: the plugins of this group that failed to load (one of them may provide the
        name), each with its error; empty when none failed."""
        failed = [f"{plugin} ({plugin.error})" for plugin in self._plugins.values() if plugin.error]
        if not failed:
            return ""
        return (
            f" Plugins of {self._entry_point_group!r} that failed to load, which may provide it: {'; '.join(failed)}."
        )

    def suggestion(self, name: str, extra_names: tuple[str, ...] = ()) -> str:
        """A sentence (with a leading space) for an error about the unknown ``name``: the package that registers it
        when one is known, else the closest registered names (and ``extra_names``, e.g. 'auto'); empty if none."""
        import difflib

        key = name.lower()
        install = self._packages.get(key)
        if install is not None:
            return f" {self._kind.capitalize()} {name!r} comes from a separate package, not installed here: {install}."
        close = difflib.get_close_matches(key, [*extra_names, *self.available()], n=3, cutoff=0.6)
        if not close:
            return ""
        quoted = [repr(match) for match in close]
        listed = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
        return f" Did you mean {listed}?"

    def _load_entry_points(self) -> None:
        # Third-party plugins are discovered only when a lookup misses or the names are listed, so that
        # `import phalanx` and a Trainer that names phalanx's own strategy and accelerator never import them.
        if self._loading is not None:
            return  # a plugin that looks a name up while it registers
        from importlib.metadata import entry_points

        for entry_point in entry_points(group=self._entry_point_group):
            distribution = getattr(getattr(entry_point, "dist", None), "name", None) or "<unknown>"
            key = (distribution, entry_point.name, entry_point.value)
            if key not in self._plugins:
                self._plugins[key] = self._load_plugin(entry_point, distribution)

    def _load_plugin(self, entry_point: Any, distribution: str) -> _Plugin:
        # One plugin, all or nothing: whatever it fails on, its names are taken back, a warning names it, and the
        # registry goes on with phalanx's names and the other plugins'.
        plugin = _Plugin(distribution, entry_point.name, getattr(entry_point, "module", entry_point.value))
        before = dict(self._entries)
        self._loading = plugin
        try:
            self._registrar(entry_point.load())(self)
        except Exception as error:  # noqa: BLE001 - a third party's import or registration may raise anything
            self._entries.clear()
            self._entries.update(before)
            plugin.error = str(error) if isinstance(error, _PluginRefused) else f"{type(error).__name__}: {error}"
            rank_zero_warn(
                f"Skipped the {self._entry_point_group!r} plugin {plugin}: {plugin.error}. phalanx's own"
                f" {_plural(self._kind)} and the other plugins still work."
            )
        finally:
            self._loading = None
        return plugin

    def _registrar(self, loaded: Any) -> Callable[[Registry[_T]], Any]:
        # The hook is named after the plural: register_strategies, register_accelerators. A class without it is not
        # a registrar (calling it would build an instance, not register anything).
        register = getattr(loaded, self._register_hook, None)
        if callable(register):
            return register
        if callable(loaded) and not isinstance(loaded, type):
            return loaded
        what = f"the class {_name_of(loaded)!r}" if isinstance(loaded, type) else f"a {type(loaded).__name__!r} object"
        raise _PluginRefused(
            f"it names {what}, which is neither a class with a {self._register_hook}(registry) classmethod nor a"
            " function taking the registry"
        )
