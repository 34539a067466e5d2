"""The Trainer: runs fit, validate, test and predict for a TrainingModule through a Strategy."""

from __future__ import annotations

import math
import os
import time
from datetime import timedelta
from functools import partial
from typing import Any, Callable

import torch
from torch import Tensor

from phalanx.accelerators.accelerator import Accelerator
from phalanx.callbacks.callback import Callback
from phalanx.datamodule import DataModule
from phalanx.module import TrainingModule
from phalanx.strategies.migration import refuse_trainer_launcher, refuse_trainer_parameters
from phalanx.strategies.strategy import Strategy
from phalanx.trainer.arguments import (
    NONFINITE_LOSS_MODES,
    RENAMED_TRAINER_ATTRIBUTES,
    check_bool,
    check_choice,
    check_int,
    check_number,
    parse_max_time,
    refuse_not_integrated,
    reject_class,
    resolve_root_dir,
    shown,
)
from phalanx.trainer.barebones import BarebonesResults, check_barebones
from phalanx.trainer.checkpoint import CheckpointConnector
from phalanx.trainer.data import DataSource, limited_batches, validate_limit
from phalanx.trainer.device_properties import DeviceProperties
from phalanx.trainer.evaluation_loop import run_evaluation, run_prediction, split_by_dataloader
from phalanx.trainer.fit_data import prepare_fit_data, reload_val_data_if_due
from phalanx.trainer.fit_loop import FitLoop
from phalanx.trainer.hooks import HookTable
from phalanx.trainer.logged_results import LoggedResults
from phalanx.trainer.nonfinite import check_nonfinite_mode
from phalanx.trainer.optimizer import ManualOptimizer
from phalanx.trainer.preemption import PREEMPTED_EXIT_CODE, Preemption
from phalanx.trainer.run_settings import run_settings
from phalanx.trainer.setup import resolve_strategy
from phalanx.trainer.spawn_state import TrainerWorkerState
from phalanx.trainer.state import RunningStage, TrainerFn, TrainerState, TrainerStatus
from phalanx.utilities.rank_zero import rank_zero_info, rank_zero_warn, set_global_rank
from phalanx.utilities.seed import worker_init_fn


class Trainer(DeviceProperties):
    """Trains, evaluates and predicts with a TrainingModule; ``strategy=`` decides how the work is distributed.

    The arguments mean what they mean in Lightning's Trainer; each is checked here, and a bad value raises a
    TypeError or ValueError naming the argument, the value and the valid choices (``logger=None`` is the default
    logger, as in Lightning; ``overfit_batches`` and ``reload_dataloaders_every_n_epochs``: see
    :mod:`phalanx.trainer.fit_data`; ``barebones``: see :mod:`phalanx.trainer.barebones`). Beyond Lightning:

    Args:
        preemption: True (default) saves a checkpoint and stops on SIGTERM/SIGUSR1-like signals (see
            :class:`~phalanx.trainer.preemption.Preemption`); False leaves signals alone.
        detect_anomaly: Run fit, validate, test and predict under ``torch.autograd.detect_anomaly()``: a backward
            that produces NaN raises, naming the forward operation at fault. Slow; for debugging.
        nonfinite_loss: What ``fit`` does when a training loss is NaN or infinite:

            - ``"warn"`` (default): a warning, once per fit, naming the range of global steps. The check is kept on
              the device and read only where the loop reads values anyway (every ``log_every_n_steps`` batches,
              epoch ends, checkpoint saves), so it adds no host-device synchronisation; the update is applied.
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
        devices: Any = "auto",
        num_nodes: int = 1,
        precision: Any = "32-true",
        plugins: Any = None,
        callbacks: Callback | list[Callback] | None = None,
        logger: Any = None,
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
        profiler: Any = None,
        model_registry: str | None = None,
    ) -> None:
        refuse_not_integrated(profiler=profiler, model_registry=model_registry)
        for name, flag in (
            ("sync_batchnorm", sync_batchnorm),
            ("use_distributed_sampler", use_distributed_sampler),
            ("inference_mode", inference_mode),
            ("detect_anomaly", detect_anomaly),
            ("barebones", barebones),
        ):
            check_bool(name, flag)
        for name, flag in (
            ("enable_progress_bar", enable_progress_bar),
            ("enable_checkpointing", enable_checkpointing),
            ("enable_model_summary", enable_model_summary),
            ("benchmark", benchmark),
        ):
            check_bool(name, flag, allow_none=True)
        check_choice("deterministic", deterministic, (None, True, False, "warn"))
        check_choice("nonfinite_loss", nonfinite_loss, NONFINITE_LOSS_MODES)
        self.barebones = barebones
        if barebones:
            check_barebones(
                callbacks,
                enable_checkpointing=enable_checkpointing,
                logger=logger,
                log_every_n_steps=log_every_n_steps,
                enable_progress_bar=enable_progress_bar,
                enable_model_summary=enable_model_summary,
                num_sanity_val_steps=num_sanity_val_steps,
                fast_dev_run=fast_dev_run,
                detect_anomaly=detect_anomaly,
            )
            logger, enable_checkpointing, enable_progress_bar, enable_model_summary, num_sanity_val_steps = (
                False,
                False,
                False,
                False,
                0,
            )
        self.detect_anomaly = detect_anomaly
        self.nonfinite_loss = nonfinite_loss
        self.default_root_dir = resolve_root_dir(default_root_dir)
        self.strategy: Strategy = resolve_strategy(
            accelerator=accelerator, strategy=strategy, devices=devices, num_nodes=num_nodes,
            precision=precision, plugins=plugins, sync_batchnorm=sync_batchnorm,
        )  # fmt: skip
        refuse_trainer_parameters(self.strategy)  # written for the old contract, it would fail only once fit starts
        self.precision = self.strategy.precision_plugin.precision

        if isinstance(fast_dev_run, bool):
            fast_dev_batches = 1 if fast_dev_run else 0
        elif isinstance(fast_dev_run, int) and fast_dev_run >= 0:
            fast_dev_batches = fast_dev_run
        else:
            raise ValueError(
                f"fast_dev_run={shown(fast_dev_run)} is not valid; it must be a bool or an int >= 0 (number of"
                " batches)."
            )
        self.fast_dev_run: bool | int = fast_dev_batches if fast_dev_batches else False

        check_int("max_steps", max_steps, -1)
        check_int("max_epochs", max_epochs, -1, allow_none=True)
        check_int("min_epochs", min_epochs, 0, allow_none=True)
        check_int("min_steps", min_steps, 0, allow_none=True)
        if min_steps is not None and max_steps != -1 and min_steps > max_steps:
            raise ValueError(
                f"min_steps={min_steps} is more than max_steps={max_steps}; lower min_steps or raise max_steps."
            )
        if min_epochs is not None and max_epochs is not None and max_epochs != -1 and min_epochs > max_epochs:
            raise ValueError(
                f"min_epochs={min_epochs} is more than max_epochs={max_epochs}; lower min_epochs or raise max_epochs."
            )
        check_int("accumulate_grad_batches", accumulate_grad_batches, 1)
        check_int("check_val_every_n_epoch", check_val_every_n_epoch, 1, allow_none=True)
        check_int("num_sanity_val_steps", num_sanity_val_steps, -1, allow_none=True)
        check_int("log_every_n_steps", log_every_n_steps, 1, allow_none=True)
        check_int("reload_dataloaders_every_n_epochs", reload_dataloaders_every_n_epochs, 0)
        self.reload_dataloaders_every_n_epochs = reload_dataloaders_every_n_epochs
        self._max_time = parse_max_time(max_time)
        if max_epochs is None:
            max_epochs = 1000 if max_steps == -1 and self._max_time is None else -1
        self.max_epochs: int = max_epochs
        self.min_epochs: int = min_epochs or 0
        self.min_steps: int = min_steps or 0
        self.max_steps: int = max_steps
        self.accumulate_grad_batches = accumulate_grad_batches
        self.check_val_every_n_epoch = check_val_every_n_epoch
        self.num_sanity_val_steps = 2 if num_sanity_val_steps is None else num_sanity_val_steps
        # barebones: 0, never log steps (only barebones sets 0; an argument of 0 is refused above)
        self.log_every_n_steps = 0 if barebones else 50 if log_every_n_steps is None else log_every_n_steps
        self.limit_train_batches = validate_limit(
            "limit_train_batches", 1.0 if limit_train_batches is None else limit_train_batches
        )
        self.limit_val_batches = validate_limit(
            "limit_val_batches", 1.0 if limit_val_batches is None else limit_val_batches
        )
        self.limit_test_batches = validate_limit(
            "limit_test_batches", 1.0 if limit_test_batches is None else limit_test_batches
        )
        self.limit_predict_batches = validate_limit(
            "limit_predict_batches", 1.0 if limit_predict_batches is None else limit_predict_batches
        )
        if val_check_interval is None:
            val_check_interval = 1.0
        if (
            isinstance(val_check_interval, bool)
            or not isinstance(val_check_interval, (int, float))
            or not val_check_interval > 0
            or (isinstance(val_check_interval, float) and not val_check_interval <= 1.0)
        ):
            raise ValueError(
                f"val_check_interval={shown(val_check_interval)} is not valid; it must be a float in (0.0, 1.0]"
                " (fraction of an epoch) or an int >= 1 (batches)."
            )
        self.val_check_interval = val_check_interval
        if gradient_clip_val is not None:
            check_number("gradient_clip_val", gradient_clip_val, 0)
        check_choice("gradient_clip_algorithm", gradient_clip_algorithm, (None, "norm", "value"))
        self.gradient_clip_val = gradient_clip_val
        self.gradient_clip_algorithm = gradient_clip_algorithm or "norm"
        if fast_dev_batches:
            self.limit_train_batches = self.limit_val_batches = fast_dev_batches
            self.limit_test_batches = self.limit_predict_batches = fast_dev_batches
            self.max_steps, self.max_epochs, self.num_sanity_val_steps = fast_dev_batches, 1, 0
            self.val_check_interval, self.check_val_every_n_epoch = 1.0, 1
            self._max_time = None
        self.overfit_batches = validate_limit("overfit_batches", overfit_batches)
        if (
            self.overfit_batches
        ):  # wins over limit_*_batches and fast_dev_run for training and validation, as in Lightning
            self.limit_train_batches = self.limit_val_batches = self.overfit_batches
        reject_class("preemption", preemption, Preemption, "True or False")
        if preemption is True:
            preemption = Preemption()
        elif preemption is False or preemption is None:
            preemption = None
        elif not isinstance(preemption, Preemption):
            raise TypeError(
                f"preemption={shown(preemption)} (of type {type(preemption).__name__}) is not valid; pass True, False"
                " or a phalanx.trainer.Preemption instance."
            )
        self.preemption: Preemption | None = preemption
        self.preempted = False

        # Process-wide switches last: a Trainer refused for a bad argument leaves them untouched.
        self.deterministic = deterministic
        if deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=deterministic == "warn")
            torch.backends.cudnn.deterministic = True
        if benchmark is not None:
            if benchmark and deterministic:
                rank_zero_warn(
                    "benchmark=True picks the fastest (possibly non-deterministic) cuDNN kernels, against"
                    " deterministic=True."
                )
            torch.backends.cudnn.benchmark = benchmark
        self.sync_batchnorm = sync_batchnorm
        self.use_distributed_sampler = use_distributed_sampler
        self.inference_mode = inference_mode

        self.loggers = self._build_loggers(logger if not fast_dev_batches else False)
        self.callbacks: list[Callback] = self._build_callbacks(
            callbacks,
            enable_progress_bar=True if enable_progress_bar is None else enable_progress_bar,
            enable_checkpointing=True if enable_checkpointing is None else enable_checkpointing,
            enable_model_summary=True if enable_model_summary is None else enable_model_summary,
        )

        self.state = TrainerState()
        self.fit_loop = FitLoop(self)
        self.should_stop = False
        self.datamodule: DataModule | None = None
        self._checkpoint_connector = CheckpointConnector(self)
        #: The checkpoint the current (or last) run started from, resolved ('last', 'best', 'auto' become a path).
        self.ckpt_path: str | None = None
        self._hooks = HookTable()
        self._results: LoggedResults | None = None
        results = BarebonesResults if barebones else LoggedResults
        self._train_results = results(self.strategy)
        self._eval_results = results(self.strategy)
        self._callback_metrics: dict[str, Tensor] = {}
        self._logged_metrics: dict[str, Tensor] = {}
        self._progress_bar_metrics: dict[str, Tensor] = {}
        self._pending_step_log: dict[str, Tensor] = {}
        self._manual_optimizers: list[ManualOptimizer] = []
        self._train_dataloader: Any = None
        self._train_data_epoch = self._val_data_epoch = 0  # the epochs the fit's dataloaders were last built in
        self._val_dataloaders: list[Any] = []
        self._val_limits: list[int | float] = []
        self.num_training_batches: int | float = 0
        self.num_val_batches: list[int | float] = []
        self.num_sanity_val_batches: list[int | float] = []
        self.num_test_batches: list[int | float] = []
        self.num_predict_batches: list[int | float] = []
        self.validation_enabled = False
        self._val_every_batches: int | None = None
        self._val_across_epochs = False
        self._stop_now = False
        self._deadline: float | None = None
        self._loss_divisor = 1
        self._optimizer: Any = None
        self._step_scheduler_configs: list[Any] = []
        self._epoch_scheduler_configs: list[Any] = []

    # ------------------------------------------------------------------ construction helpers
    def _build_loggers(self, logger: Any) -> list[Any]:
        from phalanx.loggers import CSVLogger, Logger

        if logger is True or logger is None:
            return [CSVLogger(save_dir=self.default_root_dir, name="logs")]
        if logger is False:
            return []
        listed = isinstance(logger, (list, tuple))
        items = list(logger) if listed else [logger]
        for index, item in enumerate(items):
            name = f"logger[{index}]" if listed else "logger"
            reject_class(name, item, Logger, "")
            if not isinstance(item, Logger):
                raise TypeError(
                    f"{name}={shown(item)} (of type {type(item).__name__}) is not valid; pass True, False, a Logger"
                    " instance (e.g. CSVLogger(save_dir=...)) or a list of them."
                )
        return items

    def _build_callbacks(
        self, callbacks: Any, *, enable_progress_bar: bool, enable_checkpointing: bool, enable_model_summary: bool
    ) -> list[Callback]:
        from phalanx.callbacks import ModelCheckpoint, ModelSummary, ProgressBar, TQDMProgressBar

        reject_class("callbacks", callbacks, Callback, "")
        if callbacks is None:
            items: list[Callback] = []
        elif isinstance(callbacks, Callback):
            items = [callbacks]
        elif isinstance(callbacks, (list, tuple)):
            items = list(callbacks)
        else:
            raise TypeError(
                f"callbacks={shown(callbacks)} (of type {type(callbacks).__name__}) is not valid; pass a Callback"
                " instance or a list of them."
            )
        for index, callback in enumerate(items):
            reject_class(f"callbacks[{index}]", callback, Callback, "")
            if not isinstance(callback, Callback):
                raise TypeError(
                    f"callbacks[{index}]={shown(callback)} (of type {type(callback).__name__}) is not a phalanx"
                    " Callback; pass Callback instances."
                )
        if enable_checkpointing and not any(isinstance(cb, ModelCheckpoint) for cb in items):
            items.append(ModelCheckpoint())
        elif not enable_checkpointing and any(isinstance(cb, ModelCheckpoint) for cb in items):
            raise ValueError(
                "enable_checkpointing=False, but a ModelCheckpoint callback was passed; remove one of them."
            )
        if enable_progress_bar and not any(isinstance(cb, ProgressBar) for cb in items):
            items.append(TQDMProgressBar())
        elif not enable_progress_bar and any(isinstance(cb, ProgressBar) for cb in items):
            raise ValueError("enable_progress_bar=False, but a progress bar callback was passed; remove one of them.")
        if enable_model_summary and not any(isinstance(cb, ModelSummary) for cb in items):
            items.append(ModelSummary())
        return _checkpoints_last(items)

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
        module = self._check_module(model, "fit")
        if isinstance(train_dataloaders, DataModule):
            datamodule, train_dataloaders = train_dataloaders, None
        if datamodule is not None and (train_dataloaders is not None or val_dataloaders is not None):
            raise ValueError("Pass either dataloaders or a datamodule to fit(), not both.")
        self._check_datamodule(datamodule)
        check_nonfinite_mode(self, module.automatic_optimization)
        source = DataSource(module, datamodule, train=train_dataloaders, validate=val_dataloaders)
        self.preempted = False
        self._start(TrainerFn.FITTING, self._run_fit, module, source, ckpt_path)
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
        """Run one validation epoch; return one dict of metrics per dataloader."""
        return self._evaluate(TrainerFn.VALIDATING, model, dataloaders, ckpt_path, verbose, datamodule)

    def test(
        self,
        model: TrainingModule | None = None,
        dataloaders: Any = None,
        ckpt_path: Any = None,
        verbose: bool = True,
        datamodule: DataModule | None = None,
    ) -> list[dict[str, float]]:
        """Run one test epoch; return one dict of metrics per dataloader."""
        return self._evaluate(TrainerFn.TESTING, model, dataloaders, ckpt_path, verbose, datamodule)

    def predict(
        self,
        model: TrainingModule | None = None,
        dataloaders: Any = None,
        datamodule: DataModule | None = None,
        return_predictions: bool | None = None,
        ckpt_path: Any = None,
    ) -> list[Any] | None:
        """Run ``predict_step`` over the data; return the outputs per batch (a list per dataloader if several)."""
        module, ckpt_path = self._module_for_evaluation(model, ckpt_path, "predict")
        if isinstance(dataloaders, DataModule):
            datamodule, dataloaders = dataloaders, None
        if datamodule is not None and dataloaders is not None:
            raise ValueError("Pass either dataloaders or a datamodule to predict(), not both.")
        self._check_datamodule(datamodule)
        source = DataSource(module, datamodule, predict=dataloaders)
        keep = True if return_predictions is None else return_predictions
        return self._start(TrainerFn.PREDICTING, self._run_predict, module, source, ckpt_path, keep)

    def save_checkpoint(
        self, filepath: str | os.PathLike, weights_only: bool = False, storage_options: Any | None = None
    ) -> None:
        """Write a checkpoint of the current state (every process must call this)."""
        if self.strategy.module is None:
            raise RuntimeError("Trainer.save_checkpoint needs a model: call fit, validate, test or predict first.")
        checkpoint = self._checkpoint_connector.dump(weights_only=weights_only)
        self.strategy.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        self.strategy.barrier("Trainer.save_checkpoint")

    def __getattr__(self, name: str) -> Any:
        # Reached only when normal lookup fails: name the phalanx spelling of a Lightning attribute.
        instead = RENAMED_TRAINER_ATTRIBUTES.get(name)
        hint = f"; Lightning's trainer.{name} is {instead} in phalanx" if instead else ""
        raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}{hint}")

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
        return self._callback_metrics

    @property
    def logged_metrics(self) -> dict[str, Tensor]:
        """The metrics logged with ``logger=True`` (what loggers receive)."""
        return self._logged_metrics

    @property
    def progress_bar_metrics(self) -> dict[str, Tensor]:
        """The metrics logged with ``prog_bar=True``."""
        return self._progress_bar_metrics

    @property
    def global_rank(self) -> int:
        """This process's global rank."""
        return self.strategy.global_rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""
        return self.strategy.local_rank

    @property
    def node_rank(self) -> int:
        """This node's rank."""
        return self.strategy.node_rank

    @property
    def world_size(self) -> int:
        """The number of processes."""
        return self.strategy.world_size

    @property
    def num_nodes(self) -> int:
        """The number of nodes."""
        return self.strategy.num_nodes

    @property
    def is_global_zero(self) -> bool:
        """Whether this is global rank 0."""
        return self.strategy.is_global_zero

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
        """The first logger's directory, or ``default_root_dir`` without loggers."""
        if self.loggers and self.loggers[0].log_dir is not None:
            return self.loggers[0].log_dir
        return self.default_root_dir

    @property
    def checkpoint_callback(self) -> Any:
        """The first ModelCheckpoint callback, or None."""
        callbacks = self.checkpoint_callbacks
        return callbacks[0] if callbacks else None

    @property
    def checkpoint_callbacks(self) -> list[Any]:
        """All ModelCheckpoint callbacks."""
        from phalanx.callbacks import ModelCheckpoint

        return [cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)]

    @property
    def early_stopping_callback(self) -> Any:
        """The first EarlyStopping callback, or None."""
        from phalanx.callbacks import EarlyStopping

        return next((cb for cb in self.callbacks if isinstance(cb, EarlyStopping)), None)

    @property
    def progress_bar_callback(self) -> Any:
        """The progress bar callback, or None."""
        from phalanx.callbacks import ProgressBar

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
        """Optimizer steps the fit is expected to take (for schedulers such as OneCycleLR)."""
        per_epoch = self.num_training_batches
        if math.isinf(per_epoch) or self.max_epochs == -1:
            return self.max_steps if self.max_steps != -1 else math.inf
        steps = math.ceil(per_epoch / self.accumulate_grad_batches) * self.max_epochs
        return min(steps, self.max_steps) if self.max_steps != -1 else steps

    # ------------------------------------------------------------------ running a stage
    def _check_module(self, model: Any, method: str) -> TrainingModule:
        if not isinstance(model, TrainingModule):
            raise TypeError(f"Trainer.{method} expects a phalanx.TrainingModule, got {type(model).__name__}.")
        return model

    @staticmethod
    def _check_datamodule(datamodule: Any) -> None:
        if datamodule is not None and not isinstance(datamodule, DataModule):
            raise TypeError(f"datamodule must be a phalanx.DataModule, got {type(datamodule).__name__}.")

    def _start(self, fn: TrainerFn, run: Callable[..., Any], *args: Any) -> Any:
        self.state.fn = fn
        self.state.status = TrainerStatus.RUNNING
        self.should_stop = False
        self._stop_now = False
        try:
            launcher = self.strategy.launcher
            worker_state = None
            if launcher is not None:
                refuse_trainer_launcher(launcher)
                # The module the user passed (first argument of each run) lives in this process: spawned workers update
                # it.
                worker_state = TrainerWorkerState(
                    self, next((arg for arg in args if isinstance(arg, torch.nn.Module)), None)
                )
            if self.detect_anomaly:
                args = (run, *args)
                run = self._run_detecting_anomalies
            result = launcher.launch(run, *args, worker_state=worker_state) if launcher is not None else run(*args)
        except BaseException as exception:
            interrupted = isinstance(exception, KeyboardInterrupt)
            self.state.status = TrainerStatus.INTERRUPTED if interrupted else TrainerStatus.FAILED
            self.state.stage = None
            module = self.strategy.module
            for callback in self.callbacks:
                callback.on_exception(self, module, exception)  # type: ignore[arg-type]
            try:
                self.strategy.on_exception(exception)  # may stop other processes, or raise a clearer error
            finally:
                for logger in self.loggers:
                    logger.finalize("interrupted" if interrupted else "failed")
                self.strategy.teardown()
            raise
        self.state.status = TrainerStatus.FINISHED
        self.state.stage = None
        return result

    @staticmethod
    def _run_detecting_anomalies(run: Callable[..., Any], *args: Any) -> Any:
        # Entered in the process that runs the stage (a launcher's worker too): the switch is per thread.
        with torch.autograd.detect_anomaly(check_nan=True):
            return run(*args)

    def _setup_run(self, module: TrainingModule, source: DataSource, ckpt_path: Any) -> dict[str, Any] | None:
        """Everything common to the four entry points, up to a set-up strategy; returns the loaded checkpoint."""
        strategy = self.strategy
        self.datamodule = source.datamodule
        self._data_source = source
        strategy.connect(module)
        module.trainer = self
        if self.datamodule is not None:
            self.datamodule.trainer = self
        strategy.setup_environment()
        set_global_rank(strategy.global_rank)
        stage = str(self.state.fn)
        if strategy.local_rank == 0:
            if self.datamodule is not None:
                self.datamodule.prepare_data()
            module.prepare_data()
        strategy.barrier("prepare_data")
        self._merge_module_callbacks(module)
        self._hooks.build(self, module, self.callbacks)
        if self.datamodule is not None:
            self.datamodule.setup(stage)
        for callback in self.callbacks:
            callback.setup(self, module, stage)
        module.setup(stage)
        with strategy.tensor_init_context(), strategy.model_sharded_context():
            module.configure_model()
        connector = self._checkpoint_connector
        path = connector.resolve_path(ckpt_path)
        self.ckpt_path = path
        fitting = self.state.fn == TrainerFn.FITTING
        checkpoint = None
        if path is not None and not strategy.restore_checkpoint_after_setup:
            checkpoint = connector.load(path, fitting=fitting)
            if fitting:
                # Applied once the optimizers exist and their states are checked too: a damaged checkpoint is
                # refused before it changes anything of the model, the optimizers or the loops.
                connector.check_model_state(checkpoint)
            else:
                connector.restore_model(checkpoint)
        strategy.setup(run_settings(self, source))
        if path is not None and strategy.restore_checkpoint_after_setup:
            # Read once the model is sharded (and its optimizers exist), so that each rank reads only its shards.
            checkpoint = connector.load(path, fitting=fitting)
            if fitting:
                connector.check_training_state(checkpoint)
            connector.restore_model(checkpoint)
        elif checkpoint is not None and fitting:
            connector.check_training_state(checkpoint)
            connector.restore_model(checkpoint, hook_called=True)
        return checkpoint

    def _teardown_run(self, module: TrainingModule) -> None:
        stage = str(self.state.fn)
        if self.datamodule is not None:
            self.datamodule.teardown(stage)
        for callback in self.callbacks:
            callback.teardown(self, module, stage)
        module.teardown(stage)
        for logger in self.loggers:
            logger.finalize("success")
        self.strategy.teardown()
        self._results = None

    def _merge_module_callbacks(self, module: TrainingModule) -> None:
        extra = module.configure_callbacks()
        if extra is None:
            return
        extra = [extra] if isinstance(extra, Callback) else list(extra)
        if not extra:
            return
        replaced_types = {type(cb) for cb in extra}
        kept = [cb for cb in self.callbacks if type(cb) not in replaced_types and cb not in extra]
        self.callbacks = _checkpoints_last(kept + extra)

    def _run_fit(self, module: TrainingModule, source: DataSource, ckpt_path: Any) -> None:
        checkpoint = self._setup_run(module, source, ckpt_path)
        strategy = self.strategy
        self._prepare_optimization(module)
        if checkpoint is not None:
            self._checkpoint_connector.restore_training_state(checkpoint)
        else:
            self.fit_loop = FitLoop(self)
        self._prepare_fit_data(source)
        self._log_hyperparameters(module)
        self._callback_metrics, self._logged_metrics, self._progress_bar_metrics = {}, {}, {}
        self._hooks.call("on_fit_start")
        self._sanity_check()
        self._results = self._train_results
        strategy.on_train_start()
        self._hooks.call("on_train_start")
        self._deadline = time.monotonic() + self._max_time if self._max_time is not None else None
        for optimizer in strategy.optimizers:
            optimizer.zero_grad(set_to_none=True)
        self._run_fit_loop()
        self.state.stage = None
        self._hooks.call("on_train_end")
        strategy.on_train_end()
        self._hooks.call("on_fit_end")
        self._teardown_run(module)

    def _run_fit_loop(self) -> None:
        # Signals are routed to preemption handling only around the training loop: during set-up (joining the
        # process group, loading a checkpoint) a process must still stop at once when its launcher tells it to.
        if self.preemption is None:
            return self.fit_loop.run()
        self.preemption.install()
        try:
            self.fit_loop.run()
        finally:
            self.preemption.uninstall()

    def _prepare_optimization(self, module: TrainingModule) -> None:
        strategy = self.strategy
        optimizers = strategy.optimizers
        self._manual_optimizers = [ManualOptimizer(optimizer, self) for optimizer in optimizers]
        self._loss_divisor = self.accumulate_grad_batches if not strategy.handles_gradient_accumulation else 1
        if module.automatic_optimization:
            if len(optimizers) != 1:
                raise ValueError(
                    f"configure_optimizers returned {len(optimizers)} optimizers; automatic optimization uses exactly"
                    " one."
                    " For several optimizers (e.g. GANs) set self.automatic_optimization = False and step them in"
                    " training_step."
                )
            self._optimizer = optimizers[0]
            configs = strategy.lr_scheduler_configs
        else:
            if self.gradient_clip_val:
                raise ValueError(
                    "gradient_clip_val is for automatic optimization; with manual optimization call"
                    " self.clip_gradients(optimizer, ...) in training_step."
                )
            if self.accumulate_grad_batches != 1:
                raise ValueError(
                    "accumulate_grad_batches is for automatic optimization; with manual optimization accumulate in"
                    " training_step."
                )
            self._optimizer = None
            configs = []  # in manual optimization the user steps schedulers
        self._step_scheduler_configs = [c for c in configs if c.interval == "step"]
        self._epoch_scheduler_configs = [c for c in configs if c.interval == "epoch"]

    def _prepare_fit_data(self, source: DataSource) -> None:
        prepare_fit_data(self, source)

    def _prepare_dataloader(self, dataloader: Any, training: bool) -> Any:
        """Shard the data across processes (when the strategy splits data), seed workers, let the strategy wrap it."""
        sampler_kwargs = self.strategy.distributed_sampler_kwargs
        if sampler_kwargs and self.use_distributed_sampler:
            from phalanx.trainer.distributed_data import distributed_dataloader

            seed = int(os.environ.get("PHALANX_GLOBAL_SEED", "0"))
            dataloader = distributed_dataloader(
                dataloader, training=training, seed=seed, pad_evaluation=self.strategy.pads_evaluation, **sampler_kwargs
            )
        if (
            os.environ.get("PHALANX_SEED_WORKERS") == "1"
            and getattr(dataloader, "num_workers", 0) > 0
            and dataloader.worker_init_fn is None
        ):
            # seed_everything(workers=True): every worker of every rank gets its own reproducible seed.
            dataloader.worker_init_fn = partial(worker_init_fn, rank=self.global_rank)
        return self.strategy.process_dataloader(dataloader)

    def _val_check_due(self, loop: FitLoop, is_last: bool) -> bool:
        every = self._val_every_batches
        if every is None or not self.validation_enabled:
            return False
        if self._val_across_epochs:
            return loop.total_batches % every == 0
        if self.check_val_every_n_epoch is not None and (loop.current_epoch + 1) % self.check_val_every_n_epoch != 0:
            return False
        return not is_last and loop.batches_done % every == 0

    def _epoch_end_validation_due(self, loop: FitLoop) -> bool:
        if not self.validation_enabled or self._val_across_epochs:
            return False
        if self.check_val_every_n_epoch is not None and (loop.current_epoch + 1) % self.check_val_every_n_epoch != 0:
            return False
        if loop._last_validated_at == loop.total_batches:
            return False
        if isinstance(self.val_check_interval, int):
            return loop.batches_done % self.val_check_interval == 0
        if self.val_check_interval < 1.0 and self._val_every_batches:
            # A fraction validates every int(fraction * batches) batches, as in Lightning: 0.3 of 32 batches is
            # batches 9, 18 and 27, not also the epoch's end.
            return loop.batches_done % self._val_every_batches == 0
        return True

    def _sanity_check(self) -> None:
        steps = self.num_sanity_val_steps
        if steps == 0 or not self.validation_enabled:
            self.num_sanity_val_batches = []
            return
        limits = [limit if steps == -1 else min(limit, steps) for limit in self._val_limits]
        self.num_sanity_val_batches = limits
        self.state.stage = RunningStage.SANITY_CHECKING
        self._results = self._eval_results
        self._hooks.call("on_sanity_check_start")
        run_evaluation(self, "validation", self._val_dataloaders, limits, self._eval_results)
        self._hooks.call("on_sanity_check_end")
        # The sanity check only proves the validation code runs: its numbers must not reach callbacks or loggers.
        self._callback_metrics, self._logged_metrics, self._progress_bar_metrics = {}, {}, {}
        self._eval_results.reset()
        self.state.stage = None

    def _run_validation_during_fit(self) -> None:
        reload_val_data_if_due(self)
        self.state.stage = RunningStage.VALIDATING
        self._results = self._eval_results
        run_evaluation(self, "validation", self._val_dataloaders, self._val_limits, self._eval_results)
        self._results = self._train_results

    def _evaluate(
        self, fn: TrainerFn, model: Any, dataloaders: Any, ckpt_path: Any, verbose: bool, datamodule: Any
    ) -> list[dict[str, float]]:
        method = "validate" if fn == TrainerFn.VALIDATING else "test"
        module, ckpt_path = self._module_for_evaluation(model, ckpt_path, method)
        if isinstance(dataloaders, DataModule):
            datamodule, dataloaders = dataloaders, None
        if datamodule is not None and dataloaders is not None:
            raise ValueError(f"Pass either dataloaders or a datamodule to {method}(), not both.")
        self._check_datamodule(datamodule)
        stage_key = "validate" if fn == TrainerFn.VALIDATING else "test"
        source = DataSource(module, datamodule, **{stage_key: dataloaders})
        return self._start(fn, self._run_evaluate, module, source, ckpt_path, verbose)

    def _module_for_evaluation(self, model: Any, ckpt_path: Any, method: str) -> tuple[TrainingModule, Any]:
        if model is not None:
            return self._check_module(model, method), ckpt_path
        if self.strategy.module is None:
            raise ValueError(f"Trainer.{method}() needs a model: pass one, or call fit() first.")
        if (
            ckpt_path is None
            and self.checkpoint_callback is not None
            and getattr(self.checkpoint_callback, "best_model_path", "")
        ):
            rank_zero_info(f"{method}(): no model given, using the best checkpoint of the previous fit.")
            ckpt_path = "best"
        return self.strategy.module, ckpt_path

    def _run_evaluate(
        self, module: TrainingModule, source: DataSource, ckpt_path: Any, verbose: bool
    ) -> list[dict[str, float]]:
        fn = self.state.fn
        stage = "validation" if fn == TrainerFn.VALIDATING else "test"
        step_name = f"{stage}_step"
        if type(module).__dict__.get(step_name) is None and getattr(type(module), step_name) is getattr(
            TrainingModule, step_name
        ):
            raise ValueError(
                f"Trainer.{fn}() needs {type(module).__name__}.{step_name}(batch, batch_idx) to be defined."
            )
        self._setup_run(module, source, ckpt_path)
        data_key = "validate" if stage == "validation" else "test"
        dataloaders = [self._prepare_dataloader(loader, training=False) for loader in source.get(data_key)]
        if not dataloaders:
            raise ValueError(
                f"Trainer.{fn}() needs data: pass dataloaders=, a datamodule with"
                f" {'val' if stage == 'validation' else 'test'}_dataloader(), or define it on the module."
            )
        limit = self.limit_val_batches if stage == "validation" else self.limit_test_batches
        limits = [
            limited_batches(loader, limit, f"limit_{'val' if stage == 'validation' else 'test'}_batches")
            for loader in dataloaders
        ]
        if stage == "validation":
            self.num_val_batches = limits
        else:
            self.num_test_batches = limits
        self._callback_metrics, self._logged_metrics, self._progress_bar_metrics = {}, {}, {}
        self.state.stage = RunningStage.VALIDATING if stage == "validation" else RunningStage.TESTING
        self._results = self._eval_results
        metrics = run_evaluation(self, stage, dataloaders, limits, self._eval_results)
        results = split_by_dataloader(metrics, len(dataloaders))
        if verbose and self.is_global_zero:
            _print_results(stage, results)
        self._teardown_run(module)
        return results

    def _run_predict(
        self, module: TrainingModule, source: DataSource, ckpt_path: Any, return_predictions: bool
    ) -> list[Any] | None:
        self._setup_run(module, source, ckpt_path)
        dataloaders = [self._prepare_dataloader(loader, training=False) for loader in source.get("predict")]
        if not dataloaders:
            raise ValueError(
                "Trainer.predict() needs data: pass dataloaders=, a datamodule with predict_dataloader(), or define it"
                " on the module."
            )
        limits = [
            limited_batches(loader, self.limit_predict_batches, "limit_predict_batches") for loader in dataloaders
        ]
        self.num_predict_batches = limits
        self.state.stage = RunningStage.PREDICTING
        outputs = run_prediction(self, dataloaders, limits, return_predictions)
        self._teardown_run(module)
        return outputs

    @property
    def checkpoint_dir(self) -> str:
        """Where checkpoints of this run go by default: the first ModelCheckpoint's directory, else
        default_root_dir/checkpoints."""
        callback = self.checkpoint_callback
        dirpath = getattr(callback, "dirpath", None)
        return os.fspath(dirpath) if dirpath else os.path.join(self.default_root_dir, "checkpoints")

    # ------------------------------------------------------------------ called by the loops and plugins
    def _preemption_requested(self, batches: int) -> bool:
        preemption = self.preemption
        if preemption is None or not preemption.requested(self, batches):
            return False
        # Every rank is here, at the same batch: write the checkpoint together, then stop.
        signame = preemption.received.name if preemption.received is not None else "a signal on another rank"
        path = os.path.join(self.checkpoint_dir, f"preempted-epoch={self.current_epoch}-step={self.global_step}.ckpt")
        rank_zero_info(f"Preempted ({signame}): saving {path} and stopping.")
        self.save_checkpoint(path)
        preemption.requeue_job(self)
        self.preempted = True
        return True

    def _before_optimizer_step(self, optimizer: Any) -> None:
        for hook in self._hooks["on_before_optimizer_step"]:
            hook(optimizer)
        module = self.strategy.module
        if self.gradient_clip_val and module is not None and module.automatic_optimization:
            module.configure_gradient_clipping(
                optimizer,
                gradient_clip_val=self.gradient_clip_val,
                gradient_clip_algorithm=self.gradient_clip_algorithm,
            )

    def _manual_backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        for hook in self._hooks["on_before_backward"]:
            hook(loss)
        self.strategy.backward(loss, None, *args, **kwargs)
        for hook in self._hooks["on_after_backward"]:
            hook()

    def _step_schedulers(self, interval: str) -> None:
        configs = self._step_scheduler_configs if interval == "step" else self._epoch_scheduler_configs
        counter = self.fit_loop.global_step if interval == "step" else self.fit_loop.current_epoch + 1
        module = self.strategy.module
        assert module is not None
        for config in configs:
            if counter % config.frequency:
                continue
            metric = None
            if config.reduce_on_plateau:
                metric = self._callback_metrics.get(config.monitor)
                if metric is None:
                    if config.strict:
                        raise ValueError(
                            f"The LR scheduler monitors {config.monitor!r}, which was not logged. Logged metrics:"
                            f" {sorted(self._callback_metrics)}. Set 'strict': False to skip the step instead."
                        )
                    rank_zero_warn(
                        f"The LR scheduler monitors {config.monitor!r}, which was not logged; its step is skipped."
                    )
                    continue
            module.lr_scheduler_step(config.scheduler, metric)

    def _publish_step_metrics(self, results: LoggedResults) -> None:
        callback, logged, bar = results.step_metrics()
        self._callback_metrics.update(callback)
        self._logged_metrics.update(logged)
        self._progress_bar_metrics.update(bar)
        self._pending_step_log.update(logged)

    def _publish_epoch_metrics(self, results: LoggedResults) -> dict[str, Tensor]:
        callback, logged, bar = results.epoch_metrics()
        self._callback_metrics.update(callback)
        self._logged_metrics.update(logged)
        self._progress_bar_metrics.update(bar)
        return callback

    def _log_step_metrics(self) -> None:
        pending, self._pending_step_log = self._pending_step_log, {}
        if pending:
            self._send_to_loggers(pending)

    def _log_epoch_metrics(self, results: LoggedResults) -> None:
        _, logged, _ = results.epoch_metrics()
        if logged:
            self._send_to_loggers(logged)

    def _send_to_loggers(self, metrics: dict[str, Tensor]) -> None:
        values = {name: float(value.item()) for name, value in metrics.items()}
        values["epoch"] = float(self.current_epoch)
        for logger in self.loggers:
            logger.log_metrics(values, step=self.global_step)

    def _log_hyperparameters(self, module: TrainingModule) -> None:
        if not self.loggers:
            return
        params = dict(module.hparams) if getattr(module, "_log_hyperparams", True) else {}
        if self.datamodule is not None:
            params.update(self.datamodule.hparams)
        if params:
            for logger in self.loggers:
                logger.log_hyperparams(params)


def _checkpoints_last(callbacks: list[Callback]) -> list[Callback]:
    # Checkpointing runs after every other callback so that it saves the state they produced.
    from phalanx.callbacks import ModelCheckpoint

    return [cb for cb in callbacks if not isinstance(cb, ModelCheckpoint)] + [
        cb for cb in callbacks if isinstance(cb, ModelCheckpoint)
    ]


def _print_results(stage: str, results: list[dict[str, float]]) -> None:
    for index, metrics in enumerate(results):
        if not metrics:
            continue
        title = f"{stage} results" + (f" (dataloader {index})" if len(results) > 1 else "")
        width = max(len(name) for name in metrics)
        lines = [title, "-" * max(len(title), width + 16)]
        lines += [f"{name:<{width}}  {value:.6g}" for name, value in sorted(metrics.items())]
        print("\n".join(lines))


__all__ = ["Trainer"]
