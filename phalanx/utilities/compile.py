"""torch.compile for the strategies: the ``compile`` setting checked, a model the user compiled unwrapped, and the
module compiled in place (the model, or each repeated block), so that its state dict keeps its own names."""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Literal

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

#: What a strategy compiles in place (see :func:`compile_in_place`): "model" or "blocks".
CompileUnit = Literal["model", "blocks"]
COMPILE_UNITS: tuple[str, ...] = ("model", "blocks")
#: The key of ``compile={...}`` that chooses the unit; phalanx reads it and never passes it to torch.compile.
UNIT_KEY = "unit"


def check_compile(value: Any, owner: str) -> dict[str, Any] | None:
    """``compile=value`` of ``owner`` (e.g. 'Trainer') as torch.compile's keyword arguments; None: no compilation.

    True compiles with torch.compile's defaults; a dict passes its keys on, except ``"unit"`` (see
    :func:`split_unit`); False and None compile nothing. Raises a TypeError or ValueError naming the bad value and the
    valid choices.
    """
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{owner}(compile={value!r}) is not valid; pass True, False, None or a dict of torch.compile arguments."
            f" Its keys: {', '.join(COMPILE_OPTIONS)}, and {UNIT_KEY!r} ({' or '.join(map(repr, COMPILE_UNITS))})."
        )
    options, unit = split_unit(value)
    if unit is not None and unit not in COMPILE_UNITS:
        raise ValueError(
            f"{owner}(compile={{{UNIT_KEY!r}: {unit!r}}}) is not valid; choose {' or '.join(map(repr, COMPILE_UNITS))}."
        )
    for key, given in options.items():
        if key not in COMPILE_OPTIONS:
            raise ValueError(
                f"{owner}(compile=...) has the unknown key {key!r}; torch.compile takes {list(COMPILE_OPTIONS)},"
                f" and phalanx reads {UNIT_KEY!r}."
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
    return options if unit is None else {**options, UNIT_KEY: unit}


def split_unit(options: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """``compile={...}`` as torch.compile's keyword arguments and the unit it asks for (None: the strategy's)."""
    rest = dict(options)
    return rest, rest.pop(UNIT_KEY, None)


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
    return None if options is None else partial(torch.compile, **split_unit(options)[0])


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


def model_unit(module: nn.Module) -> nn.Module:
    """What the "model" unit compiles: the innermost submodule of ``module`` with a ``forward`` that holds all its
    repeated blocks (the GPT a TrainingModule keeps as an attribute), or ``module`` itself.

    Not simply ``module``: a ``training_step`` that calls ``self.gpt(x)`` never calls the TrainingModule's own
    ``forward``, so compiling that would compile nothing that runs.
    """
    names = {id(child): name for name, child in module.named_modules()}
    paths = [names[id(block)].split(".") for block in repeated_blocks(module)]
    if not paths:
        return module
    common = paths[0][:-1]
    for path in paths[1:]:
        while path[: len(common)] != common:
            common = common[:-1]
    while common:
        holder = module.get_submodule(".".join(common))
        # A ModuleList or ModuleDict has no forward of its own: the module that calls its members is one level up.
        if type(holder).forward is not nn.Module.forward:
            return holder
        common = common[:-1]
    return module


def compile_targets(module: nn.Module, unit: CompileUnit) -> list[nn.Module]:
    """The modules that ``unit`` compiles in ``module``: each repeated block ("blocks"; the whole module when it has
    none), or the one module of :func:`model_unit` ("model")."""
    if unit == "blocks":
        return repeated_blocks(module) or [module]
    return [model_unit(module)]


def compile_in_place(module: nn.Module, compiler: Compiler, unit: CompileUnit = "blocks") -> list[nn.Module]:
    """Compile the targets of ``unit`` in ``module`` (:func:`compile_targets`) in place; returns them.

    In place as ``nn.Module.compile`` does it: a target calls a compiled version of its own ``_call_impl``, so it
    keeps its class, its parameters and its state dict keys (checkpoints are the same files as eager ones). ``module``
    itself, when it is the target, gets a compiled ``forward`` instead: the strategies run its step methods through
    its call (``redirect_forward`` swaps its forward for the step), which a compiled ``_call_impl`` would trace.
    """
    targets = compile_targets(module, unit)
    for target in targets:
        if target is module:
            # The class's forward, not one compiled at an earlier stage (fit, then test), which this would wrap again.
            module.forward = compiler(type(module).forward.__get__(module))
        else:
            # The attribute nn.Module.compile sets; set here so that the context of a user's torch.compile applies too.
            target._compiled_call_impl = compiler(target._call_impl)  # type: ignore[assignment]
            _COMPILED_HERE[target] = target._compiled_call_impl
    return targets


def describe_targets(module: nn.Module, targets: list[nn.Module], unit: str, reason: str) -> str:
    """One line for the set-up log: what was compiled (by name), with which unit, and why that unit."""
    names = {id(child): name or type(module).__name__ for name, child in module.named_modules()}
    if len(targets) == 1:
        what = f"{names[id(targets[0])]} ({type(targets[0]).__name__})"
    else:
        what = f"{len(targets)} blocks ({names[id(targets[0])]} ... {names[id(targets[-1])]})"
    return f"torch.compile: unit {unit!r} ({reason}): compiling {what} in place."


@contextmanager
def running_eagerly() -> Iterator[None]:
    """Run every compiled module and function of the block eagerly, compiling nothing.

    For work before training (the sanity check): a first compilation there, under inference mode and with validation
    shapes, would make dynamo mark the training graph's sizes dynamic when the training batches differ in shape.
    """
    with torch.compiler.set_stance("force_eager"):
        yield


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
    "COMPILE_UNITS",
    "CompileUnit",
    "Compiler",
    "UNIT_KEY",
    "check_compile",
    "compile_in_place",
    "compile_targets",
    "compiler_for",
    "describe_targets",
    "model_unit",
    "refuse_compiled_in_place",
    "repeated_blocks",
    "running_eagerly",
    "split_unit",
    "unwrap_compiled",
]
