"""What the kit attaches to a run: method recorders, state snapshots, and the callback that saves and probes mid-fit."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import torch

from phalanx.callbacks.callback import Callback
from phalanx.strategies.strategy import Strategy
from phalanx.testing.module import ConformanceModule, loss_of, make_net, probe_batch
from phalanx.testing.report import NotApplicable


class MethodRecorder:
    """Wraps methods of one object (on the instance) and appends each one's name to ``events`` when it returns.

    Recording on return puts ``optimizer_step`` after the ``training_step`` and ``backward`` its closure ran.
    """

    def __init__(self, target: Any, names: tuple[str, ...], prefix: str = "", events: list[str] | None = None) -> None:
        self.events: list[str] = [] if events is None else events
        self.active = True
        for name in names:
            setattr(target, name, self._wrap(getattr(target, name), prefix + name))

    def _wrap(self, method: Callable[..., Any], label: str) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            if self.active:
                self.events.append(label)
            return result

        recorded.__name__ = getattr(method, "__name__", label)
        recorded.__doc__ = method.__doc__
        return recorded


def record_plugin_teardowns(strategy: Strategy) -> list[str]:
    """Record ``teardown`` of the strategy's accelerator, precision plugin, checkpoint IO and cluster environment."""
    calls: list[str] = []
    parts = {
        "accelerator": strategy.accelerator,
        "precision_plugin": strategy.precision_plugin,
        "checkpoint_io": strategy.checkpoint_io,
    }
    environment = getattr(strategy, "cluster_environment", None)
    if environment is not None:
        parts["cluster_environment"] = environment
    for label, part in parts.items():
        if part is not None and callable(getattr(part, "teardown", None)):
            MethodRecorder(part, ("teardown",), prefix=f"{label}.", events=calls)
    return calls


# ---------------------------------------------------------------------------- snapshots and comparison
def local_copy(value: Any) -> Any:
    """A detached CPU copy of nested containers of tensors (a DTensor as its local shard); other values as they are."""
    if isinstance(value, torch.Tensor):
        to_local = getattr(value, "to_local", None)
        tensor = to_local() if callable(to_local) else value
        return tensor.detach().cpu().clone()
    if isinstance(value, dict):
        return {key: local_copy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [local_copy(item) for item in value]
    return value


def snapshot(strategy: Strategy, *, optimizers: bool) -> dict[str, Any]:
    """This rank's view of the weights (``module_state_dict``) and, if asked, the optimizers (``optimizer_state``)."""
    state: dict[str, Any] = {"weights": local_copy(strategy.module_state_dict())}
    if optimizers:
        state["optimizers"] = [local_copy(strategy.optimizer_state(optimizer)) for optimizer in strategy.optimizers]
    return state


def differences(expected: Any, actual: Any, *, atol: float = 0.0, path: str = "", limit: int = 5) -> list[str]:
    """Where ``actual`` differs from ``expected`` (``limit`` places at most); tensors equal exactly unless ``atol``."""
    found: list[str] = []
    _compare(expected, actual, atol, path or "state", found, limit)
    return found


def _compare(expected: Any, actual: Any, atol: float, path: str, found: list[str], limit: int) -> None:
    if len(found) >= limit:
        return
    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        if not (isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor)):
            found.append(f"{path}: {type(expected).__name__} became {type(actual).__name__}")
        elif expected.shape != actual.shape or expected.dtype != actual.dtype:
            found.append(
                f"{path}: shape/dtype {tuple(expected.shape)}/{expected.dtype} became"
                f" {tuple(actual.shape)}/{actual.dtype}"
            )
        elif not _tensors_match(expected, actual, atol):
            gap = (expected.double() - actual.double()).abs().max().item() if expected.is_floating_point() else "n/a"
            found.append(f"{path}: values differ (largest difference {gap}{', allowed ' + str(atol) if atol else ''})")
    elif isinstance(expected, dict) and isinstance(actual, dict):
        if set(expected) != set(actual):
            found.append(f"{path}: keys {sorted(map(str, expected))} became {sorted(map(str, actual))}")
            return
        for key in expected:
            _compare(expected[key], actual[key], atol, f"{path}[{key!r}]", found, limit)
    elif isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple)):
        if len(expected) != len(actual):
            found.append(f"{path}: {len(expected)} entries became {len(actual)}")
            return
        for index, (left, right) in enumerate(zip(expected, actual, strict=True)):
            _compare(left, right, atol, f"{path}[{index}]", found, limit)
    elif isinstance(expected, float) and isinstance(actual, float) and math.isnan(expected) and math.isnan(actual):
        return
    elif _plain(expected) and expected != actual:
        found.append(f"{path}: {expected!r} became {actual!r}")


def _plain(value: Any) -> bool:
    # Values whose == means equality; other objects (loss scalers, ...) compare by identity and are not judged.
    return value is None or isinstance(value, (bool, int, float, str, bytes, dict, list, tuple))


def _tensors_match(expected: torch.Tensor, actual: torch.Tensor, atol: float) -> bool:
    if atol == 0.0 or not expected.is_floating_point():
        return torch.equal(expected, actual)
    return torch.allclose(expected, actual, rtol=0.0, atol=atol, equal_nan=True)


# ---------------------------------------------------------------------------- the callback
class ProbeCallback(Callback):
    """Observes a fit from inside: ranks at train start, a snapshot and ``trainer.save_checkpoint`` at ``save_at``,
    the state a resumed run starts from, the final weights, and (optionally) the no-sync probe at train end."""

    def __init__(
        self,
        *,
        save_at: int | None = None,
        checkpoint: Path | None = None,
        capture_start: bool = False,
        no_sync: bool = False,
        recorder: MethodRecorder | None = None,
    ) -> None:
        self.save_at, self.checkpoint = save_at, checkpoint
        self.capture_start, self.probe_no_sync = capture_start, no_sync
        self.recorder = recorder
        self.ranks: dict[str, Any] | None = None
        self.saved: dict[str, Any] | None = None
        self.started: dict[str, Any] | None = None
        self.final: dict[str, Any] | None = None
        self.no_sync: dict[str, Any] | BaseException | None = None

    def on_train_start(self, trainer: Any, module: Any) -> None:
        strategy = trainer.strategy
        self.ranks = {
            "world_size": strategy.world_size,
            "global_rank": strategy.global_rank,
            "is_global_zero": strategy.is_global_zero,
            "optimizers": len(strategy.optimizers),
        }
        if self.capture_start:
            self.started = snapshot(strategy, optimizers=True)

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.save_at is not None and self.saved is None and trainer.global_step == self.save_at:
            self.saved = snapshot(trainer.strategy, optimizers=True)
            trainer.save_checkpoint(self.checkpoint)

    def on_train_end(self, trainer: Any, module: Any) -> None:
        self.final = snapshot(trainer.strategy, optimizers=False)
        if not self.probe_no_sync:
            return
        module.recording = False
        if self.recorder is not None:
            self.recorder.active = False
        strategy = trainer.strategy

        def backward(batch: Any, index: int) -> None:
            loss = strategy.training_step(strategy.batch_to_device(batch), index)
            strategy.backward(loss, strategy.optimizers[0])

        try:
            self.no_sync = observe_no_sync(strategy, module, backward, strategy.block_backward_sync)
        except Exception as error:  # noqa: BLE001 - judged (and reported) by the no_sync check
            self.no_sync = error
        finally:
            module.recording = True
            if self.recorder is not None:
                self.recorder.active = True


# ---------------------------------------------------------------------------- the no-sync probe
def observe_no_sync(
    strategy: Strategy,
    module: ConformanceModule,
    backward: Callable[[Any, int], None],
    no_sync: Callable[[], Any],
) -> dict[str, Any]:
    """One backward inside the driver's no-sync context and one after it, on data that differs per data-parallel rank.

    ``backward(batch, index)`` runs the driver's step and backward on a CPU batch; ``no_sync()`` is its context
    (``strategy.block_backward_sync`` under the Trainer, ``cohort.no_backward_sync(model)`` under the Cohort).
    Returns what every rank saw (gradients inside and outside, and each rank's own single-process gradients of the
    same batches), gathered on all ranks, for ``judge_no_sync``.
    """
    world = strategy.world_size
    sampler = strategy.distributed_sampler_kwargs or {}
    replicas = int(sampler.get("num_replicas", 1))
    if world == 1:
        raise NotApplicable("one process: there is no gradient synchronisation to skip")
    if strategy.traits.handles_gradient_accumulation:
        raise NotApplicable(
            f"{type(strategy).__name__} accumulates gradients itself (traits.handles_gradient_accumulation),"
            " so the loops never enter block_backward_sync()"
        )
    if replicas < 2:
        raise NotApplicable(
            f"the ranks of {type(strategy).__name__} all read the same data (distributed_sampler_kwargs:"
            f" {sampler or None}), so there are no per-rank gradients to keep apart"
        )
    replica = int(sampler["rank"])
    reference = make_net()
    reference.load_state_dict(
        {name: _full(parameter.detach()).cpu() for name, parameter in module.net.named_parameters()}
    )
    first, second = probe_batch(100 + replica), probe_batch(200 + replica)
    optimizer = strategy.optimizers[0]
    optimizer.zero_grad(set_to_none=True)
    with no_sync():
        backward(first, 0)
    inside = _gradients(module)
    backward(second, 1)
    outside = _gradients(module)
    optimizer.zero_grad(set_to_none=True)
    seen = {
        "replica": replica,
        "inside": inside,
        "outside": outside,
        "local_first": _reference_gradients(reference, first),
        "local_second": _reference_gradients(reference, second),
    }
    return {"rank": strategy.global_rank, "ranks": gather_objects(strategy, seen)}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else tensor


def _gradients(module: ConformanceModule) -> dict[str, torch.Tensor | None]:
    return {
        name: None if p.grad is None else _full(p.grad).detach().cpu().clone()
        for name, p in module.net.named_parameters()
    }


def _reference_gradients(net: torch.nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    net.zero_grad(set_to_none=True)
    loss_of(net, batch).backward()
    return {name: p.grad.detach().clone() for name, p in net.named_parameters() if p.grad is not None}


def gather_objects(strategy: Strategy, obj: Any) -> list[Any]:
    """Every rank's ``obj`` through torch.distributed itself (not the strategy under test) when it is initialised."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        gathered: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, obj)
        return gathered
    return strategy.all_gather_object(obj)
