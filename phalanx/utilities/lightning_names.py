"""Lightning names a phalanx package does not have: importing one raises an ImportError that says what to use."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NotOffered:
    """A Lightning name a phalanx package lacks: what to use instead, and whether it is planned."""

    #: What to use instead today, as a phrase that completes "use ..." (e.g. "Trainer(max_time=...)").
    instead: str
    #: True: planned (listed as "not offered yet"); False: not planned.
    planned: bool = False

    def message(self, package: str, name: str) -> str:
        """The error's text for ``from {package} import {name}``."""
        status = "is not offered yet" if self.planned else "is not offered"
        return f"Lightning's {name} {status} in {package}; use {self.instead}. See docs/migrating-from-lightning.md."


def missing_name_error(package: str, name: str, table: dict[str, NotOffered]) -> Exception:
    """What a package's module ``__getattr__`` raises for ``name``: an ImportError naming the alternative for a
    Lightning name in ``table``, else the usual AttributeError (so ``hasattr`` keeps working for other names)."""
    entry = table.get(name)
    if entry is None:
        return AttributeError(f"module {package!r} has no attribute {name!r}")
    return ImportError(entry.message(package, name), name=package)


__all__ = ["NotOffered", "missing_name_error"]
