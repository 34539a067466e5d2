"""torch.compile for the strategies: the ``compile`` setting checked, a model the user compiled unwrapped, and the
module compiled in place (each repeated block, or the whole module), so that its state dict keeps its own names."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from functools import partial
from typing import Any, Callable

import torch
from torch import nn

#: Compiles a callable (``torch.compile`` with the run's options, or the context of a model the user compiled).
Compiler = Callable[[Callable[..., Any]], Callable[..., Any]]

#: The keyword arguments of ``torch.compile`` that ``compile={...}`` may set, with the types each accepts.
COMPILE_OPTIONS: dict[str, tuple[type, ...]] = {
    "fullgraph": (bool,),
    "dynamic": (bool, type(None)),
    "backend": (str,),
    "mode": (str, type(None)),
    "options": (dict, type(None)),
    "disable": (bool,),
}


def check_compile(value: Any, owner: str) -> dict[str, Any] | None:
    """``compile=value`` of ``owner`` (e.g. 'Trainer') as torch.compile's keyword arguments; None: no compilation.

    True compiles with torch.compile's defaults; a dict passes its keys on; False and None compile nothing. Raises a
    TypeError or ValueError naming the bad value and the valid choices.
    """
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{owner}(compile={value!r}) is not valid; pass True, False, None or a dict of torch.compile arguments."
            f" Its keys: {', '.join(COMPILE_OPTIONS)}."
        )
    options = dict(value)
    for key, given in options.items():
        if key not in COMPILE_OPTIONS:
            raise ValueError(
                f"{owner}(compile=...) has the unknown key {key!r}; torch.compile takes {list(COMPILE_OPTIONS)}."
            )
        allowed = COMPILE_OPTIONS[key]
        if not isinstance(given, allowed) and not (key == "backend" and callable(given)):
            names = " or ".join("None" if kind is type(None) else kind.__name__ for kind in allowed)
            raise TypeError(f"{owner}(compile={{{key!r}: {given!r}}}) is not valid; {key!r} takes {names}.")
    try:
        # torch checks the backend's name and the mode/options pair here, long before the first step would.
        torch.compile(_probe, **options)
    except Exception as error:  # torch raises several types (InvalidBackend, RuntimeError, ...) for bad options
        raise ValueError(f"{owner}(compile={options!r}) is refused by torch.compile: {error}") from error
    return options


def _probe() -> None:
    """A function for torch.compile to check options against (never called)."""


def unwrap_compiled(model: Any) -> tuple[Any, Compiler | None]:
    """``model`` without torch.compile's wrapper, and the compiler it was made with (None if it was not compiled).

    ``torch.compile(module)`` returns an OptimizedModule whose state dict keys carry an ``_orig_mod.`` prefix; the
    strategies set up the original module instead and compile it in place with the same context.
    """
    original = getattr(model, "_orig_mod", None)
    context = getattr(model, "dynamo_ctx", None)
    if isinstance(model, nn.Module) and isinstance(original, nn.Module) and callable(context):
        return original, context
    return model, None


def compiler_for(options: Mapping[str, Any] | None, precompiled: Compiler | None, owner: str) -> Compiler | None:
    """The compiler a run uses: the ``compile=`` options, or those of a model the user compiled, never both."""
    if options is not None and precompiled is not None:
        raise ValueError(
            f"The model was compiled with torch.compile and {owner} has compile=... too; pass the plain model with"
            f" {owner}(compile=...), or the compiled model without it."
        )
    if precompiled is not None:
        return precompiled
    return None if options is None else partial(torch.compile, **options)


def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """The blocks of every ModuleList or Sequential whose two or more children are composite modules of one type
    (transformer layers, residual stages); the outermost such container wins over those inside its blocks."""
    blocks: list[nn.Module] = []
    taken: list[str] = []
    for name, child in module.named_modules():
        if any(name.startswith(prefix) for prefix in taken):
            continue
        if not isinstance(child, (nn.ModuleList, nn.Sequential)) or len(child) < 2:
            continue
        members = list(child.children())
        if len({type(member) for member in members}) == 1 and any(True for _ in members[0].children()):
            blocks.extend(members)
            taken.append(f"{name}." if name else "")
    return blocks


def compile_in_place(module: nn.Module, compiler: Compiler) -> list[nn.Module]:
    """Compile each repeated block of ``module`` in place, or ``module`` itself when it has none; returns them.

    In place as ``nn.Module.compile`` does it: the module calls a compiled version of its own ``_call_impl``, so it
    keeps its class, its parameters and its state dict keys (checkpoints are the same files as eager ones).
    """
    targets = repeated_blocks(module) or [module]
    for target in targets:
        # The attribute nn.Module.compile sets; set here so that the context of a user's torch.compile applies too.
        target._compiled_call_impl = compiler(target._call_impl)  # type: ignore[assignment]
        _COMPILED_HERE[target] = target._compiled_call_impl
    return targets


# What compile_in_place compiled, and with what: a later stage may compile it again; a user's module.compile() not.
_COMPILED_HERE: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def refuse_compiled_in_place(module: nn.Module, options: Mapping[str, Any] | None, owner: str) -> None:
    """Refuse ``compile=`` options for a module the user compiled in place (``module.compile(...)``, on it or on one
    of its submodules): compiling the run would silently replace that compilation's backend and options."""
    if options is None:
        return
    for name, submodule in module.named_modules():
        compiled = getattr(submodule, "_compiled_call_impl", None)
        if compiled is not None and _COMPILED_HERE.get(submodule) is not compiled:
            what = "The model" if not name else f"The model's submodule {name!r}"
            raise ValueError(
                f"{what} was compiled in place with .compile(...) and {owner} has compile=... too, which would replace"
                f" that compilation (its backend and options). Pass {owner}(compile=...) with a model not compiled,"
                f" or the compiled model without compile=."
            )


__all__ = [
    "COMPILE_OPTIONS",
    "Compiler",
    "check_compile",
    "compile_in_place",
    "compiler_for",
    "refuse_compiled_in_place",
    "repeated_blocks",
    "unwrap_compiled",
]
