"""Running one of the Trainer's stages (fit, validate, test, predict): launching it, setting the run up around the
strategy, and tearing it down.

:func:`start` runs a stage function ``run(trainer, *args)`` through the strategy's launcher (in every process it
starts) and records the outcome in ``trainer.state``; the stage functions below set up with :func:`setup_run`, run
their loop and finish with :func:`teardown_run`.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, Callable

import torch

from phalanx.datamodule import DataModule
from phalanx.module import TrainingModule
from phalanx.strategies.migration import refuse_trainer_launcher
from phalanx.trainer.chosen_checkpoint import chosen_ckpt_path
from phalanx.trainer.logging.loggers_and_callbacks import agree_on_log_versions, merge_module_callbacks
from phalanx.trainer.loops.data import DataSource, limited_batches, prepare_dataloader
from phalanx.trainer.loops.evaluation_loop import (
    print_results,
    run_evaluation,
    run_prediction,
    sanity_check,
    split_by_dataloader,
)
from phalanx.trainer.loops.fit_data import check_train_data_defined, prepare_fit_data
from phalanx.trainer.loops.optimizer import follow_scheduler_changes, prepare_optimization
from phalanx.trainer.loops.prediction_writing import writers
from phalanx.trainer.profiling import finish_profiling, start_profiling
from phalanx.trainer.run_settings import run_settings
from phalanx.trainer.spawn_state import TrainerWorkerState
from phalanx.trainer.state import RunningStage, TrainerFn, TrainerStatus
from phalanx.utilities.cleanup import method_calls, run_every
from phalanx.utilities.compile import unwrap_compiled
from phalanx.utilities.exceptions import CheckpointError
from phalanx.utilities.rank_zero import rank_zero_info, set_global_rank

if TYPE_CHECKING:
    from phalanx.trainer.trainer import Trainer


def check_module(model: Any, method: str) -> TrainingModule:
    """``model``, refused unless it is a TrainingModule (or one compiled with torch.compile, then unwrapped)."""
    model, compiled_with = unwrap_compiled(model)
    if not isinstance(model, TrainingModule):
        raise TypeError(f"Trainer.{method} expects a phalanx.TrainingModule, got {type(model).__name__}.")
    # Kept beside the module, not in its state: the strategy compiles it in place with the same context.
    model.__dict__["_compiled_with"] = compiled_with
    return model


def check_datamodule(datamodule: Any) -> None:
    """Refuse a ``datamodule`` that is not a DataModule (None is no datamodule)."""
    if datamodule is not None and not isinstance(datamodule, DataModule):
        raise TypeError(f"datamodule must be a phalanx.DataModule, got {type(datamodule).__name__}.")


def start(trainer: Trainer, fn: TrainerFn, run: Callable[..., Any], *args: Any) -> Any:
    """Run ``run(trainer, *args)`` as stage ``fn`` in every process of the strategy; on failure tell the callbacks,
    the strategy and the loggers, tear the strategy down and raise."""
    trainer.state.fn = fn
    trainer.state.status = TrainerStatus.RUNNING
    trainer._run.should_stop = False
    trainer._run.stop_now = False
    trainer._run.loggers_finalized = False
    try:
        launcher = trainer.strategy.launcher
        worker_state = None
        if launcher is not None:
            refuse_trainer_launcher(launcher)
            # The module the user passed (first argument of each run) lives in this process: spawned workers update it.
            worker_state = TrainerWorkerState(trainer, next((a for a in args if isinstance(a, torch.nn.Module)), None))
        call_args = (trainer, *args)
        if trainer.detect_anomaly:
            call_args, run = (run, *call_args), _run_detecting_anomalies
        result = (
            launcher.launch(run, *call_args, worker_state=worker_state) if launcher is not None else run(*call_args)
        )
    except BaseException as exception:
        _fail(trainer, exception)
        raise
    trainer.state.status = TrainerStatus.FINISHED
    trainer.state.stage = None
    return result


def _fail(trainer: Trainer, exception: BaseException) -> None:
    interrupted = isinstance(exception, KeyboardInterrupt)
    trainer.state.status = TrainerStatus.INTERRUPTED if interrupted else TrainerStatus.FAILED
    trainer.state.stage = None
    module = trainer.strategy.module
    # A callback's on_exception that raises adds a note to the run's error and costs no clean-up step.
    run_every(
        [
            (f"{type(callback).__name__}.on_exception", partial(callback.on_exception, trainer, module, exception))
            for callback in trainer.callbacks
        ],
        handling=exception,
    )
    try:
        trainer.strategy.on_exception(exception)  # may stop other processes, or raise a clearer error
    finally:
        # Unless teardown_run finalised them already (then a failure after that does not finalise twice): every logger
        # is finalised, and a failing one only adds a note, so that the error that stopped the run is the one raised.
        status = "interrupted" if interrupted else "failed"
        steps = [] if trainer._run.loggers_finalized else method_calls(trainer.loggers, "finalize", status)
        steps += [("the profiler's teardown", lambda: finish_profiling(trainer, failed=True))]
        run_every([*steps, ("strategy.teardown()", trainer.strategy.teardown)], handling=exception)


def _run_detecting_anomalies(run: Callable[..., Any], *args: Any) -> Any:
    # Entered in the process that runs the stage (a launcher's worker too): the switch is per thread.
    with torch.autograd.detect_anomaly(check_nan=True):
        return run(*args)


def setup_run(trainer: Trainer, module: TrainingModule, source: DataSource, ckpt_path: Any) -> dict[str, Any] | None:
    """Everything common to the four entry points, up to a set-up strategy; returns the loaded checkpoint."""
    strategy = trainer.strategy
    trainer._run.datamodule = source.datamodule
    trainer._run.data_source = source
    strategy.connect(module)
    module.trainer = trainer
    if trainer.datamodule is not None:
        trainer.datamodule.trainer = trainer
    # Before prepare_data, as in Lightning: the module's callbacks see every hook of the stage.
    trainer.callbacks = merge_module_callbacks(trainer.callbacks, module)
    strategy.setup_environment()
    set_global_rank(strategy.global_rank)
    agree_on_log_versions(trainer)
    start_profiling(trainer, module)
    stage = str(trainer.state.fn)
    if strategy.local_rank == 0:
        if trainer.datamodule is not None:
            trainer.datamodule.prepare_data()
        module.prepare_data()
    strategy.barrier("prepare_data")
    trainer._hooks.build(trainer, module, trainer.callbacks)
    if trainer.datamodule is not None:
        trainer.datamodule.setup(stage)
    for callback in trainer.callbacks:
        callback.setup(trainer, module, stage)
    module.setup(stage)
    with strategy.tensor_init_context(), strategy.model_sharded_context():
        module.configure_model()
    return _setup_strategy_and_checkpoint(trainer, source, ckpt_path)


def _setup_strategy_and_checkpoint(trainer: Trainer, source: DataSource, ckpt_path: Any) -> dict[str, Any] | None:
    strategy, connector = trainer.strategy, trainer._checkpoint_connector
    path = connector.resolve_path(ckpt_path)
    trainer._run.ckpt_path = path
    fitting = trainer.state.fn == TrainerFn.FITTING
    checkpoint = None
    if path is not None and not strategy.traits.restore_checkpoint_after_setup:
        checkpoint = connector.load(path, fitting=fitting)
        if fitting:
            # Applied once the optimizers exist and their states are checked too: a damaged checkpoint is refused
            # before it changes anything of the model, the callbacks, the optimizers or the loops.
            connector.check_model_state(checkpoint)
        else:
            connector.restore_model(checkpoint)
    strategy.setup(run_settings(trainer, source))
    if path is not None and strategy.traits.restore_checkpoint_after_setup:
        # Read once the model is sharded (and its optimizers exist), so that each rank reads only its shards.
        checkpoint = connector.load(path, fitting=fitting)
        if fitting:
            _check_training_state_early(trainer, checkpoint)
        connector.restore_model(checkpoint)
    elif checkpoint is not None and fitting:
        _check_training_state_early(trainer, checkpoint)
        connector.restore_model(checkpoint, hook_called=True)
    if checkpoint is not None and fitting:
        connector.restore_callbacks_and_datamodule(checkpoint)  # before on_fit_start, as in Lightning
    return checkpoint


def _check_training_state_early(trainer: Trainer, checkpoint: dict[str, Any]) -> None:
    """Refuse optimizer and scheduler states that do not fit before anything is restored, unless an ``on_fit_start``
    hook may still change the optimizers (a finetuning callback restores its parameter groups there): such states are
    checked again after it, before they are loaded (``restore_training_state``)."""
    try:
        trainer._checkpoint_connector.check_training_state(checkpoint)
    except CheckpointError:
        if not trainer._hooks["on_fit_start"]:
            raise


def teardown_run(trainer: Trainer, module: TrainingModule) -> None:
    """The end of a successful stage: teardown hooks, loggers finalised, the strategy torn down."""
    stage = str(trainer.state.fn)
    if trainer.datamodule is not None:
        trainer.datamodule.teardown(stage)
    for callback in trainer.callbacks:
        callback.teardown(trainer, module, stage)
    module.teardown(stage)
    trainer._run.loggers_finalized = True
    # Every logger is finalised (a failing one does not cost the others their data), the profiler reports and the
    # strategy tears down whatever failed before; then the first failure is raised.
    steps = method_calls(trainer.loggers, "finalize", "success")
    steps += [
        ("the profiler's report", lambda: finish_profiling(trainer)),
        ("strategy.teardown()", trainer.strategy.teardown),
    ]
    run_every(steps)
    trainer._run.results = None


def run_fit(trainer: Trainer, module: TrainingModule, source: DataSource, ckpt_path: Any) -> None:
    """The fit stage: set up, resume, sanity check, train, tear down."""
    check_train_data_defined(source)
    checkpoint = setup_run(trainer, module, source, ckpt_path)
    prepare_optimization(trainer, module)
    trainer._metrics.reset()
    trainer._hooks.call("on_fit_start")
    trainer._metrics.log_hyperparameters(module)
    # After on_fit_start, as in Lightning: optimizer states fit the parameter groups a callback restored there.
    if checkpoint is not None:
        trainer._checkpoint_connector.restore_training_state(checkpoint)
    follow_scheduler_changes(trainer)  # on_fit_start may have swapped a scheduler (a resumed SWA does)
    # Otherwise the progress of an earlier fit on this Trainer stays (current_epoch, global_step): as in Lightning,
    # a second fit continues from it, and does not train at all once max_epochs or max_steps is reached.
    val_data_built = sanity_check(trainer, source)
    prepare_fit_data(trainer, source, val_data_built)  # the training data after the sanity check, as in Lightning
    trainer._run.results = trainer._train_results
    # A fit that starts with max_epochs or max_steps reached (or a stop requested) trains nothing; Lightning then skips
    # the training stage, its on_train_start and on_train_end hooks included.
    if not _reached_limit(trainer):
        _train(trainer)
    trainer._hooks.call("on_fit_end")
    teardown_run(trainer, module)


def _reached_limit(trainer: Trainer) -> bool:
    """Whether max_epochs or max_steps is reached, or a stop requested, before training starts (a fit after an
    earlier one, or resumed from a checkpoint at its end): say so, as such a fit trains nothing."""
    loop = trainer.fit_loop
    if trainer.max_steps != -1 and loop.global_step >= trainer.max_steps:
        limit = f"max_steps={trainer.max_steps} is reached (global_step={loop.global_step})"
    elif trainer.max_epochs not in (None, -1) and loop.current_epoch >= trainer.max_epochs:
        limit = f"max_epochs={trainer.max_epochs} is reached (current_epoch={loop.current_epoch})"
    elif trainer.should_stop and loop.current_epoch >= trainer.min_epochs and loop.global_step >= trainer.min_steps:
        # Set in on_fit_start, e.g. by a Timer whose time a resumed run had already spent: as in Lightning.
        rank_zero_info("Trainer.fit trains nothing: trainer.should_stop was set before training started.")
        return True
    else:
        return False
    rank_zero_info(f"Trainer.fit trains nothing: {limit}; raise it to train further.")
    return True


def _train(trainer: Trainer) -> None:
    strategy = trainer.strategy
    strategy.on_train_start()
    trainer._hooks.call("on_train_start")
    for optimizer in strategy.optimizers:
        optimizer.zero_grad(set_to_none=True)
    _run_fit_loop(trainer)
    trainer._train_results.reset()  # a torchmetrics Metric logged in training ends the run reset, as in Lightning
    trainer.state.stage = None
    trainer._hooks.call("on_train_end")
    strategy.on_train_end()


def _run_fit_loop(trainer: Trainer) -> None:
    # Signals are routed to preemption handling only around the training loop: during set-up (joining the process
    # group, loading a checkpoint) a process must still stop at once when its launcher tells it to.
    preemption = trainer.preemption
    if preemption is None:
        return trainer.fit_loop.run()
    preemption.install()
    try:
        trainer.fit_loop.run()
    finally:
        preemption.uninstall()


def module_for_evaluation(trainer: Trainer, model: Any, ckpt_path: Any, method: str) -> tuple[TrainingModule, Any]:
    """The module ``validate``/``test``/``predict`` run (the fitted one when none is given) and the checkpoint to load
    (the best one of the previous fit by default)."""
    ckpt_path = chosen_ckpt_path(trainer, ckpt_path, method)
    if model is not None:
        return check_module(model, method), ckpt_path
    if trainer.strategy.module is None:
        raise ValueError(f"Trainer.{method}() needs a model: pass one, or call fit() first.")
    callback = trainer.checkpoint_callback
    if ckpt_path is None and callback is not None and getattr(callback, "best_model_path", ""):
        rank_zero_info(f"{method}(): no model given, using the best checkpoint of the previous fit.")
        ckpt_path = "best"
    return trainer.strategy.module, ckpt_path


def run_evaluate(
    trainer: Trainer, module: TrainingModule, source: DataSource, ckpt_path: Any, verbose: bool
) -> list[dict[str, float]]:
    """The validate or test stage: one epoch of ``validation_step`` or ``test_step``; the metrics per dataloader."""
    fn = trainer.state.fn
    stage = "validation" if fn == TrainerFn.VALIDATING else "test"
    short = "val" if stage == "validation" else "test"
    step_name = f"{stage}_step"
    if type(module).__dict__.get(step_name) is None and getattr(type(module), step_name) is getattr(
        TrainingModule, step_name
    ):
        raise ValueError(f"Trainer.{fn}() needs {type(module).__name__}.{step_name}(batch, batch_idx) to be defined.")
    setup_run(trainer, module, source, ckpt_path)
    limit = trainer.limit_val_batches if stage == "validation" else trainer.limit_test_batches
    data_key = "validate" if stage == "validation" else "test"
    dataloaders, limits = _evaluation_data(trainer, source, data_key, limit, f"limit_{short}_batches")
    if stage == "validation":
        trainer._run.num_val_batches = limits
    else:
        trainer._run.num_test_batches = limits
    if sum(limits) == 0:
        teardown_run(trainer, module)
        return []
    trainer._metrics.reset()
    trainer.state.stage = RunningStage.VALIDATING if stage == "validation" else RunningStage.TESTING
    trainer._run.results = trainer._eval_results
    metrics = run_evaluation(trainer, stage, dataloaders, limits, trainer._eval_results)
    results = split_by_dataloader(metrics, len(dataloaders))
    if verbose and trainer.is_global_zero:
        print_results(stage, results)
    teardown_run(trainer, module)
    return results


def run_predict(
    trainer: Trainer, module: TrainingModule, source: DataSource, ckpt_path: Any, return_predictions: bool
) -> list[Any] | None:
    """The predict stage: ``predict_step`` over the data; the outputs per batch (a list per dataloader if several)."""
    setup_run(trainer, module, source, ckpt_path)
    limit = trainer.limit_predict_batches
    dataloaders, trainer._run.num_predict_batches = _evaluation_data(
        trainer, source, "predict", limit, "limit_predict_batches"
    )
    if sum(trainer.num_predict_batches) == 0:
        teardown_run(trainer, module)
        return None
    trainer.state.stage = RunningStage.PREDICTING
    outputs = run_prediction(trainer, dataloaders, trainer.num_predict_batches, return_predictions)
    teardown_run(trainer, module)
    return outputs


def _evaluation_data(
    trainer: Trainer, source: DataSource, key: str, limit: int | float, limit_name: str
) -> tuple[list[Any], list[int | float]]:
    """The dataloaders of validate/test/predict (``key``) and their batch counts.

    With a limit of 0 there is no batch to run: as in Lightning, the stage is skipped (its hooks included, see
    the callers) and its data is neither requested nor required.
    """
    if limit == 0:
        return [], []
    record = key == "predict" and bool(writers(trainer))  # the prediction writers receive each batch's indices
    dataloaders = [prepare_dataloader(trainer, loader, training=False, record=record) for loader in source.get(key)]
    if not dataloaders:
        hook = "val" if key == "validate" else key
        raise ValueError(
            f"Trainer.{key}() needs data: pass dataloaders=, a datamodule with {hook}_dataloader(), or define it"
            " on the module."
        )
    return dataloaders, [limited_batches(loader, limit, limit_name) for loader in dataloaders]


__all__ = [
    "check_datamodule",
    "check_module",
    "module_for_evaluation",
    "run_evaluate",
    "run_fit",
    "run_predict",
    "setup_run",
    "start",
    "teardown_run",
]
