"""The Strategy: how a module is placed, wrapped, stepped and checkpointed.

A strategy never sees the object that drives it (the Trainer, or your own loop): it receives the module in
``connect``, the run's settings in ``setup`` (a :class:`~phalanx.strategies.settings.RunSettings`), and everything
else as explicit arguments of its methods.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Iterator, TypeVar

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from phalanx.accelerators.accelerator import Accelerator
from phalanx.optimization import LRSchedulerConfig
from phalanx.plugins.io.checkpoint_io import CheckpointIO
from phalanx.plugins.io.torch_io import TorchCheckpointIO
from phalanx.plugins.precision.precision import Precision
from phalanx.plugins.precision.selection import precision_plugin_for
from phalanx.strategies.forward_redirection import evaluation_grad_mode, redirect_forward
from phalanx.strategies.settings import RunSettings, check_run_settings
from phalanx.strategies.traits import StrategyTraits, legacy_trait_overrides
from phalanx.utilities.apply import move_to_device
from phalanx.utilities.compile import CompileUnit, compile_in_place, describe_targets
from phalanx.utilities.init import empty_init_context
from phalanx.utilities.optimizer_names import state_by_position
from phalanx.utilities.rank_zero import rank_zero_info

if TYPE_CHECKING:
    from phalanx.strategies.contract_types import Launcher, PathLike, ProcessGroup, Registry, TrainingModule

_T = TypeVar("_T")
_NO_CONTEXT = nullcontext()
_DEFAULT_TRAITS = StrategyTraits()


class Strategy(ABC):
    """Base class of every strategy; composes an Accelerator, a Precision plugin and a CheckpointIO."""

    #: The precision plugins this strategy can run with (strategies that own mixed precision narrow it).
    precision_plugin_type: type[Precision] = Precision
    #: The family whose members share a device runtime (the XLA strategies say "xla"); an accelerator that runs only
    #: one family (``Accelerator.strategy_family``) refuses the others.
    family: ClassVar[str | None] = None
    #: Whether the strategy runs several processes that communicate (refused where ``Accelerator.max_processes`` is 1).
    multi_process: ClassVar[bool] = False
    #: What ``compile_module`` compiles unless ``compile={"unit": ...}`` says: "model" (the module holding the repeated
    #: blocks, as users compile it by hand) where nothing needs the block boundaries; docs/compile.md has the figures.
    default_compile_unit: ClassVar[CompileUnit] = "model"
    #: False after an optimizer step that was declined (a fault-tolerance quorum did not commit it): the loops then
    #: count no step and step no scheduler for it. Strategies that always step leave the class's True.
    last_step_committed: bool = True

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        self._accelerator = accelerator
        self._checkpoint_io = checkpoint_io
        self._precision_plugin: Precision | None = None
        self.precision_plugin = precision_plugin
        self._module: TrainingModule | None = None
        self._model: nn.Module | None = None
        self._launcher: Launcher | None = None
        self._run_settings: RunSettings | None = None
        self.optimizers: list[Optimizer] = []
        self.lr_scheduler_configs: list[LRSchedulerConfig] = []

    # ------------------------------------------------------------------ composed parts
    @property
    def accelerator(self) -> Accelerator | None:
        """The device plugin."""
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator: Accelerator | None) -> None:
        self._accelerator = accelerator

    @property
    def checkpoint_io(self) -> CheckpointIO:
        """The checkpoint IO plugin (TorchCheckpointIO unless one was given)."""
        if self._checkpoint_io is None:
            self._checkpoint_io = TorchCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    @property
    def precision_plugin(self) -> Precision:
        """The precision plugin (float32 unless one was given)."""
        if self._precision_plugin is None:
            self._precision_plugin = self.precision_plugin_type()
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        required = self.precision_plugin_type
        if precision_plugin is not None and not isinstance(precision_plugin, required):
            name = required.__name__
            raise TypeError(
                f"{type(self).__name__} runs with {name} plugins only, got {type(precision_plugin).__name__}."
                f" Pass precision= (a precision name such as 'bf16-mixed') to the Trainer, or a {name} instance as"
                " precision_plugin."
            )
        self._precision_plugin = precision_plugin

    @classmethod
    def precision_plugin_for(cls, precision: str, accelerator: Accelerator) -> Precision:
        """The precision plugin this strategy needs for the precision name ``precision`` on ``accelerator``."""
        return precision_plugin_for(precision, accelerator)

    @property
    def launcher(self) -> Launcher | None:
        """How extra processes are started; None runs everything in this process."""
        return self._launcher

    # ------------------------------------------------------------------ the model
    @property
    def module(self) -> TrainingModule | None:
        """The user's module (a TrainingModule under the Trainer, any nn.Module in your own loop), unwrapped."""
        return self._module

    @property
    def model(self) -> nn.Module | None:
        """The module as the strategy runs it: possibly wrapped (DDP, FSDP, ...)."""
        return self._model if self._model is not None else self._module

    @model.setter
    def model(self, model: nn.Module | None) -> None:
        self._model = model

    def connect(self, model: nn.Module) -> None:
        """Take ownership of the user's module (a TrainingModule learns its strategy, for ``clip_gradients``)."""
        self._module = model  # type: ignore[assignment]
        self._model = model
        # Lazy for import time: `import phalanx.strategies` (and the Cohort) does not load the TrainingModule.
        from phalanx.module import TrainingModule

        if isinstance(model, TrainingModule):
            # A plain attribute: not a submodule, not in the state dict (nn.Module.__setattr__ is bypassed).
            model.__dict__["_strategy"] = self

    @property
    def run_settings(self) -> RunSettings | None:
        """The settings of the last ``setup`` (None before it)."""
        return self._run_settings

    @property
    def device_mesh(self) -> Any:
        """The DeviceMesh the module is parallelised over (axes named by ``MeshAxis``), or None without one."""
        return self.__dict__.get("_device_mesh")

    @device_mesh.setter
    def device_mesh(self, mesh: Any) -> None:
        self._device_mesh = mesh

    # ------------------------------------------------------------------ abstract contract
    @property
    @abstractmethod
    def root_device(self) -> torch.device:
        """The device this process computes on."""

    @abstractmethod
    def model_to_device(self) -> None:
        """Move the module to ``root_device``."""

    @property
    @abstractmethod
    def is_global_zero(self) -> bool:
        """Whether this is the process of global rank 0."""

    @abstractmethod
    def reduce(self, tensor: Tensor | Any, group: ProcessGroup | None = None, reduce_op: str | None = "mean") -> Any:
        """Reduce ``tensor`` across processes with ``reduce_op`` ('mean', 'sum', 'max', 'min')."""

    @abstractmethod
    def barrier(self, name: str | None = None) -> None:
        """Wait until every process reaches this point."""

    @abstractmethod
    def broadcast(self, obj: _T, src: int = 0) -> _T:
        """Send ``obj`` from process ``src`` to all others and return it."""

    @abstractmethod
    def all_gather(self, tensor: Tensor, group: ProcessGroup | None = None, sync_grads: bool = False) -> Tensor:
        """Gather ``tensor`` from every process, stacked along a new first dimension (unchanged on one process)."""

    # ------------------------------------------------------------------ ranks (one process unless overridden)
    @property
    def global_rank(self) -> int:
        """This process's rank among all processes."""
        return 0

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""
        return 0

    @property
    def node_rank(self) -> int:
        """This node's rank."""
        return 0

    @property
    def world_size(self) -> int:
        """Number of processes."""
        return 1

    @property
    def num_nodes(self) -> int:
        """Number of nodes."""
        return 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        """``DistributedSampler(dataset, **kwargs)`` arguments (``num_replicas``, ``rank``); None: data not split."""
        return None

    def all_gather_object(self, obj: _T) -> list[_T]:
        """Gather a picklable object from every process (one element per rank)."""
        return [obj]

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        """Combine a decision across processes: True if all (or any, with ``all=False``) processes decided True."""
        return decision

    def twin_for_tuning(self) -> Strategy | None:
        """A new strategy like this one for the tuner's short fits in these processes; None (default): cannot tune."""
        return None

    def host_reads(self) -> AbstractContextManager:
        """Context for reading device values on the host outside a step (checks at save points); nothing by default."""
        return nullcontext()

    # ------------------------------------------------------------------ set-up: one fixed order of named steps
    # check_setup -> prepare_module -> compile_module -> place_module -> wrap_module_and_optimizers (wrap_module, then
    # setup_optimizers when fitting) -> setup_precision_plugin -> finish_setup. Strategies override steps, not setup.
    def setup(self, settings: RunSettings) -> None:
        """Set the module up for a run in the fixed order of the steps; strategies override the steps, not this."""
        self.check_setup(settings)
        self._start_setup(settings)
        assert self._module is not None
        # A step may swap the module's layers but hands back the same TrainingModule the strategy connected.
        module = self.prepare_module(self._module, settings)
        self._module = self._model = module  # type: ignore[assignment]
        self.compile_module(module, settings)
        self.place_module(settings)
        self.wrap_module_and_optimizers(settings)
        self.setup_precision_plugin()
        self.finish_setup(settings)

    def _start_setup(self, settings: RunSettings) -> None:
        """Checks that no step may skip (the arguments, the composed parts), then the accelerator prepares."""
        check_run_settings(type(self).__name__, settings)
        if self.accelerator is None:
            raise RuntimeError(
                f"{type(self).__name__} has no accelerator: give it one (accelerator=...) before setup()."
            )
        if self._module is None:
            raise RuntimeError(f"{type(self).__name__}.setup() needs a module: call connect(module) first.")
        self._run_settings = settings
        self.accelerator.setup()

    def _begin_setup(self, settings: RunSettings) -> None:
        """Deprecated: strategies no longer override ``setup``; override its steps (see docs/adding-a-strategy.md)."""
        warnings.warn(
            f"{type(self).__name__} calls Strategy._begin_setup, deprecated and removed in the next release. "
            "Do not override setup(): override its steps instead"
            " (check_setup, prepare_module, place_module, wrap_module, wrap_module_and_optimizers, finish_setup).",
            DeprecationWarning,
            stacklevel=2,
        )
        self._start_setup(settings)

    def check_setup(self, settings: RunSettings) -> None:
        """Step 0, before anything changes: refuse settings or options this strategy cannot run (nothing by default)."""

    def prepare_module(self, module: nn.Module, settings: RunSettings) -> nn.Module:
        """Step 1, before placement: convert the module (precision, layer sync, sharding); returns the module to use."""
        return self.precision_plugin.convert_module(module)

    def compile_module(self, module: nn.Module, settings: RunSettings) -> None:
        """Step 1b, before wrapping: compile ``settings.compile_unit`` (else ``default_compile_unit``) in place."""
        if settings.compile is None:
            return
        unit = settings.compile_unit or self.default_compile_unit
        targets = compile_in_place(module, settings.compile, unit)
        chosen = "compile={'unit': ...}" if settings.compile_unit else f"{type(self).__name__}'s default"
        rank_zero_info(describe_targets(module, targets, unit, chosen))

    def place_module(self, settings: RunSettings) -> None:
        """Step 2: put the module on its device (``model_to_device`` by default)."""
        self.model_to_device()

    def wrap_module_and_optimizers(self, settings: RunSettings) -> None:
        """Step 3: ``wrap_module``, then the optimizers when fitting (override both where one engine needs both)."""
        assert self._module is not None
        self._model = self.wrap_module(self._module, settings)
        if settings.fitting:
            self.setup_optimizers(settings)

    def wrap_module(self, module: nn.Module, settings: RunSettings) -> nn.Module:
        """The module that the steps run through (a wrapper such as DistributedDataParallel); ``module`` by default."""
        return module

    def setup_optimizers(self, settings: RunSettings) -> None:
        """Create the optimizers and LR scheduler configs with ``settings.configure_optimizers`` (none without it)."""
        factory = settings.configure_optimizers
        if factory is None:
            return
        assert self._module is not None
        self.optimizers, self.lr_scheduler_configs = factory(self._module)

    def setup_precision_plugin(self) -> None:
        """Step 4: let the precision plugin wrap the model, optimizers and schedulers."""
        assert self.model is not None
        model, optimizers, _ = self.precision_plugin.connect(self.model, self.optimizers, self.lr_scheduler_configs)
        self._model = model
        self.optimizers = optimizers

    def finish_setup(self, settings: RunSettings) -> None:
        """Step 5, last: anything that needs the finished set-up (e.g. joining a swarm with the optimizers)."""

    # ------------------------------------------------------------------ lifecycle
    def setup_environment(self) -> None:
        """Prepare the process: select the device (and, for parallel strategies, join the process group)."""
        assert self.accelerator is not None, "the Trainer attaches an accelerator before setup"
        self.accelerator.setup_device(self.root_device)

    def teardown(self) -> None:
        """Release the device and plugins; the module and optimizers stay usable (e.g. for save_checkpoint)."""
        self.precision_plugin.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # ------------------------------------------------------------------ steps
    def batch_to_device(self, batch: object, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Move a batch to ``device`` (the root device by default) and convert it to the precision's dtype."""
        batch = move_to_device(batch, device or self.root_device)
        return (self._precision_plugin or self.precision_plugin).convert_input(batch)  # the property: first read only

    def _run_step(self, method: str, context: AbstractContextManager, *args: Any, **kwargs: Any) -> Any:
        """Call the module's step ``method`` inside ``context``, through the wrapper when there is one."""
        with context:
            if self._model is not None and self._module is not None and self._model is not self._module:
                # The wrapper's forward must run so that its hooks (gradient sync, parameter gathering) fire.
                return redirect_forward(self._model, self._module, method, *args, **kwargs)
            return getattr(self._module, method)(*args, **kwargs)

    def naming_collectives(self, phase: str) -> AbstractContextManager:
        """Context around a step's ``phase`` ('forward', 'backward', 'optimizer_step') that names failed collectives."""
        return _NO_CONTEXT  # one reusable context rather than a new one three times per step

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's ``training_step`` under the precision's context."""
        precision = self._precision_plugin or self.precision_plugin
        if self._plain_run_step and precision._plain_forward and (self._model is None or self._model is self._module):
            # No context to enter, no wrapper to go through, no collective naming: the module's own step, directly.
            return self._module.training_step(*args, **kwargs)  # type: ignore[union-attr]  # None: as _run_step
        context = precision.train_step_context()
        if not self._names_collectives:
            return self._run_step("training_step", context, *args, **kwargs)
        with self.naming_collectives("forward"):
            return self._run_step("training_step", context, *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's ``validation_step`` under the precision's context."""
        with self.naming_collectives("forward"), evaluation_grad_mode(self):
            return self._run_step("validation_step", self.precision_plugin.val_step_context(), *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's ``test_step`` under the precision's context."""
        with self.naming_collectives("forward"), evaluation_grad_mode(self):
            return self._run_step("test_step", self.precision_plugin.test_step_context(), *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module's ``predict_step`` under the precision's context."""
        with self.naming_collectives("forward"), evaluation_grad_mode(self):
            return self._run_step("predict_step", self.precision_plugin.predict_step_context(), *args, **kwargs)

    def forward_backward(
        self, batch: Any, batch_idx: int, between: Callable[[Any], Tensor | None], optimizer: Optimizer | None
    ) -> tuple[Tensor | None, Any]:
        """Turn a batch into a loss and gradients: training_step, the driver's between(output), then backward."""
        # One named step that turns a batch into a loss and gradients: a strategy that runs both halves in one call (a
        # pipeline schedule) overrides it; ``between`` is the driver's work in the middle (loss division, non-finite
        # checks, on_before_backward), handed in as RunSettings.before_optimizer_step hands in the optimizer's hooks.
        output = self.training_step(batch, batch_idx)
        loss = between(output)
        if loss is not None:
            self.backward(loss, optimizer)
        return loss, output

    def pre_backward(self, closure_loss: Tensor) -> None:
        """Called before backward."""

    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Run backward on the loss through the precision plugin."""
        precision = self._precision_plugin or self.precision_plugin
        if self._plain_backward_hooks and precision._plain_backward_hooks and not self._names_collectives:
            # pre_backward and post_backward of both are the base's pass-throughs: four calls per step for nothing.
            precision.backward(closure_loss, self._module, optimizer, *args, **kwargs)
            return closure_loss
        self.pre_backward(closure_loss)
        closure_loss = precision.pre_backward(closure_loss, self._module)
        if not self._names_collectives:
            precision.backward(closure_loss, self._module, optimizer, *args, **kwargs)
        else:
            with self.naming_collectives("backward"):
                precision.backward(closure_loss, self._module, optimizer, *args, **kwargs)
        closure_loss = precision.post_backward(closure_loss, self._module)
        self.post_backward(closure_loss)
        return closure_loss

    def post_backward(self, closure_loss: Tensor) -> None:
        """Called after backward."""

    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: nn.Module | None = None, **kwargs: Any
    ) -> Any:
        """Step ``optimizer`` through the precision plugin, which runs ``closure``, then ``before_optimizer_step``."""
        precision = self._precision_plugin or self.precision_plugin
        if self._plain_before_step:  # _before_optimizer_step's body, without a call per step
            before_step = self._run_settings.before_optimizer_step if self._run_settings is not None else None
        else:
            before_step = self._before_optimizer_step()
        module = model if model is not None else self._module
        if not self._names_collectives:
            return precision.optimizer_step(optimizer, model=module, closure=closure, before_step=before_step, **kwargs)
        with self.naming_collectives("optimizer_step"):
            return precision.optimizer_step(optimizer, model=module, closure=closure, before_step=before_step, **kwargs)

    def _before_optimizer_step(self) -> Callable[[Optimizer], None] | None:
        """The run's ``before_optimizer_step`` callback, or None (none given, or before ``setup``)."""
        return self._run_settings.before_optimizer_step if self._run_settings is not None else None

    def clip_gradients(
        self,
        module: nn.Module | None,
        optimizer: Optimizer,
        *,
        max_norm: float | None = None,
        clip_val: float | None = None,
    ) -> Tensor | None:
        """Clip ``optimizer``'s gradients to total norm ``max_norm`` (returns the norm) or to ``clip_val`` by value."""
        if (max_norm is None) == (clip_val is None):
            raise ValueError(
                "clip_gradients takes exactly one of max_norm= (clip by total norm) or clip_val= (clip by value); got"
                f" max_norm={max_norm!r}, clip_val={clip_val!r}."
            )
        name, value = ("max_norm", max_norm) if max_norm is not None else ("clip_val", clip_val)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"clip_gradients({name}={value!r}) must be a number.")
        if value < 0:
            raise ValueError(f"clip_gradients({name}={value!r}) must be >= 0 (0 does not clip).")
        optimizer = getattr(optimizer, "optimizer", optimizer)  # the Trainer's ManualOptimizer wraps it
        return self.precision_plugin.clip_gradients(optimizer, value, "norm" if name == "max_norm" else "value")

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Return ``optimizer``'s state for a checkpoint (sharded strategies consolidate it first)."""
        return optimizer.state_dict()

    def block_backward_sync(self) -> AbstractContextManager:
        """Context for the batches that do not end an accumulation window: backward skips gradient sync (none here)."""
        return nullcontext()

    def process_dataloader(self, dataloader: Iterable[Any]) -> Iterable[Any]:
        """Give the strategy a chance to wrap a dataloader."""
        return dataloader

    # ------------------------------------------------------------------ checkpoints
    def module_state_dict(self) -> dict[str, Any]:
        """Return the module's state dict (full, on this process)."""
        assert self._module is not None
        return self._module.state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: PathLike, storage_options: object = None) -> None:
        """Write ``checkpoint`` through the CheckpointIO, once (on global rank 0)."""
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: PathLike) -> dict[str, Any]:
        """Read a checkpoint through the CheckpointIO."""
        return self.checkpoint_io.load_checkpoint(checkpoint_path)

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        """Load the module weights from ``checkpoint['state_dict']``."""
        assert self._module is not None
        self._module.load_state_dict(checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Load the optimizers' states from ``checkpoint['optimizer_states']``."""
        if len(states := checkpoint["optimizer_states"]) != len(self.optimizers):
            raise ValueError(
                f"The checkpoint holds {len(states)} optimizer state(s) but configure_optimizers created"
                f" {len(self.optimizers)}; resume with the same optimizer configuration."
            )
        for optimizer, state in zip(self.optimizers, states):  # a pipeline's states name their parameters
            optimizer.load_state_dict(state_by_position(optimizer, self._module, state))

    def remove_checkpoint(self, filepath: PathLike) -> None:
        """Delete a checkpoint, once (on global rank 0)."""
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)

    # ------------------------------------------------------------------ creating parameters
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """Create tensors on the root device, in the precision's dtype; ``empty_init=True`` skips initialisation."""
        with ExitStack() as stack:
            if self.root_device.type != "cpu":
                stack.enter_context(self.root_device)
            stack.enter_context(empty_init_context(bool(empty_init)))
            stack.enter_context(self.precision_plugin.tensor_init_context())
            yield

    def model_sharded_context(self) -> AbstractContextManager:
        """Context in which ``configure_model`` may create a sharded model (nothing to shard here)."""
        return nullcontext()

    # ------------------------------------------------------------------ what the loops consult
    _legacy_traits: ClassVar[tuple[str, ...]] = ()
    _names_collectives: ClassVar[bool] = False  # naming_collectives overridden; else steps skip its empty context
    # Which step methods a subclass left as the base's, so that a step skips the layers that would do nothing there.
    _plain_run_step: ClassVar[bool] = True  # _run_step and naming_collectives
    _plain_backward_hooks: ClassVar[bool] = True  # pre_backward and post_backward
    _plain_before_step: ClassVar[bool] = True  # _before_optimizer_step

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Out-of-tree strategies written before ``traits`` override the separate properties: read them for a release.
        cls._legacy_traits = legacy_trait_overrides(cls, Strategy)
        cls._names_collectives = cls.naming_collectives is not Strategy.naming_collectives
        cls._plain_run_step = not cls._names_collectives and cls._run_step is Strategy._run_step
        cls._plain_backward_hooks = (
            cls.pre_backward is Strategy.pre_backward and cls.post_backward is Strategy.post_backward
        )
        cls._plain_before_step = cls._before_optimizer_step is Strategy._before_optimizer_step

    @property
    def traits(self) -> StrategyTraits:
        """What the loops need to know about this strategy (``declare_traits``; read at the time they need it)."""
        declared = self.declare_traits()
        if not self._legacy_traits:
            return declared
        return replace(declared, **{name: getattr(self, name) for name in self._legacy_traits})

    def declare_traits(self) -> StrategyTraits:
        """Override to declare this strategy's traits: ``dataclasses.replace(super().declare_traits(), flag=...)``."""
        return _DEFAULT_TRAITS

    # Deprecated (read ``traits``; override ``declare_traits``): the separate flags, kept for one release.
    @property
    def handles_gradient_accumulation(self) -> bool:
        """Deprecated: ``traits.handles_gradient_accumulation``."""
        return self.declare_traits().handles_gradient_accumulation

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Deprecated: ``traits.restore_checkpoint_after_setup``."""
        return self.declare_traits().restore_checkpoint_after_setup

    @property
    def restores_optimizer(self) -> bool:
        """Deprecated: ``traits.restores_optimizer``."""
        return self.declare_traits().restores_optimizer

    @property
    def needs_train_batch_size(self) -> bool:
        """Deprecated: ``traits.needs_train_batch_size``."""
        return self.declare_traits().needs_train_batch_size

    @property
    def requires_equal_batches(self) -> bool:
        """Deprecated: ``traits.requires_equal_batches``."""
        return self.declare_traits().requires_equal_batches

    @property
    def pads_evaluation(self) -> bool:
        """Deprecated: ``traits.pads_evaluation``."""
        return self.declare_traits().pads_evaluation

    @property
    def allows_inference_mode(self) -> bool:
        """Deprecated: ``traits.allows_inference_mode``."""
        return self.declare_traits().allows_inference_mode

    @property
    def wraps_module_with_optimizers(self) -> bool:
        """Deprecated: ``traits.wraps_module_with_optimizers``."""
        return self.declare_traits().wraps_module_with_optimizers

    # ------------------------------------------------------------------ hooks
    def on_train_start(self) -> None:
        """Called when training starts."""

    def on_train_end(self) -> None:
        """Called when training ends."""

    def on_validation_start(self) -> None:
        """Called when validation starts."""

    def on_validation_end(self) -> None:
        """Called when validation ends."""

    def on_test_start(self) -> None:
        """Called when testing starts."""

    def on_test_end(self) -> None:
        """Called when testing ends."""

    def on_predict_start(self) -> None:
        """Called when predicting starts."""

    def on_predict_end(self) -> None:
        """Called when predicting ends."""

    def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
        """Called before each training batch, after the user's ``on_train_batch_start`` hooks (also after a -1)."""

    def on_exception(self, exception: BaseException) -> None:
        """Called when the run raises; may translate the error into a more helpful one."""

    @classmethod
    def register_strategies(cls, registry: Registry[Strategy]) -> None:
        """Register this strategy's names in ``registry``."""

    def __repr__(self) -> str:
        accelerator, precision = type(self.accelerator).__name__, self.precision_plugin.precision
        return f"{type(self).__name__}(accelerator={accelerator}, precision={precision!r})"
