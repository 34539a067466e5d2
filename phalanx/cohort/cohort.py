"""Cohort: phalanx's strategies driven from your own training loop.

A Cohort is built from the Trainer's arguments and drives the very same Strategy objects through their contract
(``connect``, ``setup_environment``, ``setup(RunSettings)``, ``backward``, ``optimizer_step``, ...)::

    cohort = Cohort(strategy="ddp", devices=2, accelerator="cpu")
    cohort.launch()
    model, optimizer = cohort.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = cohort.setup_dataloaders(loader)
    for x, y in loader:
        optimizer.zero_grad()
        cohort.backward(loss_fn(model(x), y))
        optimizer.step()
    cohort.save("last.ckpt", {"model": model, "optimizer": optimizer})

Optimizers may be created before ``setup`` on the plain module's parameters: ``setup`` rebinds them, by parameter
name, to the parameters the strategy runs (FSDP replaces them with sharded ones), keeping hyper-parameters and state.
One Cohort sets up one module (put several in one ``nn.Module``, e.g. an ``nn.ModuleDict``).
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from os import PathLike
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from phalanx.cohort.agreement import agree_on_call, describe_module, notice_exit
from phalanx.cohort.backward_guard import BackwardGuard, slip_reason
from phalanx.cohort.checkpoint import StateFilter, build_checkpoint, optimizer_index, own_rng_states, restore_checkpoint
from phalanx.cohort.data import CohortData
from phalanx.cohort.guards import record_loss, report_nonfinite
from phalanx.cohort.habits import CohortHabits, check_norm_arguments, raise_if_nonfinite, resolve_callbacks
from phalanx.cohort.live_position import LivePosition, check_position
from phalanx.cohort.metrics import CohortLogging, LoggerWorkerState, attach, resolve_loggers, share_logger_states
from phalanx.cohort.plain_checkpoint import load_before_setup, save_before_setup
from phalanx.cohort.raw import load_raw, refuse_plain_state_dict
from phalanx.cohort.setup_checks import (
    check_cohort_offered,
    check_optimizer,
    check_optimizers_given,
    check_parameters_known,
    check_path,
    check_placement,
    is_training_module,
    rebind,
)
from phalanx.cohort.step import forward_backward
from phalanx.cohort.wrappers import CohortModule, unwrap_optimizer, wrap_optimizer
from phalanx.plugins.io.checkpoint_identity import checkpoint_identity
from phalanx.strategies.properties import DeviceProperties
from phalanx.strategies.settings import RunSettings
from phalanx.strategies.strategy import Strategy
from phalanx.utilities.apply import apply_to_tensors
from phalanx.utilities.compile import check_compile, compiler_for, refuse_compiled_in_place, split_unit, unwrap_compiled
from phalanx.utilities.run_variables import settings_from_run
from phalanx.utilities.seed import restore_rng_states

_T = TypeVar("_T")


class Cohort(CohortData, CohortHabits, DeviceProperties, CohortLogging):
    """Runs your own loop on any phalanx strategy: processes, wrapping, backward, collectives, checkpoints, logging."""

    def __init__(
        self,
        *,
        accelerator: Any = "auto",
        strategy: Any = "auto",
        devices: Any = "auto",
        num_nodes: int = 1,
        precision: Any = "32-true",
        plugins: Any = None,
        loggers: Any = None,
        callbacks: Any = None,
        compile: bool | dict[str, Any] | None = None,  # see docs/compile.md
    ) -> None:
        # Lazy for import time: `from phalanx import Cohort` does not load strategy resolution.
        from phalanx.strategies.resolve import resolve_strategy

        self._loggers = resolve_loggers(loggers)
        self._callbacks = resolve_callbacks(callbacks)
        self._compile = check_compile(compile, "Cohort")

        # Under `phalanx run`, what its --accelerator, --strategy, --devices, --num-nodes and --precision say.
        settings = settings_from_run(
            dict(accelerator=accelerator, strategy=strategy, devices=devices, num_nodes=num_nodes, precision=precision)
        )
        self._strategy: Strategy = resolve_strategy(**settings, plugins=plugins)
        self._launched = False
        self._environment_ready = False
        self._module: CohortModule | None = None
        self._parameter_names: dict[int, str] = {}
        self._removed_names: set[str] = set()
        self._optimizer_steps = 0
        self._last_loss: Tensor | None = None
        self._live = LivePosition(self)

    # ------------------------------------------------------------------ who and where
    @property
    def strategy(self) -> Strategy:
        """The strategy this Cohort drives."""
        return self._strategy

    @property
    def device(self) -> torch.device:
        """The device this process computes on."""
        return self._strategy.root_device

    @property
    def global_step(self) -> int:
        """Optimizer steps taken by the first optimizer (saved as a checkpoint's ``global_step``); committed ones only
        under a fault-tolerant strategy."""
        return self._optimizer_steps

    @property
    def last_step_committed(self) -> bool:
        """Whether the latest ``optimizer.step()`` changed the weights: False where a fault-tolerant strategy's quorum
        declined it (nothing changed anywhere; train the batch again or go on)."""
        return self._strategy.last_step_committed

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only."""
        if self.is_global_zero:
            print(*args, **kwargs)

    # ------------------------------------------------------------------ processes
    def launch(self, function: Callable[..., _T] | None = None, *args: Any, **kwargs: Any) -> _T | None:
        """Start the strategy's processes and run ``function(cohort, *args, **kwargs)`` in each; returns this process's
        (or rank 0's) result.

        Strategies that re-run the script (``ddp``) start the other ranks here and go on in this process, so
        ``launch()`` without a function is enough for them; spawn/fork strategies need a function (picklable for spawn).
        When the function returns (or raises), the loggers are finalized ("success" or "failed").
        """
        if function is not None and not callable(function):
            raise TypeError(
                "Cohort.launch(function) takes a callable (called as function(cohort, *args)), got"
                f" {type(function).__name__}."
            )
        if self._launched:
            raise RuntimeError("Cohort.launch() was already called; launch once per Cohort.")
        launcher = self._strategy.launcher
        start_method = getattr(self._strategy, "_start_method", "popen")
        if function is None and launcher is not None and start_method != "popen":
            raise TypeError(
                f"Cohort.launch() needs a function with start_method={start_method!r}: the new processes run"
                " function(cohort, *args), not the rest of your script."
            )
        self._launched = True
        if launcher is None:
            return self._run_launched(function, *args, **kwargs)
        # Rank 0's logger versions and run ids come back from spawned workers, for the loggers of this process.
        state = LoggerWorkerState(self._loggers) if self._loggers else None
        return launcher.launch(self._run_launched, function, *args, worker_state=state, **kwargs)

    def _run_launched(self, function: Callable[..., _T] | None, *args: Any, **kwargs: Any) -> _T | None:
        self._launched = True
        self._ensure_environment()
        if function is None:
            return None
        try:
            result = function(self, *args, **kwargs)
        except BaseException as error:
            self._finalize_loggers("failed", handling=error)
            raise
        self._finalize_loggers("success")  # the function is the whole run: its logs are complete
        return result

    def _ensure_environment(self) -> None:
        if self._environment_ready:
            return
        if self._strategy.launcher is not None and not self._launched:
            raise RuntimeError(
                f"{type(self._strategy).__name__} starts its processes itself: call cohort.launch() (or"
                " cohort.launch(fn)) before"
                " setup, collectives or init_module; under torchrun or a cluster scheduler it does nothing extra."
            )
        self._environment_ready = True
        self._strategy.setup_environment()
        notice_exit()  # the other ranks learn at once when this process ends, instead of waiting for it
        if self._loggers:  # every rank names rank 0's logger version or tracker run
            share_logger_states(self._loggers, self._strategy)

    # ------------------------------------------------------------------ model and optimizers
    def setup(self, module: nn.Module, *optimizers: Optimizer, move_to_device: bool = True) -> Any:
        """Set up ``module`` (a TrainingModule's ``configure_model`` first, as in the Trainer) and its ``optimizers``;
        returns the wrapped module, then the wrapped optimizers. ``move_to_device=False`` (Fabric's) is accepted where
        the module already sits on ``device``: the strategy places it."""
        module, compiled_with = unwrap_compiled(module)  # torch.compile(module): its original, compiled in place
        self._check_module(module, "setup")
        check_optimizers_given(self._strategy, optimizers)
        self._ensure_environment()  # (the device of this rank is known from here)
        check_placement(self._strategy, module, move_to_device, "setup")
        agree_on_call(self, "setup", lambda: describe_module(module))
        originals = [check_optimizer(optimizer, index) for index, optimizer in enumerate(optimizers)]
        self._parameter_names = {
            id(parameter): name for name, parameter in module.named_parameters(remove_duplicate=False)
        }
        for index, optimizer in enumerate(originals):
            check_parameters_known(optimizer, index, self._parameter_names)

        def make_optimizers(set_up: nn.Module) -> tuple[list[Optimizer], list[Any]]:
            for optimizer in originals:
                rebind(optimizer, set_up, self._parameter_names, self._removed_names, self._strategy)
            return list(originals), []

        self._setup_strategy(module, make_optimizers if originals else None, compiled_with)
        wrapped = [wrap_optimizer(optimizer, self._optimizer_step) for optimizer in self._strategy.optimizers]
        return (self._module, *wrapped) if optimizers else self._module

    def setup_module(self, module: nn.Module, move_to_device: bool = True) -> CohortModule:
        """Set up ``module`` alone (create or pass its optimizers to ``setup_optimizers`` afterwards)."""
        module, compiled_with = unwrap_compiled(module)
        self._check_module(module, "setup_module")
        if self._strategy.traits.wraps_module_with_optimizers:
            raise RuntimeError(
                f"{type(self._strategy).__name__} builds one engine from the module and the optimizer together: call"
                " cohort.setup(module, optimizer) instead of setup_module."
            )
        self._ensure_environment()
        check_placement(self._strategy, module, move_to_device, "setup_module")
        agree_on_call(self, "setup_module", lambda: describe_module(module))
        self._parameter_names = {
            id(parameter): name for name, parameter in module.named_parameters(remove_duplicate=False)
        }
        self._setup_strategy(module, None, compiled_with)
        assert self._module is not None
        return self._module

    def setup_optimizers(self, *optimizers: Optimizer) -> Any:
        """Set up optimizers of the module given to ``setup_module`` (made on its plain or its set-up parameters)."""
        if self._module is None:
            raise RuntimeError("Cohort.setup_optimizers needs a module: call cohort.setup_module(module) first.")
        if self._strategy.optimizers:
            raise RuntimeError(
                "This Cohort's optimizers are already set up; pass all of them to one setup/setup_optimizers call."
            )
        if not optimizers:
            raise ValueError("Cohort.setup_optimizers needs at least one optimizer.")
        originals = [check_optimizer(optimizer, index) for index, optimizer in enumerate(optimizers)]
        set_up = self._strategy.module
        assert set_up is not None
        live = {id(parameter) for parameter in set_up.parameters()}
        for index, optimizer in enumerate(originals):
            if any(id(p) not in live for group in optimizer.param_groups for p in group["params"]):
                check_parameters_known(optimizer, index, self._parameter_names)
                rebind(optimizer, set_up, self._parameter_names, self._removed_names, self._strategy)
        self._strategy.optimizers = originals
        self._strategy.setup_precision_plugin()
        wrapped = [wrap_optimizer(optimizer, self._optimizer_step) for optimizer in self._strategy.optimizers]
        return wrapped[0] if len(wrapped) == 1 else tuple(wrapped)

    def _setup_strategy(
        self,
        module: nn.Module,
        make_optimizers: Callable[[nn.Module], tuple[list[Optimizer], list[Any]]] | None,
        compiled_with: Callable[..., Any] | None,  # a utilities.compile.Compiler
    ) -> None:
        self._ensure_environment()
        strategy = self._strategy
        attach(module, self)  # from here its self.log and self.device_mesh reach this Cohort
        configure_model = getattr(module, "configure_model", None)
        if is_training_module(module) and callable(configure_model):
            # As the Trainer does: the module builds or parallelises layers with the strategy's mesh (model_parallel),
            # created on the device, sharded where the strategy shards (DeepSpeed ZeRO-3).
            with strategy.tensor_init_context(), strategy.model_sharded_context():
                configure_model()
            # A pipeline stage keeps only its layers: optimizers made before setup drop the others' parameters.
            kept = {name for name, _ in module.named_parameters(remove_duplicate=False)}
            self._removed_names = set(self._parameter_names.values()) - kept
        strategy.connect(module)
        refuse_compiled_in_place(module, self._compile, "Cohort")
        compiler = compiler_for(self._compile, compiled_with, "Cohort")
        strategy.setup(
            RunSettings(
                stage="fit",
                configure_optimizers=make_optimizers,
                compile=compiler,
                compile_unit=None if self._compile is None else split_unit(self._compile)[1],
                optimizers_given=make_optimizers is not None,
                loop_position=self._live.read,
                load_loop_position=self._live.load,
            )
        )
        reason = slip_reason(strategy)
        self._module = CohortModule(strategy, BackwardGuard(reason) if reason is not None else None)

    def _check_module(self, module: Any, method: str) -> None:
        check_cohort_offered(self._strategy)
        if isinstance(module, CohortModule):
            raise ValueError(f"Cohort.{method}: this module was already set up by a Cohort; pass the plain module.")
        if self._module is not None:
            raise RuntimeError(
                f"Cohort.{method}: this Cohort already set up a module; one Cohort runs one module (put several in one"
                " nn.Module, e.g. nn.ModuleDict)."
            )
        if not isinstance(module, nn.Module):
            raise TypeError(f"Cohort.{method}(module) takes a torch.nn.Module, got {type(module).__name__}.")

    def _optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any] | None) -> Any:
        if closure is None:
            # The backward already ran (cohort.backward); precision plugins read a None result as a skipped batch.
            last_loss = self._last_loss
            closure = lambda: last_loss  # noqa: E731
        result = self._strategy.optimizer_step(optimizer, closure, model=self._strategy.model)
        first = self._strategy.optimizers and unwrap_optimizer(self._strategy.optimizers[0]) is optimizer
        if first and self._strategy.last_step_committed:
            self._optimizer_steps += 1
        return result

    def start_training(self, position: dict[str, int] | None = None) -> None:
        """Call after ``setup``, before the loop reads data. ``position`` (your loop's counters, e.g. ``{"step": 0}``)
        is what this process sends, with ``global_step``, to a peer that (re)joins; a strategy that heals joining
        processes from a live peer (``ddp_ft``) forms its first quorum here, and a process that joins a running job
        receives the peer's weights, optimizer state, ``global_step`` and counters (written into ``position``)."""
        if self._module is None:
            raise RuntimeError("Cohort.start_training needs a set-up module: call cohort.setup(...) first.")
        self._live.position = check_position(position)
        self._strategy.on_train_start()

    # ------------------------------------------------------------------ the step
    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        """Backward through the strategy (precision scaling, DeepSpeed's engine)."""
        if self._module is None:
            raise RuntimeError("Cohort.backward needs a set-up module: call cohort.setup(module, optimizer) first.")
        if not isinstance(loss, Tensor):
            raise TypeError(f"Cohort.backward(loss) takes a tensor, got {type(loss).__name__}.")
        with self._module.cohort_backward_context():
            self._strategy.backward(loss, None, *args, **kwargs)
        self._last_loss = loss.detach()
        record_loss(self, loss)

    forward_backward = forward_backward  # training_step and backward as the strategy's one step (cohort/step.py)

    def clip_gradients(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        clip_val: float | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
    ) -> Tensor | None:
        """Clip ``optimizer``'s gradients by total norm (``max_norm``, returns the norm) or by value (``clip_val``);
        ``error_if_nonfinite`` raises on a NaN/inf norm (it waits for the norm: a host-device sync)."""
        self._check_set_up(module, "clip_gradients")
        check_norm_arguments(norm_type, error_if_nonfinite)
        norm = self._strategy.clip_gradients(
            self._strategy.module, unwrap_optimizer(optimizer), max_norm=max_norm, clip_val=clip_val
        )
        if error_if_nonfinite and norm is not None:
            raise_if_nonfinite(norm)
        return norm

    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> AbstractContextManager:
        """Within it, backward does not synchronise gradients (for accumulation); ``enabled=False`` makes it a no-op."""
        self._check_set_up(module, "no_backward_sync")
        return self._strategy.block_backward_sync() if enabled else nullcontext()

    def autocast(self) -> AbstractContextManager:
        """The precision's forward context (autocast for mixed precision), for code outside the set-up forward."""
        return self._strategy.precision_plugin.forward_context()

    @contextmanager
    def init_module(self, empty_init: bool | None = None) -> Iterator[None]:
        """Create a module's tensors on ``device`` in the precision's dtype (sharded where the strategy shards);
        with ``empty_init=True`` their values are unspecified (uninitialised or not, per strategy) until loaded."""
        self._ensure_environment()
        with ExitStack() as stack:
            stack.enter_context(self._strategy.tensor_init_context(empty_init=empty_init))
            stack.enter_context(self._strategy.model_sharded_context())
            yield

    def _check_set_up(self, module: Any, method: str) -> None:
        if self._module is None or module is not self._module:
            raise ValueError(
                f"Cohort.{method}(module, ...) takes the module returned by cohort.setup(...), got"
                f" {type(module).__name__}."
            )

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, data: Any, group: Any | None = None, reduce_op: str = "mean") -> Any:
        """Reduce every tensor (and number) in ``data`` across processes with ``reduce_op`` ('mean', 'sum', 'max',
        'min')."""
        self._ensure_environment()
        return apply_to_tensors(
            self._as_tensors(data), lambda tensor: self._strategy.reduce(tensor, group=group, reduce_op=reduce_op)
        )

    def all_gather(self, data: Any, group: Any | None = None, sync_grads: bool = False) -> Any:
        """Gather every tensor (and number) in ``data`` from every process, stacked along a new first dimension."""
        self._ensure_environment()
        return apply_to_tensors(
            self._as_tensors(data), lambda tensor: self._strategy.all_gather(tensor, group=group, sync_grads=sync_grads)
        )

    def broadcast(self, obj: _T, src: int = 0) -> _T:
        """Send a picklable object from process ``src`` to every process and return it."""
        self._ensure_environment()
        agree_on_call(self, "broadcast", {"src": repr(src)})
        if self.world_size > 1 and (
            isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self.world_size
        ):
            raise ValueError(f"Cohort.broadcast(src={src!r}): src must be a rank, an int in [0, {self.world_size}).")
        return self._strategy.broadcast(obj, src=src)

    def barrier(self, name: str | None = None) -> None:
        """Wait until every process gets here."""
        self._ensure_environment()
        report_nonfinite(self, "barrier")
        agree_on_call(self, "barrier", patient=True)
        self._strategy.barrier(name)

    def _as_tensors(self, data: Any) -> Any:
        if isinstance(data, (int, float)) and not isinstance(data, bool):
            return torch.tensor(data, device=self.device)
        return apply_to_tensors(data, lambda tensor: tensor.to(self.device))

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str | PathLike, state: dict[str, Any], filter: StateFilter | None = None) -> None:
        """Write ``state`` (modules, optimizers, objects) in the Trainer's checkpoint format, full or sharded as the
        strategy does; ``filter`` (Fabric's): per state key, ``(name, value) -> bool`` selects state-dict entries.
        Before ``setup``, the plain module and optimizers are saved (rank zero writes)."""
        check_path(path, "save")
        self._ensure_environment()
        report_nonfinite(self, "save")
        agree_on_call(self, "save", {"path": os.fspath(path)})
        if self._module is None:
            save_before_setup(self._strategy, path, state, self._optimizer_steps, filter)
            return
        checkpoint = build_checkpoint(state, self._strategy, self._optimizer_steps, filter)
        self._strategy.save_checkpoint(checkpoint, path)
        self._strategy.barrier("Cohort.save")  # nobody reads the file before it is whole

    def load(
        self,
        path: str | PathLike,
        state: dict[str, Any] | None = None,
        *,
        strict: bool = True,
        restore_rng: bool = True,
    ) -> dict[str, Any]:
        """Load a Cohort or Trainer checkpoint into ``state``'s objects (plain values replaced in ``state``) and, with
        ``restore_rng``, this process's generator states; returns unread objects (all of them without a state).
        Before ``setup``, a checkpoint file loads into the plain module and optimizers."""
        check_path(path, "load")
        if not isinstance(restore_rng, bool):
            raise TypeError(f"Cohort.load(restore_rng={restore_rng!r}) must be True or False.")
        self._ensure_environment()
        # Every rank reads the same checkpoint, or none does: ranks that load different weights train apart silently.
        agree_on_call(self, "load", lambda: {"path": os.fspath(path), "checkpoint": checkpoint_identity(path)})
        if self._module is None:
            return load_before_setup(self, path, {} if state is None else state, strict=strict, restore_rng=restore_rng)
        checkpoint = self._strategy.load_checkpoint(path)
        refuse_plain_state_dict(checkpoint, str(path))
        # Checked before anything is restored; None when the writer stored none for this rank (the RNG is untouched).
        rng_states = own_rng_states(checkpoint, self.global_rank, str(path)) if restore_rng else None
        state = {} if state is None else state
        remaining = restore_checkpoint(checkpoint, state, self._strategy, str(path), strict=strict)
        self._continue_dataloaders(checkpoint)
        # DeepSpeed's optimizers are no torch Optimizers: they are recognised as the strategy's.
        if any(optimizer_index(value, self._strategy) is not None for value in state.values()):
            step = checkpoint.get("global_step")
            self._optimizer_steps = step if isinstance(step, int) else self._optimizer_steps
        if rng_states is not None:
            # Last, so that nothing of the loading draws from them: the loop goes on from the state of the save.
            restore_rng_states(rng_states)
        return remaining

    def load_raw(self, path: str | PathLike, obj: nn.Module, strict: bool = True) -> None:
        """Load a plain ``torch.save(model.state_dict())`` file (e.g. pretrained weights, after
        ``init_module(empty_init=True)``) into the set-up module; every rank calls it and keeps its shard."""
        if self._module is None:
            raise RuntimeError("Cohort.load_raw needs a set-up module: call cohort.setup(...) first.")
        if isinstance(path, (str, PathLike)):  # (load_raw says what else is wrong)
            agree_on_call(self, "load_raw", lambda: {"path": os.fspath(path), "checkpoint": checkpoint_identity(path)})
        load_raw(self._strategy, path, obj, strict=strict)

    def __repr__(self) -> str:
        return f"Cohort(strategy={self._strategy!r})"
