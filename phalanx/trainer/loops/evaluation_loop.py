"""Validation and test loops (the sanity check and validation during fit included), and the predict loop."""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

from phalanx.trainer.logging.results import LoggedResults
from phalanx.trainer.loops.dataloader_idx import check_dataloader_idx_signatures, index_args
from phalanx.trainer.loops.fit_data import prepare_val_data, reload_val_data_if_due, validation_defined
from phalanx.trainer.loops.prediction_writing import PredictionRecord
from phalanx.trainer.state import RunningStage
from phalanx.utilities.apply import apply_to_tensors
from phalanx.utilities.compile import running_eagerly
from phalanx.utilities.rank_zero import rank_zero_warn
from phalanx.utilities.seed import isolate_rng

if TYPE_CHECKING:
    from phalanx.strategies.strategy import Strategy
    from phalanx.trainer.loops.data import DataSource
    from phalanx.trainer.trainer import Trainer


@contextmanager
def evaluation_mode(trainer: Trainer, stage: str) -> Iterator[None]:
    """Without gradients, put the model in eval mode, then restore each submodule's own mode.

    Inference mode (the Trainer's ``inference_mode=True``) only where the strategy allows it: a sharded module keeps
    the parameters it gathers, which training would then fail to update. ``on_{stage}_model_eval`` and
    ``on_{stage}_model_train`` replace the switch and the restore when overridden.
    """
    strategy = trainer.strategy
    model = strategy.model
    hooks = trainer._hooks
    modes = [(module, module.training) for module in model.modules()]
    with (
        torch.inference_mode() if trainer.inference_mode and strategy.traits.allows_inference_mode else torch.no_grad()
    ):
        to_eval = hooks[f"on_{stage}_model_eval"]
        try:
            if to_eval:
                to_eval[0]()
            else:
                model.eval()
            yield
        except BaseException:
            _restore_modes(modes)
            raise
        to_train = hooks[f"on_{stage}_model_train"]
        if to_train:
            to_train[0]()
        else:
            _restore_modes(modes)


def _restore_modes(modes: list[tuple[nn.Module, bool]]) -> None:
    for module, training in modes:
        module.training = training


def check_equal_batches(strategy: Strategy, counts: list[int | float], stage: str) -> None:
    """When the strategy ``requires_equal_batches``, refuse to start an evaluation in which the processes' batch counts
    differ.

    Each forward pass then runs collectives (ZeRO-3 gathers parameters): a process with fewer batches would leave the
    others waiting until the timeout.
    """
    if not strategy.traits.requires_equal_batches:
        return
    mine = [float(count) for count in counts]
    everyone = strategy.all_gather_object(mine)
    if any(other != everyone[0] for other in everyone):
        per_rank = ", ".join(
            f"rank {rank}: {[int(c) if math.isfinite(c) else 'unknown' for c in row]}"
            for rank, row in enumerate(everyone)
        )
        raise ValueError(
            f"{type(strategy).__name__} runs collective operations in every forward pass (ZeRO stage 3 gathers "
            f"parameters), so every process must run the same number of {stage} batches; they differ ({per_rank}). "
            f"phalanx pads the evaluation data of a torch DataLoader for this; "
            "a dataloader it does not shard (use_distributed_sampler=False, a custom batch sampler, "
            f"an iterable) must yield as many batches on every process (or limit them with "
            f"limit_{'val' if stage == 'validation' else stage}_batches=...)."
        )
    if any(math.isinf(count) for count in mine):
        rank_zero_warn(
            f"{type(strategy).__name__}: the {stage} dataloader has no length, so phalanx cannot check that every"
            " process runs as"
            " many batches; if one runs fewer, the others wait for it until the timeout."
        )


def _step_kwargs(multiple: bool, dataloader_idx: int) -> dict[str, int]:
    return {"dataloader_idx": dataloader_idx} if multiple else {}


def run_evaluation(
    trainer: Trainer, stage: str, dataloaders: list[Any], limits: list[int | float], results: LoggedResults
) -> dict[str, torch.Tensor]:
    """Run ``validation`` or ``test`` over ``dataloaders``; return the logged epoch metrics (tensors, not synchronised
    to host)."""
    strategy = trainer.strategy
    module = strategy.module
    assert module is not None
    hooks = trainer._hooks
    step = strategy.validation_step if stage == "validation" else strategy.test_step
    step_name = f"{stage}_step"
    multiple = len(dataloaders) > 1
    if sum(limits) == 0:
        return {}  # no batch to run: the stage is skipped, its hooks included, as in Lightning
    check_dataloader_idx_signatures(trainer, stage, multiple)
    results.reset()
    results.multiple_dataloaders = multiple
    batch_start = hooks[f"on_{stage}_batch_start"]
    batch_end = hooks[f"on_{stage}_batch_end"]
    move_batch = hooks.move_batch
    with evaluation_mode(trainer, stage):
        check_equal_batches(strategy, limits, stage)
        getattr(strategy, f"on_{stage}_start")()
        hooks.call(f"on_{stage}_start")
        hooks.call(f"on_{stage}_epoch_start")
        for dataloader_idx, (dataloader, limit) in enumerate(zip(dataloaders, limits)):
            if limit == 0:
                continue
            extra = _step_kwargs(multiple, dataloader_idx)
            index = index_args(multiple, dataloader_idx)
            for batch_idx, batch in enumerate(dataloader):
                if batch_idx >= limit:
                    break
                batch = move_batch(batch, dataloader_idx=dataloader_idx)
                results.new_batch(batch, dataloader_idx)
                for hook in batch_start:
                    hook(batch, batch_idx, *index)
                module.__dict__["_current_fx"] = step_name
                output = step(batch, batch_idx, **extra)
                for hook in batch_end:
                    hook(output, batch, batch_idx, *index)
                trainer._metrics.publish_eval_step(results, dataloader_idx, trainer.sanity_checking)
        trainer._metrics.publish_epoch(results)
        module.__dict__["_current_fx"] = None
        hooks.call(f"on_{stage}_epoch_end")
        epoch_metrics = trainer._metrics.publish_epoch(results)
        if trainer.loggers and not trainer.sanity_checking:
            trainer._metrics.log_epoch(results)
        hooks.call(f"on_{stage}_end")
        getattr(strategy, f"on_{stage}_end")()
    results.reset()  # the torchmetrics Metrics logged start the next run empty, as in Lightning
    return epoch_metrics


def sanity_check(trainer: Trainer, source: DataSource) -> bool:
    """Before training: run ``num_sanity_val_steps`` validation batches per dataloader, then forget their metrics.

    As in Lightning, the validation dataloaders are built after ``on_sanity_check_start`` (returns whether they were),
    and a run resumed inside an epoch has no sanity check.
    """
    steps = trainer.num_sanity_val_steps
    if steps == 0 or trainer.fit_loop.resuming_inside_epoch or not validation_defined(trainer, source):
        trainer._run.num_sanity_val_batches = []
        return False
    # As in Lightning, the check draws nothing from the global generators that training would see: a run shuffles and
    # initialises as it would without the check (each loader's iterator draws its base seed from torch's generator).
    with isolate_rng():
        trainer.state.stage = RunningStage.SANITY_CHECKING
        trainer._run.results = trainer._eval_results
        trainer._hooks.call("on_sanity_check_start")
        prepare_val_data(trainer, source, first=True)
        limits = [limit if steps == -1 else min(limit, steps) for limit in trainer._run.val_limits]
        trainer._run.num_sanity_val_batches = limits
        # Eagerly: compiled first here, dynamo would compare the training batches' sizes with these and compile
        # training with dynamic sizes where they differ; a hand-written loop compiles for training first (issue 37).
        with running_eagerly():
            run_evaluation(trainer, "validation", trainer._run.val_dataloaders, limits, trainer._eval_results)
        trainer._hooks.call("on_sanity_check_end")
    # The sanity check only proves the validation code runs: its numbers must not reach callbacks or loggers.
    trainer._metrics.reset()
    trainer._eval_results.reset()
    trainer.state.stage = None
    return True


def run_validation_during_fit(trainer: Trainer) -> None:
    """A validation epoch inside ``fit`` (the fit loop decides when), on fresh validation data when it is due."""
    reload_val_data_if_due(trainer)
    trainer.state.stage = RunningStage.VALIDATING
    trainer._run.results = trainer._eval_results
    run_evaluation(trainer, "validation", trainer._run.val_dataloaders, trainer._run.val_limits, trainer._eval_results)
    trainer._run.results = trainer._train_results


def split_by_dataloader(metrics: dict[str, torch.Tensor], count: int) -> list[dict[str, float]]:
    """One dict of float metrics per dataloader: names ending in '/dataloader_idx_i' go to loader i, others to all."""
    per_loader: list[dict[str, float]] = [{} for _ in range(count)]
    for name, value in metrics.items():
        _, marker, index = name.rpartition("/dataloader_idx_")
        number = float(value.item())
        if marker and index.isdigit() and int(index) < count:
            per_loader[int(index)][name] = number
        else:
            for metrics_of_loader in per_loader:
                metrics_of_loader[name] = number
    return per_loader


def print_results(stage: str, results: list[dict[str, float]]) -> None:
    """Print the metrics of each dataloader as a table (``verbose=True`` of validate and test)."""
    for index, metrics in enumerate(results):
        if not metrics:
            continue
        title = f"{stage} results" + (f" (dataloader {index})" if len(results) > 1 else "")
        width = max(len(name) for name in metrics)
        lines = [title, "-" * max(len(title), width + 16)]
        lines += [f"{name:<{width}}  {value:.6g}" for name, value in sorted(metrics.items())]
        print("\n".join(lines))


def run_prediction(
    trainer: Trainer, dataloaders: list[Any], limits: list[int | float], return_predictions: bool
) -> list[Any] | None:
    """Run ``predict_step`` over ``dataloaders``; return the outputs per batch (a list per dataloader if several)."""
    strategy = trainer.strategy
    module = strategy.module
    assert module is not None
    hooks = trainer._hooks
    multiple = len(dataloaders) > 1
    distributed = strategy.world_size > 1 and strategy.distributed_sampler_kwargs is not None
    all_outputs: list[list[Any]] = []
    move_batch = hooks.move_batch
    check_dataloader_idx_signatures(trainer, "predict", multiple)
    record = PredictionRecord(trainer, len(dataloaders))
    with evaluation_mode(trainer, "predict"):
        check_equal_batches(strategy, limits, "predict")
        strategy.on_predict_start()
        hooks.call("on_predict_start")
        hooks.call("on_predict_epoch_start")
        for dataloader_idx, (dataloader, limit) in enumerate(zip(dataloaders, limits)):
            outputs: list[Any] = []
            extra = _step_kwargs(multiple, dataloader_idx)
            index = index_args(multiple, dataloader_idx)
            record.start_dataloader(dataloader)
            for batch_idx, batch in enumerate(dataloader):
                if batch_idx >= limit:
                    break
                batch = move_batch(batch, dataloader_idx=dataloader_idx)
                record.before_batch(batch_idx, dataloader_idx)
                hooks.call("on_predict_batch_start", batch, batch_idx, *index)
                module.__dict__["_current_fx"] = "predict_step"
                output = strategy.predict_step(batch, batch_idx, **extra)
                hooks.call("on_predict_batch_end", output, batch, batch_idx, *index)
                record.after_batch(output, dataloader_idx)
                if return_predictions:
                    outputs.append(output)
            if distributed and return_predictions:
                outputs = _gather_in_dataset_order(strategy, dataloader, outputs)
            all_outputs.append(outputs)
        module.__dict__["_current_fx"] = None
        hooks.call("on_predict_epoch_end")
        record.finish()
        hooks.call("on_predict_end")
        strategy.on_predict_end()
    if not return_predictions:
        return None
    return all_outputs if multiple else all_outputs[0] if all_outputs else []


def _gather_in_dataset_order(strategy: Any, dataloader: Any, outputs: list[Any]) -> list[Any]:
    # Each rank predicted its own shard; every rank receives all of them, put back in dataset order and batched
    # as one process would have batched them.
    # Lazy for import time: only a distributed predict reorders; `from phalanx import Trainer` skips it.
    from phalanx.trainer.loops.prediction_order import batch_indices, reassemble_predictions

    # A strategy's device-side wrapper (XLA's) keeps the DataLoader it wraps as `.dataloader`.
    indices = batch_indices(getattr(dataloader, "dataloader", dataloader))[: len(outputs)]
    local = [(batch, apply_to_tensors(output, lambda t: t.detach().cpu())) for batch, output in zip(indices, outputs)]
    per_rank = strategy.all_gather_object(local)
    padded = strategy.traits.pads_evaluation
    return reassemble_predictions(per_rank, getattr(dataloader, "batch_size", None), drop_repeats=padded)
