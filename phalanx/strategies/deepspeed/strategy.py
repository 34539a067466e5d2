"""DeepSpeedStrategy: ZeRO stages 0-3 and CPU/NVMe offload through DeepSpeed's engine (optional extra).

``pip install 'phalanx[deepspeed]'`` installs DeepSpeed. This module never imports deepspeed at import time: the
strategy imports it when a process joins the job (``setup_environment``), so ``import phalanx`` stays cheap and the
registry can list the DeepSpeed names on machines without it.

How DeepSpeed's differences reach the loops (which never look at the strategy's type; they read its ``traits``):

- ``traits.handles_gradient_accumulation`` is True: the loop steps every batch and the engine accumulates. The loop
  runs the batches that do not end an accumulation window inside ``block_backward_sync`` (the same windows as DDP:
  every ``accumulate_grad_batches`` batches and at the end of an epoch), and the strategy tells the engine, so
  gradients match a DDP run. ``global_step`` counts batches, as in Lightning; schedulers with ``interval='step'``
  step once per optimizer update.
- backward and the optimizer step go through the engine (``engine.backward``, ``engine.step``), via
  ``DeepSpeedPrecision``; the optimizer handle's ``zero_grad`` does nothing because the engine zeroes gradients itself
  after each update.
- checkpoints are directories (see ``phalanx.plugins.io.formats.deepspeed``): every rank writes its partitions, the
  Trainer's state goes beside them, and ``.complete`` is written last. Resuming lets the engine read its files
  (``traits.restore_checkpoint_after_setup``); the LR schedulers are restored by the Trainer from the saved state.
- under ZeRO-3 every forward pass gathers parameters collectively: evaluation data is padded
  (``traits.pads_evaluation``), the driver checks the batch counts at the start of each evaluation
  (``traits.requires_equal_batches``), and evaluation steps run under ``no_grad`` instead of inference mode
  (parameters gathered in inference mode could not be used by training afterwards).

The config is built (and the arguments checked) in :mod:`~phalanx.strategies.deepspeed._config`, the optimizer handle
and scheduler proxy live in :mod:`~phalanx.strategies.deepspeed._engine`, and checkpoints are read and written by a
``_DeepSpeedCheckpoints`` the strategy owns (:mod:`~phalanx.strategies.deepspeed._checkpoints`).
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import replace
from datetime import timedelta
from functools import partial
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn

from phalanx.accelerators.accelerator import Accelerator
from phalanx.plugins.environments.cluster_environment import ClusterEnvironment
from phalanx.plugins.io.checkpoint_io import CheckpointIO
from phalanx.plugins.io.formats.deepspeed import OPTIMIZER_MARKER
from phalanx.plugins.precision.deepspeed import DEEPSPEED_PRECISIONS, DeepSpeedPrecision
from phalanx.plugins.precision.precision import Precision
from phalanx.strategies.deepspeed._activation import (
    activation_settings,
    configure_activation_checkpointing,
    merge_activation_section,
)
from phalanx.strategies.deepspeed._checkpoints import _DeepSpeedCheckpoints
from phalanx.strategies.deepspeed._config import (
    CONFIG_ENV_VAR,
    checked_flag,
    checked_gradient_clipping,
    checked_logging_batch_size,
    complete_config,
    generated_config,
    load_config,
    micro_batch_size,
    partitioning_config,
    zero_settings,
)
from phalanx.strategies.deepspeed._engine import (
    DeepSpeedOptimizerHandle,
    engine_optimizer,
    memory_footprint,
    overrides,
    partitioned_parameters,
    scheduler_configs_for_engine,
)
from phalanx.strategies.parallel import DEFAULT_TIMEOUT, ParallelStrategy
from phalanx.strategies.settings import RunSettings
from phalanx.strategies.strategy import Strategy
from phalanx.strategies.traits import StrategyTraits
from phalanx.utilities import distributed
from phalanx.utilities.init import empty_init_context
from phalanx.utilities.rank_zero import rank_zero_warn
from phalanx.utilities.registry import Registry

INSTALL_HINT = "pip install 'phalanx[deepspeed]'"


def deepspeed_available() -> bool:
    """Whether the deepspeed package can be imported (checked without importing it)."""
    return importlib.util.find_spec("deepspeed") is not None


def _import_deepspeed() -> Any:
    if not deepspeed_available():
        raise ModuleNotFoundError(
            "The DeepSpeed strategies need the deepspeed package, which is not installed. Install it with:"
            f" {INSTALL_HINT}"
            " (DeepSpeed builds against your installed torch: add --no-build-isolation if pip tries to download"
            " another torch)."
        )
    import deepspeed

    return deepspeed


class DeepSpeedStrategy(ParallelStrategy):
    """ZeRO data parallelism through DeepSpeed: stage 1 partitions optimizer states, 2 also gradients, 3 also
    parameters.

    Args:
        stage: ZeRO stage 0 (plain data parallelism through the engine), 1, 2 or 3.
        offload_optimizer: keep optimizer states (and the step) on ``offload_optimizer_device`` (stage >= 1).
        offload_parameters: keep parameters on ``offload_params_device`` between uses (stage 3).
        remote_device: where ZeRO-3 puts parameters as they are created in ``configure_model`` ('cpu', 'nvme';
            None: the process's device).
        offload_params_device, offload_optimizer_device: 'cpu' or 'nvme' (NVMe needs ``nvme_path``).
        allgather_bucket_size, reduce_bucket_size, contiguous_gradients, overlap_comm, allgather_partitions,
        reduce_scatter, sub_group_size, pin_memory, params_buffer_count, params_buffer_size, max_in_cpu,
        optimizer_buffer_count: the ZeRO settings of the same names.
        param_persistence_threshold: ZeRO-3 keeps parameters with fewer elements than this gathered on every
            process (``stage3_param_persistence_threshold``).
        loss_scale, initial_scale_power, loss_scale_window, hysteresis, min_loss_scale: float16 loss scaling
            (``loss_scale=0`` scales dynamically).
        partition_activations, cpu_checkpointing, contiguous_memory_optimization, synchronize_checkpoint_boundary:
            DeepSpeed activation checkpointing (the config's ``activation_checkpointing`` section, handed to
            ``deepspeed.checkpointing.configure``); they apply where the model calls
            ``deepspeed.checkpointing.checkpoint``. See :mod:`phalanx.strategies.deepspeed._activation`.
        config: a full DeepSpeed config (dict, or path of a JSON file; default: the file named by
            ``PHALANX_DEEPSPEED_CONFIG_PATH``). It replaces the one built from the arguments above; the Trainer
            still fills in batch size, gradient accumulation, clipping and precision where the config leaves them out.
        logging_batch_size_per_gpu: the per-process batch size DeepSpeed reports ('auto': the training dataloader's).
        zero_allow_untested_optimizer: let ZeRO drive optimizers DeepSpeed has not tested (e.g. SGD).
        exclude_frozen_parameters: leave parameters without gradients out of checkpoints.
        logging_level: level of DeepSpeed's logger.
        allow_unsafe_checkpoint_load: when resuming, let DeepSpeed read its files its own way, unpickling arbitrary
            objects (any code the files' author chose runs). By default phalanx reads every file DeepSpeed asks for
            with ``weights_only=True`` (DeepSpeed's record types allowed), keeps every name inside the checkpoint
            directory, and refuses the resumes DeepSpeed would read past that (universal checkpoints, MoE experts).
            Set it only for checkpoints you wrote yourself.
        gradient_clipping: clip gradients to this total norm inside the engine (the config's ``gradient_clipping``,
            also with a given ``config``, which must not set another value); None: the config's or the Trainer's
            ``gradient_clip_val``, else no clipping.
    """

    step_collectives = {
        "forward": "DeepSpeed forward (ZeRO-3 parameter all-gather)",
        "backward": "DeepSpeed gradient reduction (backward)",
        "optimizer_step": "DeepSpeed optimizer step (partition all-gather)",
    }

    precision_plugin_type = DeepSpeedPrecision

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        stage: int = 2,
        remote_device: str | None = None,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        offload_params_device: str = "cpu",
        nvme_path: str | os.PathLike = "/local_nvme",
        params_buffer_count: int = 5,
        params_buffer_size: int = 100_000_000,
        max_in_cpu: int = 1_000_000_000,
        offload_optimizer_device: str = "cpu",
        optimizer_buffer_count: int = 4,
        pin_memory: bool = False,
        sub_group_size: int = 1_000_000_000_000,
        param_persistence_threshold: int = 100_000,
        contiguous_gradients: bool = True,
        overlap_comm: bool = True,
        allgather_partitions: bool = True,
        reduce_scatter: bool = True,
        allgather_bucket_size: int = 200_000_000,
        reduce_bucket_size: int = 200_000_000,
        zero_allow_untested_optimizer: bool = True,
        logging_batch_size_per_gpu: str | int = "auto",
        config: dict[str, Any] | str | os.PathLike | None = None,
        logging_level: int = logging.WARN,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        loss_scale: float = 0.0,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        min_loss_scale: int = 1,
        partition_activations: bool = False,
        cpu_checkpointing: bool = False,
        contiguous_memory_optimization: bool = False,
        synchronize_checkpoint_boundary: bool = False,
        exclude_frozen_parameters: bool = False,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        start_method: str = "popen",
        allow_unsafe_checkpoint_load: bool = False,
        gradient_clipping: float | None = None,
    ) -> None:
        _import_deepspeed_spec_or_raise()
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self._zero_settings = zero_settings(
            stage=stage,
            remote_device=remote_device,
            offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters,
            offload_params_device=offload_params_device,
            offload_optimizer_device=offload_optimizer_device,
            nvme_path=nvme_path,
            params_buffer_count=params_buffer_count,
            params_buffer_size=params_buffer_size,
            max_in_cpu=max_in_cpu,
            optimizer_buffer_count=optimizer_buffer_count,
            pin_memory=pin_memory,
            sub_group_size=sub_group_size,
            param_persistence_threshold=param_persistence_threshold,
            contiguous_gradients=contiguous_gradients,
            overlap_comm=overlap_comm,
            allgather_partitions=allgather_partitions,
            reduce_scatter=reduce_scatter,
            allgather_bucket_size=allgather_bucket_size,
            reduce_bucket_size=reduce_bucket_size,
        )
        self._logging_batch_size_per_gpu = checked_logging_batch_size(logging_batch_size_per_gpu)
        self._stage = stage
        self.remote_device = remote_device
        self.offload_optimizer = offload_optimizer
        self.offload_parameters = offload_parameters
        self._loss_scaling = {
            "loss_scale": loss_scale, "initial_scale_power": initial_scale_power,
            "loss_scale_window": loss_scale_window, "hysteresis": hysteresis, "min_loss_scale": min_loss_scale,
        }  # fmt: skip
        self._zero_allow_untested_optimizer = zero_allow_untested_optimizer
        self._user_config = load_config(config)
        self._gradient_clipping = checked_gradient_clipping(gradient_clipping, self._user_config)
        self._activation = activation_settings(
            partition_activations=partition_activations,
            cpu_checkpointing=cpu_checkpointing,
            contiguous_memory_optimization=contiguous_memory_optimization,
            synchronize_checkpoint_boundary=synchronize_checkpoint_boundary,
        )
        # Refuse a conflict between these arguments and the given config now rather than in setup.
        merge_activation_section(self._user_config if self._user_config is not None else {}, self._activation)
        self._logging_level = logging_level
        self._exclude_frozen_parameters = exclude_frozen_parameters
        self._allow_unsafe_checkpoint_load = checked_flag("allow_unsafe_checkpoint_load", allow_unsafe_checkpoint_load)
        self._reset_run_state()

    def _reset_run_state(self) -> None:
        """The state of a run, before the first ``setup``."""
        self._engine: Any = None
        self._engine_trains = False  # whether the engine has an optimizer (created by fit)
        self._config: dict[str, Any] | None = None
        self._accumulation = 1
        self._window_open = False  # inside block_backward_sync: this batch does not end an accumulation window
        self._updated_last_step = True
        self._checkpoints = _DeepSpeedCheckpoints(self)
        self._zero_init_active = False
        self._warned_backward_hook = False

    # ------------------------------------------------------------------ precision
    @classmethod
    def precision_plugin_for(cls, precision: str, accelerator: Accelerator) -> Precision:
        """A ``DeepSpeedPrecision`` for '32-true', '16-mixed', 'bf16-mixed', '16-true' or 'bf16-true'."""
        if precision not in DEEPSPEED_PRECISIONS:
            raise ValueError(
                f"precision={precision!r} is not available with DeepSpeed; choose one of {list(DEEPSPEED_PRECISIONS)}."
            )
        supported = type(accelerator).supported_precisions()
        if precision not in supported:
            raise ValueError(
                f"precision={precision!r} cannot run on the {getattr(accelerator, 'name', '?')} accelerator here."
                f" Supported with DeepSpeed: {[p for p in DEEPSPEED_PRECISIONS if p in supported]}."
            )
        return DeepSpeedPrecision(precision)

    # ------------------------------------------------------------------ configuration
    @property
    def zero_stage(self) -> int:
        """The ZeRO stage in use (the config's, when a config was given)."""
        config = self._config if self._config is not None else self._user_config
        if config is not None:
            return int((config.get("zero_optimization") or {}).get("stage", 0))
        return self._stage

    @property
    def config(self) -> dict[str, Any]:
        """The DeepSpeed config of the current run (before ``setup``: the given one, or the one the arguments make)."""
        if self._config is not None:
            return self._config
        return copy.deepcopy(self._user_config) if self._user_config is not None else self._generated_config()

    @property
    def deepspeed_engine(self) -> Any:
        """The DeepSpeed engine (None before ``setup``)."""
        return self._engine

    def _generated_config(self) -> dict[str, Any]:
        return generated_config(
            self._stage,
            self._zero_settings,
            offload_optimizer=self.offload_optimizer,
            offload_parameters=self.offload_parameters,
            allow_untested_optimizer=self._zero_allow_untested_optimizer,
            activation=self._activation,
            gradient_clipping=self._gradient_clipping,
        )

    def _precision_config(self) -> dict[str, Any]:
        sections = self.precision_plugin.deepspeed_config()  # type: ignore[attr-defined]  # precision_plugin_type
        if "fp16" in sections:
            sections["fp16"].update(self._loss_scaling)
        return sections

    def _build_config(self, settings: RunSettings) -> dict[str, Any]:
        """The config handed to DeepSpeed: the given (or generated) one, completed from the run's settings and
        precision."""
        config = copy.deepcopy(self._user_config) if self._user_config is not None else self._generated_config()
        merge_activation_section(config, self._activation)
        config.setdefault("zero_allow_untested_optimizer", self._zero_allow_untested_optimizer)
        return complete_config(
            config, settings, micro_batch_size=lambda: micro_batch_size(self._logging_batch_size_per_gpu, settings),
            precision_sections=self._precision_config(), precision=self.precision_plugin.precision,
        )  # fmt: skip

    # ------------------------------------------------------------------ processes
    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        """Every rank reads its shard (``num_replicas``, ``rank``)."""
        return super().distributed_sampler_kwargs

    def setup_environment(self) -> None:
        """Join the process group, then let DeepSpeed adopt it (gloo on CPU, nccl on CUDA)."""
        if self.parallel_devices and all(device.type == "cpu" for device in self.parallel_devices):
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        super().setup_environment()
        # DeepSpeed's engine reads these; the launcher that started this process may not have set them.
        os.environ["LOCAL_RANK"] = str(self.local_rank)
        os.environ["RANK"] = str(self.global_rank)
        os.environ["WORLD_SIZE"] = str(self.world_size)
        deepspeed = self._deepspeed()
        deepspeed.utils.logging.logger.setLevel(self._logging_level)
        deepspeed.init_distributed(dist_backend=self.process_group_backend, dist_init_required=False)

    # ------------------------------------------------------------------ set-up
    def prepare_module(self, module: nn.Module, settings: RunSettings) -> nn.Module:
        """Release the previous run's engine, apply the layer sync (when fitting), then convert the module."""
        self._release_engine()
        if settings.fitting and self._layer_sync is not None:
            module = self._layer_sync.apply(module)
        return super().prepare_module(module, settings)

    def place_module(self, settings: RunSettings) -> None:
        """Move the module to the device unless ZeRO-3 partitioned its parameters already."""
        assert self._module is not None
        if not partitioned_parameters(self._module):
            self.model_to_device()

    def wrap_module_and_optimizers(self, settings: RunSettings) -> None:
        """Build the engine: with the optimizer when fitting, parameter gathering only for ZeRO-3 evaluation."""
        config = self._config = self._build_config(settings)
        self._accumulation = int(config["gradient_accumulation_steps"])
        self.precision_plugin.engine_gradient_clipping = float(  # type: ignore[attr-defined]  # precision_plugin_type
            config.get("gradient_clipping") or 0.0
        )
        if settings.fitting:
            self._initialize_training_engine(config, settings)
            configure_activation_checkpointing(self._deepspeed(), config)
        else:
            self._initialize_evaluation(config)

    def _deepspeed(self) -> Any:
        """The deepspeed package (imported on first use; the install hint if it is missing)."""
        return _import_deepspeed()

    # ------------------------------------------------------------------ the engine
    def _device_args(self) -> Any:
        import argparse  # DeepSpeed reads the device index from an argparse namespace

        index = self.root_device.index if self.root_device.type != "cpu" else None
        return argparse.Namespace(device_rank=index if index is not None else self.local_rank)

    def _initialize_training_engine(self, config: dict[str, Any], settings: RunSettings) -> None:
        module = self._module
        assert module is not None
        if not self._warned_backward_hook and overrides(module, "backward"):
            self._warned_backward_hook = True
            rank_zero_warn(
                f"{type(module).__name__}.backward is overridden, but under DeepSpeed the engine runs backward"
                " (engine.backward(loss)); the override is not called."
            )
        optimizer, scheduler_configs = engine_optimizer(module, config, settings)
        parameters = [p for p in module.parameters() if p.requires_grad] if optimizer is None else None
        engine, ds_optimizer, _, ds_scheduler = self._deepspeed().initialize(
            args=self._device_args(),
            model=module,
            optimizer=optimizer,
            model_parameters=parameters,
            config=config,
            dist_init_required=False,
        )
        self._engine = engine
        self._engine_trains = True
        self._model = engine
        self._checkpoints.optimizer_restored = False
        self._updated_last_step = True
        # The handle stands in for torch's Optimizer wherever the loops use one (step, zero_grad, state_dict).
        self.optimizers = [DeepSpeedOptimizerHandle(ds_optimizer)]  # type: ignore[list-item]
        self.lr_scheduler_configs = scheduler_configs_for_engine(
            scheduler_configs, ds_scheduler, self._accumulation, lambda: self._updated_last_step
        )

    def _initialize_evaluation(self, config: dict[str, Any]) -> None:
        self.optimizers = []
        self.lr_scheduler_configs = []
        module = self._module
        assert module is not None
        if self.zero_stage == 3:
            # Without an optimizer, ZeRO-3's engine only installs the hooks that gather each layer's parameters.
            deepspeed = self._deepspeed()
            inference_config = partitioning_config(config)
            self._engine, *_ = deepspeed.initialize(
                args=self._device_args(),
                model=module,
                config=inference_config,
                model_parameters=[],
                dist_init_required=False,
            )
            self._engine_trains = False
            self._model = self._engine
            return
        # Stages 0-2 evaluate the plain module; every rank starts from rank 0's weights.
        for tensor in module.state_dict().values():
            distributed.run_collective(
                "broadcast(weights)",
                self.global_rank,
                self._timeout,
                partial(torch.distributed.broadcast, tensor, src=0),
            )

    def _release_engine(self) -> None:
        engine, self._engine = self._engine, None
        self._engine_trains = False
        if engine is not None:
            engine.destroy()  # removes ZeRO-3's module hooks before another engine installs its own

    def _require_training_engine(self) -> Any:
        if self._engine is None or not self._engine_trains:
            raise RuntimeError(
                "The DeepSpeed engine with its optimizer exists during and after fit; "
                "call this while fitting (or after fit)."
            )
        return self._engine

    # ------------------------------------------------------------------ steps
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """``engine.backward(loss)`` through the precision plugin."""
        engine = self._require_training_engine()
        # The engine acts on the accumulation boundary during backward (ZeRO-1 and 2 reduce gradients by it), and a
        # driver may run backward before optimizer_step (Cohort): tell it here too what block_backward_sync says.
        engine.set_gradient_accumulation_boundary(not self._window_open)
        precision = self.precision_plugin
        self.pre_backward(closure_loss)
        closure_loss = precision.pre_backward(closure_loss, self._module)
        with self.naming_collectives("backward"):
            precision.backward(closure_loss, engine, optimizer, *args, **kwargs)
        closure_loss = precision.post_backward(closure_loss, self._module)
        self.post_backward(closure_loss)
        return closure_loss

    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: nn.Module | None = None, **kwargs: Any
    ) -> Any:
        """Tell the engine whether this batch ends an accumulation window, then run the closure and ``engine.step()``.

        A step inside ``block_backward_sync`` does not end the window: the engine accumulates and does not update.
        """
        engine = self._require_training_engine()
        boundary = not self._window_open
        # Every step: once set, the engine keeps the flag instead of counting micro-steps against its config.
        engine.set_gradient_accumulation_boundary(boundary)
        with self.naming_collectives("optimizer_step"):
            result = self.precision_plugin.optimizer_step(
                optimizer, model=engine, closure=closure, before_step=self._before_optimizer_step(), **kwargs
            )
        self._updated_last_step = boundary
        return result

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """The steps inside do not end an accumulation window: the engine keeps accumulating (no reduction yet)."""
        previous, self._window_open = self._window_open, True
        try:
            yield
        finally:
            self._window_open = previous

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """A placeholder: DeepSpeed writes each rank's optimizer partition into the checkpoint directory itself."""
        return dict(OPTIMIZER_MARKER)

    # ------------------------------------------------------------------ what the loops consult
    def declare_traits(self) -> StrategyTraits:
        """The engine reads its own checkpoint files after ``setup``, accumulates gradients (the loop steps every
        batch), and is built from the module and its optimizer together. DeepSpeed's config wants the per-process
        batch size unless ``logging_batch_size_per_gpu`` was given. Under ZeRO-3 each forward pass gathers parameters:
        evaluation is padded, ranks must run equally many batches where parameters are partitioned over several
        processes, and no inference mode (the engine keeps some gathered parameters between steps, and made in
        inference mode training could never use them again)."""
        zero3 = self.zero_stage == 3
        module = self._module
        # Read every batch: stop at the first partitioned parameter rather than listing them all.
        partitioned = (
            zero3
            and self.world_size > 1
            and module is not None
            and any(hasattr(p, "ds_id") for p in module.parameters())
        )
        return replace(
            super().declare_traits(),
            restore_checkpoint_after_setup=True,
            handles_gradient_accumulation=True,
            wraps_module_with_optimizers=True,
            needs_train_batch_size=self._logging_batch_size_per_gpu == "auto",
            pads_evaluation=zero3,
            requires_equal_batches=partitioned,
            allows_inference_mode=not zero3,
        )

    def _run_step(self, method: str, context: AbstractContextManager, *args: Any, **kwargs: Any) -> Any:
        if method == "training_step":
            return super()._run_step(method, context, *args, **kwargs)
        # Evaluation calls the module itself (ZeRO-3's hooks live on its submodules and still gather parameters).
        with context:
            return getattr(self._module, method)(*args, **kwargs)

    # ------------------------------------------------------------------ ZeRO-3: creating the model
    def _zero_init(self) -> AbstractContextManager:
        """ZeRO-3: ``deepspeed.zero.Init``, which partitions each parameter as soon as it is created."""
        if self.zero_stage != 3 or self._zero_init_active:
            return nullcontext()
        deepspeed = self._deepspeed()
        config = partitioning_config(self.config)
        for key, value in self._precision_config().items():
            config.setdefault(key, value)
        return self._flag_zero_init(
            deepspeed.zero.Init(
                remote_device=self.remote_device,
                pin_memory=self._zero_settings["pin_memory"],
                config_dict_or_path=config,
            )
        )

    @contextmanager
    def _flag_zero_init(self, context: AbstractContextManager) -> Iterator[None]:
        self._zero_init_active = True
        try:
            with context:
                yield
        finally:
            self._zero_init_active = False

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """As the base (device, dtype, ``empty_init``); under ZeRO-3 parameters are partitioned as they are created."""
        with ExitStack() as stack:
            if self.root_device.type != "cpu":
                stack.enter_context(self.root_device)
            stack.enter_context(empty_init_context(bool(empty_init)))
            stack.enter_context(self.precision_plugin.tensor_init_context())
            stack.enter_context(self._zero_init())
            yield

    def model_sharded_context(self) -> AbstractContextManager:
        """Under ZeRO-3, ``configure_model`` creates parameters already partitioned across the processes."""
        return self._zero_init()

    # ------------------------------------------------------------------ checkpoints (read and written by _checkpoints)
    def module_state_dict(self) -> dict[str, Any]:
        """The module's full state dict on every rank (ZeRO-3 gathers the partitioned parameters for it)."""
        return self._checkpoints.module_state_dict()

    def load_full_weights(self, weights: dict[str, Any], strict: bool = True) -> None:
        """Whole weights (a plain state dict, as ``Cohort.load_raw`` reads) into the module and, once the engine
        trains, into ZeRO's full-precision partitions too."""
        self._checkpoints.load_full_weights(weights, strict)

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        """Fitting: the engine loads weights and optimizer (converted when the checkpoint has another layout).
        Otherwise: full weights."""
        self._checkpoints.load_model_state(checkpoint, strict)

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Nothing left to read: the engine restored its optimizer partitions with the weights
        (``load_model_state_dict``)."""
        self._checkpoints.check_optimizer_restored(checkpoint)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Every rank writes its partitions through the CheckpointIO into a staging directory; rank 0 adds the
        Trainer's state; the IO publishes it with ``.complete`` (see ``deepspeed._io``)."""
        self._checkpoints.save(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any) -> dict[str, Any]:
        """A DeepSpeed directory: the Trainer's state, read through the CheckpointIO (its weights stay in DeepSpeed's
        files, see ``load_model_state_dict``); any other layout as the base reads it."""
        state = self._checkpoints.load(checkpoint_path)
        return state if state is not None else super().load_checkpoint(checkpoint_path)

    # ------------------------------------------------------------------ memory
    def memory_footprint(self) -> dict[str, int]:
        """Bytes this process holds for the model: its share of the parameters, and of the optimizer states.

        ``optimizer_states`` counts the optimizer's state tensors (Adam's moments, ...) plus the float32 master weights
        the engine keeps for the optimizer when they are separate from the module's parameters (ZeRO stages 1-3, half
        precision) - what the ZeRO paper calls optimizer states (K x parameters / processes, K = 12 for Adam).
        """
        assert self._module is not None
        return memory_footprint(self._module, self._engine, self._engine_trains)

    @classmethod
    def register_strategies(cls, registry: Registry[Strategy]) -> None:
        """Register 'deepspeed' and 'deepspeed_stage_{1,2,2_offload,3,3_offload,3_offload_nvme}'."""
        nvme = {"remote_device": "nvme", "offload_params_device": "nvme", "offload_optimizer_device": "nvme"}
        entries: tuple[tuple[str, str, dict[str, Any]], ...] = (
            ("deepspeed", "DeepSpeed ZeRO stage 2 (optimizer states and gradients partitioned).", {}),
            ("deepspeed_stage_1", "DeepSpeed ZeRO stage 1: optimizer states partitioned.", {"stage": 1}),
            ("deepspeed_stage_2", "DeepSpeed ZeRO stage 2: optimizer states and gradients partitioned.", {"stage": 2}),
            (
                "deepspeed_stage_2_offload",
                "DeepSpeed ZeRO stage 2, optimizer offloaded to the CPU.",
                {"stage": 2, "offload_optimizer": True},
            ),
            (
                "deepspeed_stage_3",
                "DeepSpeed ZeRO stage 3: parameters, gradients and optimizer states partitioned.",
                {"stage": 3},
            ),
            (
                "deepspeed_stage_3_offload",
                "DeepSpeed ZeRO stage 3, parameters and optimizer offloaded to the CPU.",
                {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
            ),
            (
                "deepspeed_stage_3_offload_nvme",
                "DeepSpeed ZeRO stage 3, parameters and optimizer offloaded to NVMe.",
                {"stage": 3, "offload_optimizer": True, "offload_parameters": True, **nvme},
            ),
        )
        for name, description, options in entries:
            registry.register(name, cls, description=description, **options)


def _import_deepspeed_spec_or_raise() -> None:
    if not deepspeed_available():
        _import_deepspeed()  # raises the install hint


__all__ = ["CONFIG_ENV_VAR", "DeepSpeedOptimizerHandle", "DeepSpeedStrategy", "deepspeed_available"]
