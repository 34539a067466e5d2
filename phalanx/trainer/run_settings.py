"""The one place where the Trainer tells its strategy about a run: the RunSettings it passes to ``Strategy.setup``."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from phalanx.optimization import init_optimizers_and_schedulers
from phalanx.strategies.settings import RunSettings
from phalanx.trainer.checkpoint import load_peer_callback_states, trainer_callback_states
from phalanx.trainer.loops.position import catch_up_loop_position, load_loop_position, loop_position
from phalanx.trainer.state import TrainerFn
from phalanx.utilities.compile import compiler_for, refuse_compiled_in_place, split_unit

if TYPE_CHECKING:
    from phalanx.trainer.loops.data import DataSource
    from phalanx.trainer.trainer import Trainer


def run_settings(trainer: Trainer, source: DataSource) -> RunSettings:
    """The settings of the run ``trainer`` is starting (its function, accumulation, clipping, optimizers, hooks)."""
    fitting = trainer.state.fn == TrainerFn.FITTING
    refuse_compiled_in_place(source.module, trainer.compile, "Trainer")
    return RunSettings(
        stage=str(trainer.state.fn),
        accumulate_grad_batches=trainer.accumulate_grad_batches,
        gradient_clip_val=trainer.gradient_clip_val,
        gradient_clip_algorithm=str(trainer.gradient_clip_algorithm or "norm"),
        # Building the training dataloader may be costly (or counted by the user): only for strategies that ask.
        train_batch_size=train_batch_size(source)
        if fitting and trainer.strategy.traits.needs_train_batch_size
        else None,
        configure_optimizers=init_optimizers_and_schedulers if fitting else None,
        before_optimizer_step=trainer._before_optimizer_step,
        # A model passed as torch.compile(model) was unwrapped by check_module, which kept its compile context.
        compile=compiler_for(trainer.compile, source.module.__dict__.get("_compiled_with"), "Trainer"),
        compile_unit=None if trainer.compile is None else split_unit(trainer.compile)[1],
        loop_position=partial(loop_position, trainer.fit_loop) if fitting else None,
        load_loop_position=partial(load_loop_position, trainer.fit_loop) if fitting else None,
        catch_up_loop_position=partial(catch_up_loop_position, trainer.fit_loop) if fitting else None,
        callback_states=partial(trainer_callback_states, trainer) if fitting else None,
        load_callback_states=partial(load_peer_callback_states, trainer) if fitting else None,
    )


def train_batch_size(source: DataSource) -> int | None:
    """The batch size of the first training dataloader, when it says (``batch_size`` or its batch sampler's)."""
    loaders = source.get("train")
    if not loaders:
        return None
    loader: Any = loaders[0]
    batch_size = getattr(loader, "batch_size", None) or getattr(
        getattr(loader, "batch_sampler", None), "batch_size", None
    )
    return batch_size if isinstance(batch_size, int) and not isinstance(batch_size, bool) and batch_size > 0 else None


__all__ = ["run_settings", "train_batch_size"]
