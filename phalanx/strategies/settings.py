"""RunSettings: everything a strategy learns about the run it serves, given by whoever drives it (the Trainer or your
loop)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from torch import nn
from torch.optim import Optimizer

from phalanx.utilities.checks import is_number
from phalanx.utilities.compile import COMPILE_UNITS, Compiler, CompileUnit

STAGES = ("fit", "validate", "test", "predict")

#: Builds the optimizers and LR scheduler configurations for the set-up module (after any wrapping or sharding).
OptimizerFactory = Callable[[nn.Module], tuple[list[Optimizer], list[Any]]]
#: Called with each optimizer once its gradients are final and before it steps (hooks, gradient clipping).
BeforeOptimizerStep = Callable[[Optimizer], None]


@dataclass(frozen=True)
class RunSettings:
    """What a strategy needs to know about a run; strategies never read the object that drives them."""

    #: 'fit' wraps the module for training and builds optimizers; the other stages only place it for evaluation.
    stage: str = "fit"
    #: Micro-batches per optimizer step (strategies that accumulate themselves, like DeepSpeed, read it).
    accumulate_grad_batches: int = 1
    #: Gradient clipping that a strategy applying it itself (DeepSpeed) must configure; None: no clipping.
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"
    #: Samples per batch of the training data on one process, when known (DeepSpeed's micro-batch size).
    train_batch_size: int | None = None
    #: How the optimizers are made once the module is set up; None: no optimizers (evaluation, or set up later).
    configure_optimizers: OptimizerFactory | None = None
    #: What runs between the backward pass and the optimizer step (on_before_optimizer_step hooks, clipping).
    before_optimizer_step: BeforeOptimizerStep | None = None
    #: Compiles the module's repeated blocks (or the whole module) in ``Strategy.compile_module``; None: eager.
    compile: Compiler | None = None
    #: What ``compile`` compiles ("model" or "blocks", docs/compile.md); None: the strategy's ``default_compile_unit``.
    compile_unit: CompileUnit | None = None
    #: The optimizers are the caller's own objects (the Cohort's ``setup(module, optimizer)``), not made by a hook: a
    #: strategy whose configuration would build other optimizers refuses, rather than train without the ones given.
    optimizers_given: bool = False
    #: Where the training loop stands (its counters and data position), read once when a strategy hands it to a peer
    #: that (re)joins the run (``ddp_ft``); None: the driver has no such loop (the Cohort).
    loop_position: Callable[[], dict[str, int]] | None = None
    #: Moves the training loop to a position ``loop_position`` returned, before it reads its first batch.
    load_loop_position: Callable[[Mapping[str, int]], None] | None = None
    #: Inside an optimizer step, takes the counters of a peer's ``loop_position`` (same epoch, ahead); False: could not.
    catch_up_loop_position: Callable[[Mapping[str, int]], bool] | None = None
    #: The callbacks' states as a checkpoint stores them (its "callbacks" entry), read when a strategy hands them to a
    #: peer that (re)joins the run (``ddp_ft``); None: the driver has no callbacks (the Cohort).
    callback_states: Callable[[], dict[str, Any]] | None = None
    #: Loads states that ``callback_states`` returned into the callbacks (a rejoining group does, after the weights).
    load_callback_states: Callable[[Mapping[str, Any]], None] | None = None

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"RunSettings(stage={self.stage!r}) is not valid; choose one of {list(STAGES)}.")
        if (
            isinstance(self.accumulate_grad_batches, bool)
            or not isinstance(self.accumulate_grad_batches, int)
            or self.accumulate_grad_batches < 1
        ):
            raise ValueError(
                f"RunSettings(accumulate_grad_batches={self.accumulate_grad_batches!r}) must be an int >= 1."
            )
        clip = self.gradient_clip_val
        if clip is not None and (not is_number(clip) or not clip >= 0):
            raise ValueError(f"RunSettings(gradient_clip_val={clip!r}) must be a number >= 0 or None.")
        if self.gradient_clip_algorithm not in ("norm", "value"):
            raise ValueError(
                f"RunSettings(gradient_clip_algorithm={self.gradient_clip_algorithm!r}) is not valid; "
                f"choose 'norm' or 'value'."
            )
        if self.train_batch_size is not None and (
            isinstance(self.train_batch_size, bool)
            or not isinstance(self.train_batch_size, int)
            or self.train_batch_size < 1
        ):
            raise ValueError(f"RunSettings(train_batch_size={self.train_batch_size!r}) must be a positive int or None.")
        if self.compile_unit is not None and self.compile_unit not in COMPILE_UNITS:
            units = [*COMPILE_UNITS, None]
            raise ValueError(f"RunSettings(compile_unit={self.compile_unit!r}) is not valid; choose one of {units}.")
        callables = ("configure_optimizers", "before_optimizer_step", "compile", "loop_position", "callback_states")
        for name in (*callables, "load_loop_position", "catch_up_loop_position", "load_callback_states"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"RunSettings({name}={value!r}) must be a callable or None.")

    @property
    def fitting(self) -> bool:
        """Whether the module is set up for training."""
        return self.stage == "fit"


def check_run_settings(owner: str, settings: Any) -> None:
    """Refuse ``<owner>.setup(settings)`` unless ``settings`` is a RunSettings (strategies used to get the Trainer)."""
    if not isinstance(settings, RunSettings):
        raise TypeError(
            f"{owner}.setup(settings) takes a phalanx.strategies.RunSettings, got {type(settings).__name__}."
            " Strategies no longer receive the Trainer: read the run's settings from this argument."
        )
