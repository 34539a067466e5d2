"""What the loops need to know about a strategy, declared as one frozen object (:class:`StrategyTraits`)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields

__all__ = ["TRAIT_NAMES", "StrategyTraits", "legacy_trait_overrides"]


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


#: The names of the flags, which were separate ``Strategy`` properties before ``Strategy.traits``.
TRAIT_NAMES: tuple[str, ...] = tuple(field.name for field in fields(StrategyTraits))


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
