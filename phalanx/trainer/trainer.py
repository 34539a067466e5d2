"""The Trainer: runs fit, validate, test and predict for a TrainingModule through a Strategy.

The constructor resolves its arguments (:mod:`phalanx.trainer.arguments`) and builds the strategy
(:mod:`phalanx.strategies.resolve`); each entry point checks what it was given and runs its stage
(:mod:`phalanx.trainer.stages`: set-up, the fit loop or an evaluation loop, teardown). What ``self.log`` produced is
published through :mod:`phalanx.trainer.logging.metrics`.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Sequence

from torch import Tensor

from phalanx.accelerators.accelerator import Accelerator
from phalanx.callbacks import EarlyStopping, ModelCheckpoint, ProgressBar
from phalanx.callbacks.callback import Callback
from phalanx.datamodule import DataModule
from phalanx.module import TrainingModule
from phalanx.profilers import Profiler
from phalanx.strategies.migration import refuse_trainer_parameters
from phalanx.strategies.properties import DeviceProperties
from phalanx.strategies.resolve import resolve_strategy
from phalanx.strategies.strategy import Strategy
from phalanx.trainer import arguments
from phalanx.trainer.argument_checks import RENAMED_TRAINER_ATTRIBUTES
from phalanx.trainer.arguments import STRATEGY_ARGUMENTS, apply_process_switches, resolve_arguments
from phalanx.trainer.assignment import checked_assignment, refuse_deletion
from phalanx.trainer.checkpoint import CheckpointConnector
from phalanx.trainer.chosen_checkpoint import ChosenCheckpoint, chosen_ckpt_path
from phalanx.trainer.hooks import HookTable
from phalanx.trainer.logging.barebones import BarebonesResults
from phalanx.trainer.logging.metrics import LoggedMetrics
from phalanx.trainer.logging.results import LoggedResults
from phalanx.trainer.loops.data import DataSource, prepare_dataloader
from phalanx.trainer.loops.fit_data import estimated_stepping_batches
from phalanx.trainer.loops.fit_loop import FitLoop
from phalanx.trainer.loops.nonfinite import check_nonfinite_mode
from phalanx.trainer.loops.optimizer import AccumulationSetting
from phalanx.trainer.preemption import PREEMPTED_EXIT_CODE, Preemption
from phalanx.trainer.stages import (
    check_datamodule,
    check_module,
    module_for_evaluation,
    run_evaluate,
    run_fit,
    run_predict,
    start,
)
from phalanx.trainer.state import RunField, RunningStage, RunState, TrainerFn, TrainerState, TrainerStatus
from phalanx.trainer.step_output import check_manual_backward_loss


class Trainer(DeviceProperties):
    """Trains, evaluates and predicts with a TrainingModule; ``strategy=`` decides how the work is distributed.

    The arguments mean what they mean in Lightning's Trainer; each is checked here, and a bad value raises a
    TypeError or ValueError naming the argument, the value and the valid choices (``logger=None`` is the default
    logger, as in Lightning; ``overfit_batches`` and ``reload_dataloaders_every_n_epochs``: see
    :mod:`phalanx.trainer.loops.fit_data`; ``barebones``: see :mod:`phalanx.trainer.logging.barebones`;
    ``profiler``: "simple", "advanced", "pytorch" or a :class:`~phalanx.profilers.Profiler`, see
    :mod:`phalanx.trainer.profiling`; ``trainer.profiler`` is a PassThroughProfiler when none is given).
    Beyond Lightning:

    Args:
        preemption: True (default) saves a checkpoint and stops on SIGTERM/SIGUSR1-like signals (see
            :class:`~phalanx.trainer.preemption.Preemption`); False leaves signals alone.
        detect_anomaly: Run fit, validate, test and predict under ``torch.autograd.detect_anomaly()``: a backward
            that produces NaN raises, naming the forward operation at fault. Slow; for debugging.
        nonfinite_loss: What ``fit`` does when a training loss is NaN or infinite:

            - ``"warn"`` (default): a warning, once per fit, naming the range of global steps. The check is kept on
              the device and read only where the loop reads values anyway (every ``log_every_n_steps`` optimizer
              steps, epoch ends, checkpoint saves), so it adds no host-device synchronisation; the update is applied.
            - ``"skip"``: the batch does not update the weights: its gradients (and those of the rest of its
              gradient accumulation window) are dropped, no optimizer step is taken and ``global_step`` does not
              count it. Needs automatic optimization; refused with strategies that accumulate gradients themselves
              (DeepSpeed).
            - ``"stop"``: that batch is not applied and training stops after it (``trainer.should_stop``), ending
              cleanly like any stop: ``global_step`` is the number of finite steps taken.
            - ``"raise"``: a FloatingPointError naming the global step, epoch and batch_idx.
            - ``"ignore"``: no check at all.

            ``"skip"``, ``"stop"`` and ``"raise"`` read every loss on the host, i.e. synchronise every step, and
            with several processes agree through ``strategy.reduce_boolean_decision`` (one all-reduce per step), so
            that every rank takes the same decision. With manual optimization, the loss ``training_step`` returns is
            checked after the step it ran ("skip" is refused there).
    """

    def __init__(
        self,
        *,
        accelerator: str | Accelerator = "auto",
        strategy: str | Strategy = "auto",
        devices: arguments.DevicesInput = "auto",
        num_nodes: int = 1,
        precision: int | str | None = "32-true",
        plugins: arguments.PluginInput | Sequence[arguments.PluginInput] | None = None,
        callbacks: Callback | list[Callback] | None = None,
        logger: arguments.LoggerInput = None,
        max_epochs: int | None = None,
        min_epochs: int | None = None,
        max_steps: int = -1,
        min_steps: int | None = None,
        max_time: str | timedelta | dict[str, int] | None = None,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        limit_test_batches: int | float | None = None,
        limit_predict_batches: int | float | None = None,
        overfit_batches: int | float = 0.0,
        val_check_interval: int | float | None = None,
        check_val_every_n_epoch: int | None = 1,
        num_sanity_val_steps: int | None = None,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: int | float | None = None,
        gradient_clip_algorithm: str | None = None,
        deterministic: bool | str | None = None,
        default_root_dir: str | os.PathLike | None = None,
        enable_progress_bar: bool | None = None,
        enable_checkpointing: bool | None = None,
        enable_model_summary: bool | None = None,
        log_every_n_steps: int | None = None,
        fast_dev_run: bool | int = False,
        sync_batchnorm: bool = False,
        use_distributed_sampler: bool = True,
        benchmark: bool | None = None,
        inference_mode: bool = True,
        barebones: bool = False,
        reload_dataloaders_every_n_epochs: int = 0,
        preemption: Preemption | bool = True,
        detect_anomaly: bool = False,
        nonfinite_loss: str = "warn",
        profiler: Profiler | str | None = None,
        model_registry: str | None = None,
        compile: bool | dict[str, Any] | None = None,  # see docs/compile.md
    ) -> None:
        # Every argument by name, for their resolution in one place (phalanx.trainer.arguments).
        given = dict(locals())
        del given["self"]
        settings = resolve_arguments(given)
        self.strategy: Strategy = resolve_strategy(**{name: given[name] for name in STRATEGY_ARGUMENTS})
        refuse_trainer_parameters(self.strategy)  # written for the old contract, it would fail only once fit starts
        self.precision = self.strategy.precision_plugin.precision
        # trainer.max_epochs, trainer.limit_val_batches, trainer.loggers, ...: one attribute per resolved setting.
        for name, value in settings.trainer_attributes().items():
            setattr(self, name, value)
        self.state = TrainerState()
        self._run = RunState()  # what the stages fill in: everything per run is declared there
        self.fit_loop = FitLoop(self)
        self._checkpoint_connector = CheckpointConnector(self)
        self._hooks = HookTable()
        self._metrics = LoggedMetrics(self)
        results = BarebonesResults if self.barebones else LoggedResults
        self._train_results = results(self.strategy)
        self._eval_results = results(self.strategy, training=False)
        # Process-wide switches last: a Trainer refused for a bad argument leaves them untouched.
        apply_process_switches(deterministic=self.deterministic, benchmark=benchmark)

    # ------------------------------------------------------------------ public entry points
    def fit(
        self,
        model: TrainingModule,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: DataModule | None = None,
        ckpt_path: Any = None,
    ) -> None:
        """Train ``model``; resume from ``ckpt_path`` ('last', 'best' or a path) if given."""
        module = check_module(model, "fit")
        if isinstance(train_dataloaders, DataModule):
            datamodule, train_dataloaders = train_dataloaders, None
        if datamodule is not None and (train_dataloaders is not None or val_dataloaders is not None):
            raise ValueError("Pass either dataloaders or a datamodule to fit(), not both.")
        check_datamodule(datamodule)
        check_nonfinite_mode(self, module.automatic_optimization)
        source = DataSource(module, datamodule, train=train_dataloaders, validate=val_dataloaders)
        ckpt_path = chosen_ckpt_path(self, ckpt_path, "fit")
        self._run.preempted = False
        self._run.train_dataloader = None  # built anew for this fit (estimated_stepping_batches may build it early)
        start(self, TrainerFn.FITTING, run_fit, module, source, ckpt_path)
        if self.preempted and self.preemption is not None and self.preemption.exit:
            raise SystemExit(PREEMPTED_EXIT_CODE)

    def validate(
        self,
        model: TrainingModule | None = None,
        dataloaders: Any = None,
        ckpt_path: Any = None,
        verbose: bool = True,
        datamodule: DataModule | None = None,
    ) -> list[dict[str, float]]:
        """Run one validation epoch; return one dict of the logged epoch metrics per dataloader."""
        return self._evaluate(TrainerFn.VALIDATING, model, dataloaders, ckpt_path, verbose, datamodule)

    def test(
        self,
        model: TrainingModule | None = None,
        dataloaders: Any = None,
        ckpt_path: Any = None,
        verbose: bool = True,
        datamodule: DataModule | None = None,
    ) -> list[dict[str, float]]:
        """Run one test epoch; return one dict of the logged epoch metrics per dataloader."""
        return self._evaluate(TrainerFn.TESTING, model, dataloaders, ckpt_path, verbose, datamodule)

    def _evaluate(
        self, fn: TrainerFn, model: Any, dataloaders: Any, ckpt_path: Any, verbose: bool, datamodule: Any
    ) -> list[dict[str, float]]:
        method = "validate" if fn == TrainerFn.VALIDATING else "test"
        module, ckpt_path = module_for_evaluation(self, model, ckpt_path, method)
        if isinstance(dataloaders, DataModule):
            datamodule, dataloaders = dataloaders, None
        if datamodule is not None and dataloaders is not None:
            raise ValueError(f"Pass either dataloaders or a datamodule to {method}(), not both.")
        check_datamodule(datamodule)
        source = DataSource(module, datamodule, **{method: dataloaders})
        return start(self, fn, run_evaluate, module, source, ckpt_path, verbose)

    def predict(
        self,
        model: TrainingModule | None = None,
        dataloaders: Any = None,
        datamodule: DataModule | None = None,
        return_predictions: bool | None = None,
        ckpt_path: Any = None,
    ) -> list[Any] | None:
        """Run ``predict_step`` over the data; return the outputs per batch (a list per dataloader if several)."""
        module, ckpt_path = module_for_evaluation(self, model, ckpt_path, "predict")
        if isinstance(dataloaders, DataModule):
            datamodule, dataloaders = dataloaders, None
        if datamodule is not None and dataloaders is not None:
            raise ValueError("Pass either dataloaders or a datamodule to predict(), not both.")
        check_datamodule(datamodule)
        source = DataSource(module, datamodule, predict=dataloaders)
        keep = True if return_predictions is None else return_predictions
        return start(self, TrainerFn.PREDICTING, run_predict, module, source, ckpt_path, keep)

    def save_checkpoint(
        self, filepath: str | os.PathLike, weights_only: bool = False, storage_options: Any | None = None
    ) -> None:
        """Write a checkpoint of the current state (every process must call this).

        Outside a running stage (after ``fit``, say) the write is finished before this returns, also under
        ``AsyncCheckpointIO``: no stage's teardown would wait for it, and a failed write must raise here.
        """
        if self.strategy.module is None:
            raise RuntimeError("Trainer.save_checkpoint needs a model: call fit, validate, test or predict first.")
        checkpoint = self._checkpoint_connector.dump(weights_only=weights_only)
        self.strategy.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if self.state.status != TrainerStatus.RUNNING:
            self.strategy.checkpoint_io.teardown()  # waits for a background write and raises its error
        self.strategy.barrier("Trainer.save_checkpoint")

    def __setattr__(self, name: str, value: Any) -> None:
        # A setting assigned after construction is checked as the constructor checks it, or refused if read-only.
        super().__setattr__(*checked_assignment(self, name, value))

    def __delattr__(self, name: str) -> None:
        refuse_deletion(name)
        super().__delattr__(name)

    def __getattr__(self, name: str) -> Any:
        # Reached only when normal lookup fails: name the phalanx spelling of a Lightning attribute.
        instead = RENAMED_TRAINER_ATTRIBUTES.get(name)
        hint = f"; Lightning's trainer.{name} is {instead} in phalanx" if instead else ""
        raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}{hint}")

    accumulate_grad_batches = AccumulationSetting()
    """Batches whose gradients are accumulated before each optimizer step; a callback may change it during fit."""

    # ------------------------------------------------------------------ per-run state (declared in RunState)
    should_stop: RunField[bool] = RunField(writable=True)
    """Set to True (by a callback, say) to stop fit after the current batch, once min_epochs/min_steps allow."""
    preempted: RunField[bool] = RunField()
    """Whether the last fit stopped on a preemption signal (after saving a checkpoint)."""
    ckpt_path: RunField[str | None] = ChosenCheckpoint()
    """The checkpoint the current (or last) run started from, resolved; assigning one chooses it for the next stages."""
    datamodule: RunField[DataModule | None] = RunField(writable=True)
    """The DataModule of the current (or last) run, or None."""
    num_training_batches: RunField[int | float] = RunField()
    """Training batches per epoch of the current (or last) fit."""
    num_val_batches: RunField[list[int | float]] = RunField()
    """Validation batches per dataloader of the last fit or validate."""
    num_sanity_val_batches: RunField[list[int | float]] = RunField()
    """Sanity-check batches per validation dataloader of the last fit."""
    num_test_batches: RunField[list[int | float]] = RunField()
    """Test batches per dataloader of the last test."""
    num_predict_batches: RunField[list[int | float]] = RunField()
    """Predict batches per dataloader of the last predict."""
    validation_enabled: RunField[bool] = RunField()
    """Whether the current (or last) fit validates: it has validation data and a limit above 0."""

    # ------------------------------------------------------------------ properties
    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far."""
        return self.fit_loop.global_step

    @property
    def current_epoch(self) -> int:
        """The epoch in progress (the number of completed epochs once fit has returned)."""
        return self.fit_loop.current_epoch

    @property
    def callback_metrics(self) -> dict[str, Tensor]:
        """Every metric logged with ``self.log``: latest step values and epoch aggregates."""
        return self._metrics.callback

    @property
    def logged_metrics(self) -> dict[str, Tensor]:
        """The metrics logged with ``logger=True`` (what loggers receive)."""
        return self._metrics.logged

    @property
    def progress_bar_metrics(self) -> dict[str, Tensor]:
        """The metrics logged with ``prog_bar=True``."""
        return self._metrics.progress_bar

    @property
    def model(self) -> Any:
        """The model as the strategy runs it (possibly wrapped)."""
        return self.strategy.model

    @property
    def module(self) -> TrainingModule | None:
        """The TrainingModule being run."""
        return self.strategy.module

    @property
    def optimizers(self) -> list[Any]:
        """The optimizers from ``configure_optimizers``."""
        return self.strategy.optimizers

    @property
    def lr_scheduler_configs(self) -> list[Any]:
        """The LR schedulers and when they step."""
        return self.strategy.lr_scheduler_configs

    @property
    def logger(self) -> Any:
        """The first logger, or None."""
        return self.loggers[0] if self.loggers else None

    @property
    def log_dir(self) -> str:
        """The first logger's directory (its ``save_dir`` when it has none), or ``default_root_dir``."""
        if self.loggers:
            return self.loggers[0].log_dir or self.loggers[0].save_dir or self.default_root_dir
        return self.default_root_dir

    @property
    def checkpoint_dir(self) -> str:
        """Where checkpoints of this run go by default: the first ModelCheckpoint's directory, else
        default_root_dir/checkpoints."""
        callback = self.checkpoint_callback
        dirpath = getattr(callback, "dirpath", None)
        return os.fspath(dirpath) if dirpath else os.path.join(self.default_root_dir, "checkpoints")

    @property
    def checkpoint_callback(self) -> Any:
        """The first ModelCheckpoint callback, or None."""
        callbacks = self.checkpoint_callbacks
        return callbacks[0] if callbacks else None

    @property
    def checkpoint_callbacks(self) -> list[Any]:
        """All ModelCheckpoint callbacks."""
        return [cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)]

    @property
    def early_stopping_callback(self) -> Any:
        """The first EarlyStopping callback, or None."""
        return next((cb for cb in self.callbacks if isinstance(cb, EarlyStopping)), None)

    @property
    def progress_bar_callback(self) -> Any:
        """The progress bar callback, or None."""
        return next((cb for cb in self.callbacks if isinstance(cb, ProgressBar)), None)

    @property
    def training(self) -> bool:
        """Whether the training loop is running."""
        return self.state.stage == RunningStage.TRAINING

    @property
    def sanity_checking(self) -> bool:
        """Whether the validation sanity check is running."""
        return self.state.stage == RunningStage.SANITY_CHECKING

    @property
    def validating(self) -> bool:
        """Whether validation is running (during fit or validate)."""
        return self.state.stage == RunningStage.VALIDATING

    @property
    def testing(self) -> bool:
        """Whether testing is running."""
        return self.state.stage == RunningStage.TESTING

    @property
    def predicting(self) -> bool:
        """Whether prediction is running."""
        return self.state.stage == RunningStage.PREDICTING

    @property
    def interrupted(self) -> bool:
        """Whether the last run was interrupted (e.g. KeyboardInterrupt)."""
        return self.state.status == TrainerStatus.INTERRUPTED

    @property
    def estimated_stepping_batches(self) -> int | float:
        """Optimizer steps the fit is expected to take, per process (for schedulers such as OneCycleLR); read in
        ``configure_optimizers`` it builds the training dataloader first, as Lightning does."""
        return estimated_stepping_batches(self)

    # ------------------------------------------------------------------ called by the module, plugins and strategies
    def _prepare_dataloader(self, dataloader: Any, training: bool) -> Any:
        """Shard the data across processes (when the strategy splits data), seed workers, let the strategy wrap it."""
        return prepare_dataloader(self, dataloader, training)

    def _before_optimizer_step(self, optimizer: Any) -> None:
        hooks = self._hooks
        for hook in hooks["on_before_optimizer_step"]:
            hook(optimizer)
        module = self.strategy.module
        # As Lightning, an override runs at every step whatever the settings; the default one clips only when set.
        clips = module is not None and (self.gradient_clip_val or hooks.clipping_overridden)
        if clips and module.automatic_optimization:
            module.configure_gradient_clipping(
                optimizer,
                gradient_clip_val=self.gradient_clip_val,
                gradient_clip_algorithm=self.gradient_clip_algorithm,
            )

    def _manual_backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        check_manual_backward_loss(loss)
        for hook in self._hooks["on_before_backward"]:
            hook(loss)
        self.strategy.backward(loss, None, *args, **kwargs)
        for hook in self._hooks["on_after_backward"]:
            hook()


__all__ = ["Trainer"]
