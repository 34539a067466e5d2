"""The fit loop: epochs of training batches, periodic validation, and the state needed to resume mid-epoch."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Callable

from torch import Tensor

from phalanx.strategies.strategy import Strategy
from phalanx.trainer.assignment import TrainerSetting
from phalanx.trainer.loops.data import iterate_from
from phalanx.trainer.loops.evaluation_loop import run_validation_during_fit
from phalanx.trainer.loops.fit_data import (
    epoch_cannot_train,
    epoch_end_validation_due,
    reload_train_data_if_due,
    val_check_due,
)
from phalanx.trainer.loops.nonfinite import NonFiniteLossCheck, SkippedBatch
from phalanx.trainer.loops.optimizer import call_step_hook, follow_scheduler_changes, step_schedulers
from phalanx.trainer.preemption import save_preempted
from phalanx.trainer.state import RunningStage
from phalanx.trainer.step_output import extract_loss
from phalanx.utilities.exceptions import CheckpointError
from phalanx.utilities.rank_zero import rank_zero_warn
from phalanx.utilities.seed import collect_rng_states, restore_rng_states

if TYPE_CHECKING:
    from phalanx.trainer.trainer import Trainer

# Where in an epoch a checkpoint was taken; decides what a resumed run still has to do.
_IN_BATCHES = "batches"  # inside the batch loop: skip `batches_done` batches and go on
_BATCH_END = "batch_end"  # in on_train_batch_end: skip the batches, then do that batch's validation check
_VALIDATED = "validated"  # batches and epoch-end validation done: step epoch schedulers, run on_train_epoch_end
_ENDED = "ended"  # on_train_epoch_end is running or ran: the next epoch starts fresh


class FitLoop:
    """Runs training epochs; keeps the progress counters that checkpoints save."""

    # Lightning's place for these (trainer.fit_loop.max_epochs = N): they are the Trainer's, checked when assigned.
    max_epochs, min_epochs, max_steps, min_steps = (TrainerSetting() for _ in range(4))

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.current_epoch = 0
        self.global_step = 0
        self.batches_done = 0  # in the current epoch
        self.total_batches = 0  # over all epochs
        # Lightning's `_batches_that_stepped`: batches after which the optimizer stepped, counted once the batch and the
        # validation it triggers are done. The loggers' step, and what log_every_n_steps counts.
        self.batches_stepped = 0
        self._step_pending = False  # the current batch stepped and is not counted in batches_stepped yet
        self.phase = _IN_BATCHES
        self._epoch_open = False  # on_train_epoch_start ran and on_train_epoch_end did not: a resume does not call it
        self.num_batches: int | float = 0
        self._epoch_start_rng: dict[str, Any] | None = None
        self._restored: dict[str, Any] | None = None
        self._last_validated_at = -1
        self._last_loss: Tensor | None = None
        self._accumulated = 0  # backward passes since the last optimizer step
        self._skip_window = False  # a non-finite loss was seen in this accumulation window ('skip'): no step at its end
        self._forward_only = False  # this epoch runs training_step only (skip_backward)
        self._warned_early_stop = False
        self.nonfinite = NonFiniteLossCheck(trainer, 0)
        # The module's overridden hooks, set by run(); None means the loop does the default itself.
        self._step_hook: Callable[..., Any] | None = None
        self._module_attrs: dict[str, Any] = {}  # the module's __dict__, where each step sets _current_fx
        self._zero_grad_hook: Callable[..., Any] | None = None
        self._step_handle: Any = None
        self._release_grads: Callable[[], Any] | None = None
        self._single_process = True  # world size 1: a preemption needs no agreement, only the flag (set by run())
        # The batch being trained on, its index and what training_step returned: _forward_backward's (the closure's).
        self._batch, self._batch_idx, self._output = None, 0, None

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, Any]:
        """Progress counters and the generator states captured when the current epoch's data iterator was made."""
        return {
            "epoch": self.current_epoch,
            "global_step": self.global_step,
            "batches_done": self.batches_done,
            "total_batches": self.total_batches,
            # A resume from on_train_batch_end counts that batch when it finishes it; any later one goes on past it.
            "batches_stepped": self.batches_stepped + (self._step_pending and self.phase != _BATCH_END),
            "step_pending": self._step_pending and self.phase == _BATCH_END,
            "phase": self.phase,
            "epoch_open": self._epoch_open,
            "epoch_start_rng": self._epoch_start_rng,
            # A resumed run may still have to step a ReduceLROnPlateau or run EarlyStopping on these.
            "callback_metrics": {name: value.detach().cpu() for name, value in self.trainer.callback_metrics.items()},
        }

    def load_state_dict(self, state: dict[str, Any], rng_states: dict[str, Any] | None = None) -> None:
        """Restore counters now; generator states are restored when the loop reaches the saved position."""
        self.current_epoch = int(state["epoch"])
        self.global_step = int(state["global_step"])
        self.batches_done = int(state["batches_done"])
        self.total_batches = int(state.get("total_batches", 0))
        self.batches_stepped = int(state.get("batches_stepped", self.global_step))
        self._step_pending = bool(state.get("step_pending", False))
        self.phase = state.get("phase", _IN_BATCHES)
        self._epoch_open = bool(state.get("epoch_open", True))
        self._epoch_start_rng = state.get("epoch_start_rng")
        self._restored = {"rng": rng_states, "callback_metrics": dict(state.get("callback_metrics") or {})}

    @property
    def resuming_inside_epoch(self) -> bool:
        """Whether the restored checkpoint was taken inside an epoch (Lightning then skips the sanity check)."""
        return self._restored is not None and self._epoch_open and self.batches_done > 0

    # ------------------------------------------------------------------ running
    def run(self) -> None:
        """Train until max_epochs, max_steps or a stop request (a Timer's for max_time, EarlyStopping's, ...)."""
        trainer = self.trainer
        hooks = trainer._hooks
        self._before_backward_hooks = hooks["on_before_backward"]
        self._after_backward_hooks = hooks["on_after_backward"]
        self._before_zero_grad_hooks = hooks["on_before_zero_grad"]
        self._prepare_module_hooks()
        self._module_attrs = trainer.strategy.module.__dict__  # once per fit rather than a property call per step
        self._single_process = trainer.strategy.world_size == 1
        restored, self._restored = self._restored, None
        self.nonfinite = NonFiniteLossCheck(trainer, self.global_step)
        self._warned_early_stop = False  # _forward_only stays: on_train_start may have set it (a resume inside it)
        if trainer.num_training_batches == 0:
            return  # prepare_fit_data warned, naming the cause; an epoch without batches would never reach max_steps
        if restored is None and self.phase == _IN_BATCHES and 0 < self.batches_done < trainer.num_training_batches:
            # An earlier fit on this Trainer stopped inside this epoch: go on at its next batch, as a resume would.
            restored = {"rng": collect_rng_states(), "callback_metrics": {}}
        if restored is not None:
            trainer._metrics.callback.update(restored["callback_metrics"])
        if restored is not None and self.phase in (_VALIDATED, _ENDED):
            if restored["rng"] is not None:
                restore_rng_states(restored["rng"])
            if self.phase == _VALIDATED:
                self._finish_epoch()
            else:
                self._advance_epoch()
            restored = None
        while not self._done():
            self._run_epoch(restored)
            restored = None
        self._forward_only = False  # a later fit on this Trainer stopped inside the epoch trains it normally
        self.nonfinite.report()

    def _prepare_module_hooks(self) -> None:
        # Overridden module hooks only (None otherwise): the step pays nothing for the hooks a module leaves alone.
        hooks = self.trainer._hooks
        self._step_hook = next(iter(hooks["optimizer_step"]), None)
        self._zero_grad_hook = next(iter(hooks["optimizer_zero_grad"]), None)
        self._step_handle = next(iter(self.trainer._run.manual_optimizers), None)
        self._release_grads = next(iter(hooks["on_validation_model_zero_grad"]), None)
        module = self.trainer.strategy.module
        if self._release_grads is None and self._zero_grad_hook is not None and module is not None:
            # The loop's own zero_grad(set_to_none=True) is what makes the default redundant; here it was replaced.
            self._release_grads = module.on_validation_model_zero_grad

    def skip_backward(self) -> None:
        """Run the rest of this epoch forward only: ``training_step`` without backward or optimizer step; its end
        counts one step and steps the epoch-interval LR schedulers, as in the epoch in which Lightning's SWA
        recomputes batch-norm statistics."""
        self._forward_only = self._skip_window = True

    def _done(self) -> bool:
        trainer = self.trainer
        if trainer._run.stop_now or (trainer.max_steps != -1 and self.global_step >= trainer.max_steps):
            return True
        if trainer.max_epochs is not None and trainer.max_epochs != -1 and self.current_epoch >= trainer.max_epochs:
            return True
        return self._stop_allowed()

    def _run_epoch(self, restored: dict[str, Any] | None) -> None:
        trainer = self.trainer
        reload_train_data_if_due(trainer)
        dataloader = trainer._run.train_dataloader
        self.num_batches = trainer.num_training_batches
        trainer.state.stage = RunningStage.TRAINING
        trainer._train_results.reset()
        for candidate in (getattr(dataloader, "sampler", None), getattr(dataloader, "batch_sampler", None)):
            set_epoch = getattr(candidate, "set_epoch", None)
            if set_epoch is not None:
                set_epoch(self.current_epoch)
        if restored is None or not self.batches_done or not self._epoch_open:  # as Lightning, not again mid-epoch
            self._call_epoch_hook("on_train_epoch_start")
        iterator, skip = self._epoch_iterator(dataloader, restored)
        # A checkpoint saved in on_train_batch_end resumes with that batch's validation and stop checks.
        stop = self._after_batch() if skip and self.phase == _BATCH_END else False
        exhausted, skipped_by_hook = (False, False) if stop else self._run_batches(iterator)
        self._end_epoch(exhausted, skipped_by_hook)

    def _epoch_iterator(self, dataloader: Any, restored: dict[str, Any] | None) -> tuple[Iterator[Any], int]:
        """The epoch's batch iterator, past the batches a resumed epoch already trained on; and their number."""
        skip = 0
        if restored is not None and self.batches_done > 0:
            # Recreate the epoch's iterator from the generator states it was made with, pass the batches already
            # trained on, then continue from the generator states at the moment of the checkpoint.
            skip = self.batches_done
            if self._epoch_start_rng is not None:
                restore_rng_states(self._epoch_start_rng)
        else:
            if restored is not None and restored["rng"] is not None:
                restore_rng_states(restored["rng"])
            self.batches_done = 0
            self._epoch_start_rng = collect_rng_states()
        if skip > self.num_batches:
            raise CheckpointError(
                f"The checkpoint resumes after batch {skip} of epoch {self.current_epoch}, but the training data has"
                f" only {self.num_batches} batches per epoch now; resume with the data (and limit_train_batches) it"
                " was saved with."
            )
        iterator = iterate_from(dataloader, skip)
        if skip and restored is not None and restored["rng"] is not None:
            restore_rng_states(restored["rng"])
        return iterator, skip

    def _run_batches(self, iterator: Iterator[Any]) -> tuple[bool, bool]:
        """Train on the epoch's batches until its end or a stop; return (the data ran out or on_train_batch_start
        ended the epoch, it was on_train_batch_start)."""
        # The step's collaborators, looked up once per epoch rather than once per batch.
        trainer = self.trainer
        strategy = trainer.strategy
        hooks = trainer._hooks
        batch_start_hooks = hooks["on_train_batch_start"]
        batch_end_hooks = hooks["on_train_batch_end"]
        results = trainer._train_results
        metrics = trainer._metrics
        num_batches = self.num_batches
        run_batch = self._automatic_batch if strategy.module.automatic_optimization else self._manual_batch
        strategy_batch_start = strategy.on_train_batch_start  # None where it is the base's empty one: no call per batch
        if getattr(strategy_batch_start, "__func__", None) is Strategy.on_train_batch_start:
            strategy_batch_start = None
        move_batch = hooks.move_train_batch
        loggers = trainer.loggers
        stop = False
        while not stop and self.batches_done < num_batches:
            try:
                batch = next(iterator)
            except StopIteration:
                return True, False
            batch_idx = self.batches_done
            batch = move_batch(batch)
            results.new_batch(batch)
            skip_rest = bool(batch_start_hooks) and any([hook(batch, batch_idx) == -1 for hook in batch_start_hooks])
            if strategy_batch_start is not None:
                strategy_batch_start(batch, batch_idx)  # after the module and callbacks, as in Lightning
            if skip_rest:
                return True, True
            output = run_batch(batch, batch_idx)
            self.batches_done += 1
            self.total_batches += 1
            if results.step_updated:
                metrics.publish_step(results)
            self.phase = _BATCH_END
            # A checkpoint in on_train_batch_end keeps _step_pending; no_window: no call needed to tell.
            no_window = trainer.accumulate_grad_batches == 1 and not self._forward_only
            self._step_pending = stepped = no_window or not self._accumulating()
            for hook in batch_end_hooks:
                hook(output, batch, batch_idx)
            # As in Lightning: every log_every_n_steps optimizer steps (not batches), or when a stop is requested. Read
            # at every step, as Lightning does, so that a callback's assignment counts at once (0: barebones).
            log_every = trainer.log_every_n_steps
            if log_every and stepped and ((self.batches_stepped + 1) % log_every == 0 or trainer._run.should_stop):
                if loggers:
                    metrics.log_step()
                self.nonfinite.report()
            stop = self._after_batch()
        return False, False

    def _end_epoch(self, exhausted: bool, skipped_by_hook: bool) -> None:
        """After the batch loop: step on what is accumulated, then end the epoch (or leave it open if stopped in it)."""
        trainer = self.trainer
        if self._accumulated and trainer.strategy.module.automatic_optimization:
            self._flush_accumulated()
            self._step_pending = True
        self._skip_window = False
        if exhausted and self.batches_done == 0 and epoch_cannot_train(trainer, skipped_by_hook):
            trainer._run.stop_now = True
            stopped_inside_epoch = True
        else:
            stopped_inside_epoch = not exhausted and self.batches_done < self.num_batches
        if stopped_inside_epoch:
            # Stopped inside the epoch (max_steps, a stop request, max_time's Timer): callbacks see the epoch end, but
            # the progress stays mid-epoch so that a resumed run continues at the next batch.
            self._count_stepped()
            trainer._metrics.publish_epoch(trainer._train_results)
            self._call_epoch_hook("on_train_epoch_end")
            if trainer.loggers:
                trainer._metrics.log_epoch(trainer._train_results, training=True)
            return
        self.phase = _VALIDATED
        trainer._metrics.publish_epoch(trainer._train_results)
        if epoch_end_validation_due(trainer, self):
            self._validate(window_done=True)
        self._count_stepped()  # after the epoch's validation, which Lightning runs within its last batch
        self._finish_epoch()

    def _finish_epoch(self) -> None:
        trainer = self.trainer
        step_schedulers(trainer, "epoch")
        self.phase = _ENDED
        self._call_epoch_hook("on_train_epoch_end")
        trainer._metrics.publish_epoch(trainer._train_results)
        if trainer.loggers:
            trainer._metrics.log_epoch(trainer._train_results, training=True)
        self.nonfinite.report()
        self._advance_epoch()

    def _call_epoch_hook(self, name: str) -> None:
        # What callbacks log there is keyed and defaulted by this hook's name, as in Lightning.
        self.trainer.strategy.module.__dict__["_current_fx"] = name
        self._epoch_open = name == "on_train_epoch_start"
        self.trainer._hooks.call(name)
        follow_scheduler_changes(self.trainer)  # a callback may swap a scheduler there, as Lightning's SWA does

    def _accumulating(self) -> bool:
        """Lightning's ``_should_accumulate``, after a batch: its window goes on (no optimizer step counted)."""
        accumulate = self.trainer.accumulate_grad_batches
        if accumulate == 1 or self.batches_done % accumulate == 0 or self._forward_only:
            # A forward-only epoch counts one (gradient-free) step at its end, as Lightning's SWA epoch does.
            return self._forward_only and self.batches_done < self.num_batches
        return self.trainer.strategy.traits.handles_gradient_accumulation or self.batches_done < self.num_batches

    def _count_stepped(self) -> None:
        if self._step_pending:
            self.batches_stepped += 1
            self._step_pending = False

    def _advance_epoch(self) -> None:
        self.current_epoch += 1
        self.batches_done = 0
        self.phase = _IN_BATCHES
        self._epoch_start_rng, self._forward_only = None, False

    def _after_batch(self) -> bool:
        """The validation check and stop check that follow each batch; True when training must stop."""
        trainer, run = self.trainer, self.trainer._run
        due = run.val_every_batches is not None and val_check_due(trainer, self, self.batches_done >= self.num_batches)
        # From here a checkpoint (e.g. one saved when this validation ends) resumes at the next batch.
        self.phase = _IN_BATCHES
        if due:
            accumulate = trainer.accumulate_grad_batches
            self._validate(
                window_done=accumulate == 1
                or self.batches_done % accumulate == 0
                or self.batches_done >= self.num_batches
            )
        if self._step_pending and self.batches_done < self.num_batches:  # the epoch's last: after its validation
            self.batches_stepped, self._step_pending = self.batches_stepped + 1, False  # _count_stepped, inline
        preemption = trainer.preemption
        # One process without a signal: requested() would only read that flag (no agreement to take part in).
        asked = preemption is not None and (preemption.received is not None or not self._single_process)
        if preempted := asked and preemption.requested(trainer, self.total_batches):
            save_preempted(trainer, preemption)
        # Inline, run.should_stop not trainer's (a descriptor): every batch. stop_now: nonfinite_loss='stop'.
        at_max_steps = trainer.max_steps != -1 and self.global_step >= trainer.max_steps
        if preempted or run.stop_now or at_max_steps or (run.should_stop and self._stop_allowed()):
            run.stop_now = True
            return True
        return False

    def _stop_allowed(self) -> bool:
        """Whether ``trainer.should_stop`` may end training: not before ``min_epochs`` and ``min_steps`` are reached."""
        trainer = self.trainer
        if not trainer.should_stop:
            return False
        if self.current_epoch >= trainer.min_epochs and self.global_step >= trainer.min_steps:
            return True
        if not self._warned_early_stop:
            self._warned_early_stop = True
            rank_zero_warn(
                f"trainer.should_stop was set at epoch {self.current_epoch}, step {self.global_step}, "
                f"but training continues until min_epochs={trainer.min_epochs} and "
                f"min_steps={trainer.min_steps} are reached."
            )
        return False

    def _validate(self, window_done: bool) -> None:
        trainer = self.trainer
        self._last_validated_at = self.total_batches
        if self._release_grads is not None and window_done:
            # As in Lightning: never in the middle of an accumulation window, whose gradients are still needed.
            self._release_grads()
        run_validation_during_fit(trainer)
        trainer.state.stage = RunningStage.TRAINING

    # ------------------------------------------------------------------ one batch
    def _forward_backward(self) -> Tensor | None:
        """Forward and backward on ``self._batch`` (set by the caller); the optimizer's closure: returns the loss and
        keeps training_step's output in ``self._output``."""
        trainer = self.trainer
        # nn.Module.__setattr__ costs microseconds per call; this plain attribute needs none of its checks.
        self._module_attrs["_current_fx"] = "training_step"
        loss, self._output = trainer.strategy.forward_backward(
            self._batch, self._batch_idx, self._loss_to_backpropagate, trainer._run.optimizer
        )
        if loss is None:
            return None
        for hook in self._after_backward_hooks:
            hook()
        self._last_loss = loss = self.nonfinite.detach(loss)  # reuses the non-finite record's detach of this loss
        self._accumulated += 1
        return loss

    def _loss_to_backpropagate(self, output: Any) -> Tensor | None:
        if self._skip_window:
            raise SkippedBatch(output)  # the rest of a window with a non-finite loss ('skip'), or skip_backward
        # A valid scalar loss is taken as is (no call); anything else goes through extract_loss, which refuses it.
        loss = output if isinstance(output, Tensor) and output.requires_grad and output.numel() == 1 else None
        if loss is None and (loss := extract_loss(output)) is None:
            return None
        if self.trainer._run.loss_divisor != 1:
            loss = loss / self.trainer._run.loss_divisor
        nonfinite = self.nonfinite
        if not nonfinite.checks_every_step:
            nonfinite.record(loss)
        elif not nonfinite.all_finite(loss):
            nonfinite.act(loss, self._batch_idx)
            raise SkippedBatch(output)
        for hook in self._before_backward_hooks:
            hook(loss)
        return loss

    def _automatic_batch(self, batch: Any, batch_idx: int) -> Any:
        self._batch, self._batch_idx = batch, batch_idx  # for the closure, and _loss_to_backpropagate's report
        try:
            if self.trainer.accumulate_grad_batches != 1:
                return self._forward_backward_step()
            # Every batch steps (read per batch: a callback may change accumulate_grad_batches at any time). A
            # quorum that declines the step (no weight changed) gets the batch again, so that a committed step trains
            # it once.
            while not self._optimizer_step(self._forward_backward, batch_idx):
                pass
            output, self._output, self._batch = self._output, None, None  # _take_output, inline: every batch
            return output
        except SkippedBatch as skipped:
            self._take_output()
            if self._forward_only and self.batches_done + 1 == self.num_batches:
                # Lightning's SWA epoch ends with an optimizer step without gradients: it changes no weight, but counts.
                self.global_step += 1
            self._drop_window(ends_window=self._ends_window())
            return skipped.output

    def _closes_window(self) -> bool:
        """Whether this batch ends its accumulation window (every ``accumulate_grad_batches``-th, or last)."""
        accumulate = self.trainer.accumulate_grad_batches
        if accumulate == 1:
            return True
        done = self.batches_done + 1
        return done % accumulate == 0 or done == self.num_batches

    def _ends_window(self) -> bool:
        """Whether the optimizer steps after this batch (every batch with a strategy that accumulates itself)."""
        return self._closes_window() or self.trainer.strategy.traits.handles_gradient_accumulation

    def _forward_backward_step(self) -> Any:
        """A batch of an accumulation window (``accumulate_grad_batches`` > 1): backward only, or the window's step."""
        if not self._closes_window():
            strategy = self.trainer.strategy
            with strategy.block_backward_sync():
                if strategy.traits.handles_gradient_accumulation:
                    # The strategy (DeepSpeed) steps every batch and learns from this context that the window goes on.
                    self._optimizer_step(self._forward_backward, self._batch_idx)
                else:
                    self._forward_backward()
                return self._take_output()
        self._optimizer_step(self._forward_backward, self._batch_idx)
        return self._take_output()

    def _take_output(self) -> Any:
        # The loop holds no output (nor its graph) past the batch.
        output, self._output, self._batch = self._output, None, None
        return output

    def _drop_window(self, ends_window: bool) -> None:
        # A non-finite loss: the gradients of its accumulation window are dropped and no optimizer step is taken
        # (global_step does not count it); the rest of the window runs forward only.
        self.trainer._run.optimizer.zero_grad(set_to_none=True)
        self._accumulated = 0
        self._skip_window = self._forward_only or (not ends_window and not self.trainer._run.stop_now)

    def _flush_accumulated(self) -> None:
        # An iterable without a length ended inside an accumulation window: step on what was accumulated.
        last_loss = self._last_loss
        self._optimizer_step(lambda: last_loss, self.batches_done - 1)

    def _optimizer_step(self, closure: Any, batch_idx: int) -> bool:
        trainer = self.trainer
        strategy = trainer.strategy
        optimizer = trainer._run.optimizer
        step_hook = self._step_hook
        if step_hook is None:
            strategy.optimizer_step(optimizer, closure, strategy.module)
        else:
            call_step_hook(step_hook, self._step_handle, closure, self.current_epoch, batch_idx, strategy.module)
        for hook in self._before_zero_grad_hooks:
            hook(optimizer)
        if self._zero_grad_hook is None:
            optimizer.zero_grad(set_to_none=True)
        else:
            self._zero_grad_hook(self.current_epoch, batch_idx, optimizer)
        self._accumulated = 0
        if committed := strategy.last_step_committed:  # False: a fault-tolerance quorum declined it, no count
            self.global_step += 1
            if trainer._run.step_scheduler_configs:
                step_schedulers(trainer, "step")
        return committed

    def _manual_batch(self, batch: Any, batch_idx: int) -> Any:
        module = self.trainer.strategy.module
        module.__dict__["_current_fx"] = "training_step"
        output = self.trainer.strategy.training_step(batch, batch_idx)
        # training_step has stepped the optimizers already: the loss it returns can only be reported ('warn'),
        # stop training after this batch ('stop') or raise ('raise').
        loss = output if isinstance(output, Tensor) else output.get("loss") if isinstance(output, Mapping) else None
        if isinstance(loss, Tensor):
            nonfinite = self.nonfinite
            if not nonfinite.checks_every_step:
                nonfinite.record(loss.detach())
            elif not nonfinite.all_finite(loss.detach()):
                nonfinite.act(loss.detach(), batch_idx)
        return output
