"""What the loops need to know about a strategy, declared as one frozen object (:class:`StrategyTraits`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Any

from phalanx.utilities.messages import shown

__all__ = ["TRAIT_NAMES", "StrategyTraits", "check_traits", "legacy_trait_overrides"]


@dataclass(frozen=True)
class StrategyTraits:
    """The loop-facing flags of a strategy; the defaults are those of a plain one-process strategy.

    A strategy declares its traits by overriding ``Strategy.declare_traits`` (``dataclasses.replace`` of the parent's);
    the drivers (the Trainer, the Cohort, callbacks, the conformance kit) read ``strategy.traits``.
    """

    #: The strategy accumulates gradients itself: the loop steps every batch (see ``block_backward_sync``).
    handles_gradient_accumulation: bool = False
    #: Checkpoint weights are loaded after ``setup`` (needed when setup shards the model or builds an engine).
    restore_checkpoint_after_setup: bool = False
    #: ``load_checkpoint`` restores the optimizer and scheduler states itself.
    restores_optimizer: bool = False
    #: ``setup`` wants ``RunSettings.train_batch_size`` (the driver reads it from the training data).
    needs_train_batch_size: bool = False
    #: All ranks must run as many evaluation batches (forward passes run collectives): drivers check before starting.
    requires_equal_batches: bool = False
    #: Evaluation data is padded so that every rank runs equally many forward passes (sharded models).
    pads_evaluation: bool = False
    #: Evaluation may run under inference mode (False: the module keeps tensors it makes there; ``no_grad`` instead).
    allows_inference_mode: bool = True
    #: ``setup`` needs the optimizers together with the module (one engine holds both, as DeepSpeed's).
    wraps_module_with_optimizers: bool = False
    #: Why the Cohort cannot drive this strategy (None: it can): the Cohort refuses it saying so, and the conformance
    #: kit reports its Cohort checks as not offered, with this reason.
    cohort_unsupported: str | None = None


#: The names of the flags (True or False), which were separate ``Strategy`` properties before ``Strategy.traits``;
#: ``cohort_unsupported`` is a reason (text or None), newer than those properties.
TRAIT_NAMES: tuple[str, ...] = tuple(field.name for field in fields(StrategyTraits) if field.type == "bool")


def legacy_trait_overrides(cls: type, base: type) -> tuple[str, ...]:
    """The trait names that ``cls`` (or a class between it and ``base``) still overrides as separate properties.

    Warns (DeprecationWarning) for each one ``cls`` itself defines: ``Strategy.traits`` keeps reading them for one
    release, after which only ``declare_traits`` counts.
    """
    for name in TRAIT_NAMES:
        if name in vars(cls):
            warnings.warn(
                f"{cls.__name__} overrides the Strategy property {name!r}: deprecated, ignored after this release."
                f" Override declare_traits() instead, returning replace(super().declare_traits(), {name}=...).",
                DeprecationWarning,
                stacklevel=4,  # this function, Strategy.__init_subclass__, ABCMeta.__new__, then the class statement
            )
    return tuple(name for name in TRAIT_NAMES if getattr(cls, name) is not getattr(base, name))


def _defined_in(cls: type, name: str) -> type:
    """The class of ``cls``'s MRO whose body defines ``name``."""
    return next(klass for klass in cls.__mro__ if name in vars(klass))


def check_traits(strategy: Any) -> None:
    """Refuse traits the loops could misread, once, when a driver takes ``strategy``; each error names the strategy.

    ``declare_traits()`` must return a StrategyTraits whose flags are True or False (a string such as "no" would count
    as True); a deprecated per-flag property must return True or False too, and must not contradict a
    ``declare_traits()`` written beside or below it (which of the two would count is then anybody's guess).
    """
    cls = type(strategy)
    declared = strategy.declare_traits()
    if not isinstance(declared, StrategyTraits):
        raise TypeError(
            f"{cls.__name__}.declare_traits() returned {shown(declared)} (of type {type(declared).__name__}); it must"
            f" return a StrategyTraits, e.g. dataclasses.replace(super().declare_traits(), pads_evaluation=True)."
        )
    for name in TRAIT_NAMES:
        value = getattr(declared, name)
        if not isinstance(value, bool):
            raise TypeError(
                f"{cls.__name__}.declare_traits() declares {name}={shown(value)}; a trait is True or False (a string"
                f" or a number would count as True or False by accident)."
            )
    if declared.cohort_unsupported is not None and not isinstance(declared.cohort_unsupported, str):
        raise TypeError(
            f"{cls.__name__}.declare_traits() declares cohort_unsupported={shown(declared.cohort_unsupported)}; it is"
            f" None (the Cohort can drive the strategy) or the reason it cannot, as text."
        )
    for name in strategy._legacy_traits:
        value = getattr(strategy, name)
        if not isinstance(value, bool):
            raise TypeError(
                f"{cls.__name__}.{name} (a deprecated trait property) returned {shown(value)}; a trait is True or"
                f" False. Declare it in declare_traits() instead."
            )
        if value != getattr(declared, name) and issubclass(_defined_in(cls, "declare_traits"), _defined_in(cls, name)):
            raise ValueError(
                f"{cls.__name__} declares {name}={getattr(declared, name)} in declare_traits(), but its deprecated"
                f" property {name} returns {value}. Remove the property and declare the value in declare_traits():"
                f" the property is ignored after this release."
            )
