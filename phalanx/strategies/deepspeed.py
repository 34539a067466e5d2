"""DeepSpeedStrategy: ZeRO stages 0-3 and CPU/NVMe offload through DeepSpeed's engine (optional extra).

``pip install 'phalanx[deepspeed]'`` installs DeepSpeed. This module never imports deepspeed at import time: the
strategy imports it when a process joins the job (``setup_environment``), so ``import phalanx`` stays cheap and the
registry can list the DeepSpeed names on machines without it.

How DeepSpeed's differences reach the loops (which never look at the strategy's type):

- ``handles_gradient_accumulation`` is True: the loop steps every batch and the engine accumulates. The strategy tells
  the engine where each accumulation window ends (the same windows as DDP: every ``accumulate_grad_batches`` batches
  and at the end of an epoch: the loop runs the other batches inside ``block_backward_sync``), so gradients match a
  DDP run. ``global_step`` counts batches, as in Lightning; schedulers
  with ``interval='step'`` step once per optimizer update.
- backward and the optimizer step go through the engine (``engine.backward``, ``engine.step``), via
  ``DeepSpeedPrecision``; the optimizer handle's ``zero_grad`` does nothing because the engine zeroes gradients itself
  after each update.
- checkpoints are directories (see ``phalanx.strategies.deepspeed_checkpoint``): every rank writes its partitions, the
  Trainer's state goes beside them, and ``.complete`` is written last. Resuming lets the engine read its files
  (``restore_checkpoint_after_setup``); the LR schedulers are restored by the Trainer from the saved state.
- under ZeRO-3 every forward pass gathers parameters collectively: evaluation data is padded
  (``strategy.pads_evaluation``), the driver checks the batch counts at the start of each evaluation
  (``strategy.requires_equal_batches``),
  and evaluation steps run under ``no_grad`` instead of inference mode (parameters gathered in inference mode could
  not be used by training afterwards).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import math
import os
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import Tensor, nn

from phalanx.accelerators.accelerator import Accelerator
from phalanx.optimization import LRSchedulerConfig
from phalanx.plugins.environments.cluster_environment import ClusterEnvironment
from phalanx.plugins.io.checkpoint_io import CheckpointIO
from phalanx.plugins.io.torch_io import is_url
from phalanx.plugins.precision.deepspeed import DEEPSPEED_PRECISIONS, DeepSpeedPrecision
from phalanx.plugins.precision.precision import Precision
from phalanx.strategies.deepspeed_activation import activation_settings, configure_activation_checkpointing, merge_activation_section
from phalanx.strategies.deepspeed_checkpoint import (
    OPTIMIZER_MARKER,
    STATE_FILE,
    TAG,
    is_deepspeed_checkpoint,
    is_optimizer_marker,
    load_deepspeed_checkpoint_as_full,
    read_trainer_state,
)
from phalanx.strategies.deepspeed_files import check_tag_files, refuse_unsafe_engine_reads, safe_engine_reads, tag_directory
from phalanx.strategies.parallel import DEFAULT_TIMEOUT, ParallelStrategy
from phalanx.strategies.settings import RunSettings
from phalanx.utilities import distributed
from phalanx.utilities.exceptions import CheckpointError
from phalanx.utilities.init import empty_init_context
from phalanx.utilities.rank_zero import rank_zero_info, rank_zero_warn

#: Environment variable naming a DeepSpeed JSON config, used when ``config`` is not given.
CONFIG_ENV_VAR = "PHALANX_DEEPSPEED_CONFIG_PATH"
INSTALL_HINT = "pip install 'phalanx[deepspeed]'"
_OFFLOAD_DEVICES = ("cpu", "nvme")
_REMOTE_DEVICES = (None, "cpu", "nvme")


def deepspeed_available() -> bool:
    """Whether the deepspeed package can be imported (checked without importing it)."""
    return importlib.util.find_spec("deepspeed") is not None


def _import_deepspeed() -> Any:
    if not deepspeed_available():
        raise ModuleNotFoundError(
            f"The DeepSpeed strategies need the deepspeed package, which is not installed. Install it with: {INSTALL_HINT}"
            " (DeepSpeed builds against your installed torch: add --no-build-isolation if pip tries to download another torch)."
        )
    import deepspeed

    return deepspeed


def _load_config(config: dict[str, Any] | str | os.PathLike | None) -> dict[str, Any] | None:
    """The user's DeepSpeed config: a dict, a JSON file, or the file named by PHALANX_DEEPSPEED_CONFIG_PATH."""
    source = "config"
    if config is None:
        config = os.environ.get(CONFIG_ENV_VAR) or None
        source = CONFIG_ENV_VAR
        if config is None:
            return None
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"config must be a dict or the path of a DeepSpeed JSON file, got {type(config).__name__}.")
    path = Path(config)
    if not path.is_file():
        raise FileNotFoundError(f"The DeepSpeed config file given by {source} does not exist: {str(path)!r}.")
    try:
        loaded = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"The DeepSpeed config file {str(path)!r} (from {source}) is not valid JSON: {error}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"The DeepSpeed config file {str(path)!r} must hold a JSON object, not a {type(loaded).__name__}.")
    return loaded


def _overrides(module: nn.Module, name: str) -> bool:
    from phalanx.module import TrainingModule

    return getattr(type(module), name, None) is not getattr(TrainingModule, name, None)


class DeepSpeedOptimizerHandle:
    """What ``strategy.optimizers`` holds: the engine's optimizer, whose gradients only the engine may clear.

    ``zero_grad`` does nothing (the engine zeroes gradients after each update, and between the batches of an
    accumulation window they must survive); ``step`` is the engine's, called by the strategy. Everything else
    (``param_groups``, ``state_dict``, ...) is the engine optimizer's.
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The parameter groups (learning rates) of the optimizer DeepSpeed steps."""
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: DeepSpeed zeroes gradients itself after each optimizer update."""

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Refused: the DeepSpeed engine steps (``engine.step()``), through ``Trainer`` / ``strategy.optimizer_step``."""
        raise RuntimeError("Under DeepSpeed the engine steps the optimizer; in manual optimization call step() on the optimizer from self.optimizers().")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)

    def __repr__(self) -> str:
        return f"DeepSpeedOptimizerHandle({type(self.optimizer).__name__})"


class _SchedulerProxy:
    """A scheduler seen by the loops; ``step`` is decided by ``should_step`` (None: DeepSpeed steps it itself)."""

    def __init__(self, scheduler: Any, should_step: Callable[[], bool] | None) -> None:
        self.scheduler = scheduler
        self._should_step = should_step

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step once per optimizer update (never for a scheduler from the DeepSpeed config: the engine steps it)."""
        if self._should_step is not None and self._should_step():
            self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state."""
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scheduler's state."""
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["scheduler"], name)


class DeepSpeedStrategy(ParallelStrategy):
    """ZeRO data parallelism through DeepSpeed: stage 1 partitions optimizer states, 2 also gradients, 3 also parameters.

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
            ``deepspeed.checkpointing.checkpoint``. See :mod:`phalanx.strategies.deepspeed_activation`.
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
    ) -> None:
        _import_deepspeed_spec_or_raise()
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin, process_group_backend=process_group_backend, timeout=timeout, start_method=start_method,
        )  # fmt: skip
        if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
            raise ValueError(f"stage={stage!r} is not a ZeRO stage; choose 0, 1, 2 or 3.")
        for name, device in (("offload_params_device", offload_params_device), ("offload_optimizer_device", offload_optimizer_device)):
            if device not in _OFFLOAD_DEVICES:
                raise ValueError(f"{name}={device!r} is not valid; choose one of {list(_OFFLOAD_DEVICES)}.")
        if remote_device not in _REMOTE_DEVICES:
            raise ValueError(f"remote_device={remote_device!r} is not valid; choose one of {list(_REMOTE_DEVICES)}.")
        if offload_optimizer and stage == 0:
            raise ValueError("offload_optimizer=True needs ZeRO stage 1, 2 or 3 (stage=0 does not partition the optimizer).")
        if offload_parameters and stage != 3:
            raise ValueError(f"offload_parameters=True needs ZeRO stage 3 (only stage 3 partitions parameters); got stage={stage}.")
        if remote_device is not None and stage != 3:
            raise ValueError(f"remote_device={remote_device!r} applies to ZeRO stage 3 only; got stage={stage}.")
        uses_nvme = "nvme" in (remote_device, offload_params_device if offload_parameters else None, offload_optimizer_device if offload_optimizer else None)
        if uses_nvme and not str(nvme_path or ""):
            raise ValueError("Offloading to 'nvme' needs nvme_path= (a directory on a fast local NVMe drive).")
        if logging_batch_size_per_gpu != "auto" and (isinstance(logging_batch_size_per_gpu, bool) or not isinstance(logging_batch_size_per_gpu, int) or logging_batch_size_per_gpu < 1):
            raise ValueError(f"logging_batch_size_per_gpu={logging_batch_size_per_gpu!r} must be 'auto' or an int >= 1.")
        self._stage = stage
        self.remote_device = remote_device
        self.offload_optimizer = offload_optimizer
        self.offload_parameters = offload_parameters
        self._zero_settings = {
            "offload_params_device": offload_params_device, "offload_optimizer_device": offload_optimizer_device, "nvme_path": str(nvme_path),
            "params_buffer_count": params_buffer_count, "params_buffer_size": params_buffer_size, "max_in_cpu": max_in_cpu,
            "optimizer_buffer_count": optimizer_buffer_count, "pin_memory": pin_memory, "sub_group_size": sub_group_size, "param_persistence_threshold": param_persistence_threshold,
            "contiguous_gradients": contiguous_gradients, "overlap_comm": overlap_comm, "allgather_partitions": allgather_partitions,
            "reduce_scatter": reduce_scatter, "allgather_bucket_size": allgather_bucket_size, "reduce_bucket_size": reduce_bucket_size,
        }  # fmt: skip
        self._loss_scaling = {"loss_scale": loss_scale, "initial_scale_power": initial_scale_power, "loss_scale_window": loss_scale_window, "hysteresis": hysteresis, "min_loss_scale": min_loss_scale}
        self._zero_allow_untested_optimizer = zero_allow_untested_optimizer
        self._logging_batch_size_per_gpu = logging_batch_size_per_gpu
        self._user_config = _load_config(config)
        self._activation = activation_settings(
            partition_activations=partition_activations, cpu_checkpointing=cpu_checkpointing,
            contiguous_memory_optimization=contiguous_memory_optimization, synchronize_checkpoint_boundary=synchronize_checkpoint_boundary,
        )  # fmt: skip
        merge_activation_section(self._user_config if self._user_config is not None else {}, self._activation)  # refuse conflicts now
        self._logging_level = logging_level
        self._exclude_frozen_parameters = exclude_frozen_parameters
        if not isinstance(allow_unsafe_checkpoint_load, bool):
            raise TypeError(f"allow_unsafe_checkpoint_load must be True or False, got {allow_unsafe_checkpoint_load!r}.")
        self._allow_unsafe_checkpoint_load = allow_unsafe_checkpoint_load
        self._engine: Any = None
        self._engine_trains = False  # whether the engine has an optimizer (created by fit)
        self._config: dict[str, Any] | None = None
        self._accumulation = 1
        self._window_open = False  # inside block_backward_sync: this batch does not end an accumulation window
        self._updated_last_step = True
        self._optimizer_restored = False
        self._zero_init_active = False
        self._warned_backward_hook = False

    # ------------------------------------------------------------------ precision
    @classmethod
    def precision_plugin_for(cls, precision: str, accelerator: Accelerator) -> Precision:
        """A ``DeepSpeedPrecision`` for '32-true', '16-mixed', 'bf16-mixed', '16-true' or 'bf16-true'."""
        if precision not in DEEPSPEED_PRECISIONS:
            raise ValueError(f"precision={precision!r} is not available with DeepSpeed; choose one of {list(DEEPSPEED_PRECISIONS)}.")
        supported = type(accelerator).supported_precisions()
        if precision not in supported:
            raise ValueError(f"precision={precision!r} cannot run on the {getattr(accelerator, 'name', '?')} accelerator here. Supported with DeepSpeed: {[p for p in DEEPSPEED_PRECISIONS if p in supported]}.")
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
        """The DeepSpeed config of the current run (before ``setup``: the given config, or the one the arguments make)."""
        if self._config is not None:
            return self._config
        return copy.deepcopy(self._user_config) if self._user_config is not None else self._generated_config()

    @property
    def deepspeed_engine(self) -> Any:
        """The DeepSpeed engine (None before ``setup``)."""
        return self._engine

    def _generated_config(self) -> dict[str, Any]:
        settings = self._zero_settings
        zero: dict[str, Any] = {"stage": self._stage}
        if self._stage > 0:
            for key in ("contiguous_gradients", "overlap_comm", "allgather_partitions", "reduce_scatter", "allgather_bucket_size", "reduce_bucket_size"):
                zero[key] = settings[key]
        if self._stage == 3:
            zero["sub_group_size"] = settings["sub_group_size"]
            zero["stage3_param_persistence_threshold"] = settings["param_persistence_threshold"]
        if self.offload_optimizer:
            zero["offload_optimizer"] = {
                "device": settings["offload_optimizer_device"], "nvme_path": settings["nvme_path"],
                "buffer_count": settings["optimizer_buffer_count"], "pin_memory": settings["pin_memory"],
            }  # fmt: skip
        if self.offload_parameters:
            zero["offload_param"] = {
                "device": settings["offload_params_device"], "nvme_path": settings["nvme_path"], "buffer_count": settings["params_buffer_count"],
                "buffer_size": settings["params_buffer_size"], "max_in_cpu": settings["max_in_cpu"], "pin_memory": settings["pin_memory"],
            }  # fmt: skip
        generated = {"zero_optimization": zero, "zero_allow_untested_optimizer": self._zero_allow_untested_optimizer}
        merge_activation_section(generated, self._activation)
        return generated

    def _precision_config(self) -> dict[str, Any]:
        sections = self.precision_plugin.deepspeed_config()
        if "fp16" in sections:
            sections["fp16"].update(self._loss_scaling)
        return sections

    def _build_config(self, settings: RunSettings) -> dict[str, Any]:
        """The config handed to DeepSpeed: the given (or generated) one, completed from the run's settings and precision."""
        config = copy.deepcopy(self._user_config) if self._user_config is not None else self._generated_config()
        merge_activation_section(config, self._activation)
        config.setdefault("zero_allow_untested_optimizer", self._zero_allow_untested_optimizer)
        accumulate = settings.accumulate_grad_batches
        given = config.get("gradient_accumulation_steps")
        if given is not None and given != accumulate:
            raise ValueError(
                f"The DeepSpeed config sets gradient_accumulation_steps={given!r} but the Trainer has accumulate_grad_batches={accumulate};"
                " set it once, with Trainer(accumulate_grad_batches=...)."
            )
        config["gradient_accumulation_steps"] = accumulate
        clip_val = settings.gradient_clip_val
        if clip_val:
            if settings.gradient_clip_algorithm != "norm":
                raise ValueError("DeepSpeed clips gradients by norm only: use gradient_clip_algorithm='norm' (or leave it unset) with gradient_clip_val.")
            if config.get("gradient_clipping") not in (None, clip_val):
                raise ValueError(f"The DeepSpeed config sets gradient_clipping={config['gradient_clipping']!r} but the Trainer has gradient_clip_val={clip_val}; set it in one place.")
            config["gradient_clipping"] = float(clip_val)
        # DeepSpeed clips to 1.0 unless told otherwise; phalanx clips only when asked.
        config.setdefault("gradient_clipping", 0.0)
        if "train_micro_batch_size_per_gpu" not in config and "train_batch_size" not in config:
            config["train_micro_batch_size_per_gpu"] = self._micro_batch_size(settings) if settings.fitting else 1
        wanted = self._precision_config()
        precision = self.precision_plugin.precision
        for key in ("fp16", "bf16"):
            if key in config:
                enabled = bool((config[key] or {}).get("enabled", False))
                if enabled != (key in wanted):
                    state = "enables" if enabled else "disables"
                    raise ValueError(f"The DeepSpeed config {state} '{key}' but the precision is {precision!r}; remove '{key}' from the config and choose the precision with Trainer(precision=...).")
            elif key in wanted:
                config[key] = wanted[key]
        return config

    @property
    def needs_train_batch_size(self) -> bool:
        """True unless ``logging_batch_size_per_gpu`` was given: DeepSpeed's config wants the per-process batch size."""
        return self._logging_batch_size_per_gpu == "auto"

    def _micro_batch_size(self, settings: RunSettings) -> int:
        if isinstance(self._logging_batch_size_per_gpu, int):
            return self._logging_batch_size_per_gpu
        if settings.train_batch_size is not None:
            return settings.train_batch_size
        rank_zero_info("DeepSpeed: the training dataloader's batch size is unknown; DeepSpeed's throughput logs assume 1 (set DeepSpeedStrategy(logging_batch_size_per_gpu=...)).")
        return 1

    # ------------------------------------------------------------------ processes
    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        """Every rank reads its shard (``num_replicas``, ``rank``)."""
        return super().distributed_sampler_kwargs

    @property
    def pads_evaluation(self) -> bool:
        """Under ZeRO-3 every forward pass gathers parameters: all ranks must run equally many, so evaluation is padded."""
        return self.zero_stage == 3

    def setup_environment(self) -> None:
        """Join the process group, then let DeepSpeed adopt it (gloo on CPU, nccl on CUDA)."""
        if self.parallel_devices and all(device.type == "cpu" for device in self.parallel_devices):
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        super().setup_environment()
        # DeepSpeed's engine reads these; the launcher that started this process may not have set them.
        os.environ["LOCAL_RANK"] = str(self.local_rank)
        os.environ["RANK"] = str(self.global_rank)
        os.environ["WORLD_SIZE"] = str(self.world_size)
        deepspeed = _import_deepspeed()
        deepspeed.utils.logging.logger.setLevel(self._logging_level)
        deepspeed.init_distributed(dist_backend=self.process_group_backend, dist_init_required=False)

    def _device_args(self) -> Any:
        import argparse  # DeepSpeed reads the device index from an argparse namespace

        index = self.root_device.index if self.root_device.type != "cpu" else None
        return argparse.Namespace(device_rank=index if index is not None else self.local_rank)

    # ------------------------------------------------------------------ set-up
    def setup(self, settings: RunSettings) -> None:
        """Convert the module and build the engine: with the optimizer when fitting, parameter gathering only for ZeRO-3 evaluation."""
        self._begin_setup(settings)
        assert self._module is not None
        fitting = settings.fitting
        self._release_engine()
        if fitting and self._layer_sync is not None:
            self._module = self._layer_sync.apply(self._module)
        self._module = self.precision_plugin.convert_module(self._module)
        self._model = self._module
        if not _partitioned_parameters(self._module):
            self.model_to_device()
        config = self._config = self._build_config(settings)
        self._accumulation = int(config["gradient_accumulation_steps"])
        self.precision_plugin.engine_gradient_clipping = float(config.get("gradient_clipping") or 0.0)
        if fitting:
            self._initialize_training_engine(config, settings)
            configure_activation_checkpointing(_import_deepspeed(), config)
        else:
            self._initialize_evaluation(config)
        self.setup_precision_plugin()

    def _initialize_training_engine(self, config: dict[str, Any], settings: RunSettings) -> None:
        module = self._module
        assert module is not None
        if _overrides(module, "backward") and not self._warned_backward_hook:
            self._warned_backward_hook = True
            rank_zero_warn(f"{type(module).__name__}.backward is overridden, but under DeepSpeed the engine runs backward (engine.backward(loss)); the override is not called.")
        optimizer = None
        if "optimizer" in config:
            if _overrides(module, "configure_optimizers"):
                rank_zero_info("DeepSpeed: the optimizer (and scheduler) of the DeepSpeed config are used; configure_optimizers is not called.")
            self.lr_scheduler_configs = []
        elif settings.configure_optimizers is None:
            raise ValueError("DeepSpeedStrategy.setup(RunSettings(stage='fit')) needs configure_optimizers= in the settings, or an 'optimizer' section in the DeepSpeed config.")
        else:
            optimizers, self.lr_scheduler_configs = settings.configure_optimizers(module)
            if len(optimizers) != 1:
                raise ValueError(
                    f"DeepSpeed drives exactly one optimizer, but configure_optimizers returned {len(optimizers)}."
                    " Return one optimizer (put several parameter groups in it), or name the optimizer in the DeepSpeed config."
                )
            optimizer = optimizers[0]
            if "scheduler" in config and self.lr_scheduler_configs:
                raise ValueError("Both configure_optimizers and the DeepSpeed config define an LR scheduler; keep one of them.")
        parameters = [p for p in module.parameters() if p.requires_grad] if optimizer is None else None
        deepspeed = _import_deepspeed()
        engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
            args=self._device_args(), model=module, optimizer=optimizer, model_parameters=parameters, config=config, dist_init_required=False,
        )  # fmt: skip
        self._engine = engine
        self._engine_trains = True
        self._model = engine
        self._optimizer_restored = False
        self._updated_last_step = True
        self.optimizers = [DeepSpeedOptimizerHandle(ds_optimizer)]
        if ds_scheduler is not None:
            # A scheduler from the DeepSpeed config: the engine steps it at each update; the loops only see it.
            self.lr_scheduler_configs = [LRSchedulerConfig(_SchedulerProxy(ds_scheduler, None), interval="step")]
        elif self._accumulation > 1:
            for scheduler_config in self.lr_scheduler_configs:
                if scheduler_config.interval == "step":
                    scheduler_config.scheduler = _SchedulerProxy(scheduler_config.scheduler, lambda: self._updated_last_step)

    def _initialize_evaluation(self, config: dict[str, Any]) -> None:
        self.optimizers = []
        self.lr_scheduler_configs = []
        module = self._module
        assert module is not None
        if self.zero_stage == 3:
            # Without an optimizer, ZeRO-3's engine only installs the hooks that gather each layer's parameters.
            deepspeed = _import_deepspeed()
            inference_config = {key: config[key] for key in ("zero_optimization", "fp16", "bf16", "zero_allow_untested_optimizer") if key in config}
            inference_config["train_micro_batch_size_per_gpu"] = 1
            self._engine, *_ = deepspeed.initialize(args=self._device_args(), model=module, config=inference_config, model_parameters=[], dist_init_required=False)
            self._engine_trains = False
            self._model = self._engine
            return
        # Stages 0-2 evaluate the plain module; every rank starts from rank 0's weights.
        for tensor in module.state_dict().values():
            distributed.run_collective("broadcast(weights)", self.global_rank, self._timeout, lambda t=tensor: torch.distributed.broadcast(t, src=0))

    def _release_engine(self) -> None:
        engine, self._engine = self._engine, None
        self._engine_trains = False
        if engine is not None:
            engine.destroy()  # removes ZeRO-3's module hooks before another engine installs its own

    def _require_training_engine(self) -> Any:
        if self._engine is None or not self._engine_trains:
            raise RuntimeError("The DeepSpeed engine with its optimizer exists during and after fit; call this while fitting (or after fit).")
        return self._engine

    # ------------------------------------------------------------------ steps
    def _run_step(self, method: str, context: AbstractContextManager, *args: Any, **kwargs: Any) -> Any:
        if method == "training_step":
            return super()._run_step(method, context, *args, **kwargs)
        # Evaluation calls the module itself (ZeRO-3's hooks live on its submodules and still gather parameters).
        with ExitStack() as stack:
            if torch.is_inference_mode_enabled() and self._module is not None and _partitioned_parameters(self._module):
                # ZeRO-3 keeps some gathered parameters between steps: made in inference mode they could never be
                # used by training again, so evaluation runs under no_grad instead.
                stack.enter_context(torch.inference_mode(False))
                stack.enter_context(torch.no_grad())
            stack.enter_context(context)
            return getattr(self._module, method)(*args, **kwargs)

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """``engine.backward(loss)`` through the precision plugin."""
        engine = self._require_training_engine()
        precision = self.precision_plugin
        self.pre_backward(closure_loss)
        closure_loss = precision.pre_backward(closure_loss, self._module)
        with self.naming_collectives("backward"):
            precision.backward(closure_loss, engine, optimizer, *args, **kwargs)
        closure_loss = precision.post_backward(closure_loss, self._module)
        self.post_backward(closure_loss)
        return closure_loss

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: nn.Module | None = None, **kwargs: Any) -> Any:
        """Tell the engine whether this batch ends an accumulation window, then run the closure and ``engine.step()``.

        A step inside ``block_backward_sync`` does not end the window: the engine accumulates and does not update.
        """
        engine = self._require_training_engine()
        boundary = not self._window_open
        # Every step: once set, the engine keeps the flag instead of counting micro-steps against its config.
        engine.set_gradient_accumulation_boundary(boundary)
        with self.naming_collectives("optimizer_step"):
            result = self.precision_plugin.optimizer_step(optimizer, model=engine, closure=closure, before_step=self._before_optimizer_step(), **kwargs)
        self._updated_last_step = boundary
        return result

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """The steps inside do not end an accumulation window: the engine keeps accumulating (and does not reduce yet)."""
        previous, self._window_open = self._window_open, True
        try:
            yield
        finally:
            self._window_open = previous

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """A placeholder: DeepSpeed writes each rank's optimizer partition into the checkpoint directory itself."""
        return dict(OPTIMIZER_MARKER)

    # ------------------------------------------------------------------ evaluation under ZeRO-3
    @property
    def requires_equal_batches(self) -> bool:
        """Under ZeRO-3 with partitioned parameters on several processes: each forward pass gathers them collectively."""
        return self.world_size > 1 and self._module is not None and bool(_partitioned_parameters(self._module))

    # ------------------------------------------------------------------ creating the model
    def _zero_init(self) -> AbstractContextManager:
        """ZeRO-3: ``deepspeed.zero.Init``, which partitions each parameter as soon as it is created."""
        if self.zero_stage != 3 or self._zero_init_active:
            return nullcontext()
        deepspeed = _import_deepspeed()
        config = {key: value for key, value in self.config.items() if key in ("zero_optimization", "fp16", "bf16", "zero_allow_untested_optimizer")}
        for key, value in self._precision_config().items():
            config.setdefault(key, value)
        config["train_micro_batch_size_per_gpu"] = 1  # DeepSpeed validates it; creation does not use it
        return self._flag_zero_init(deepspeed.zero.Init(remote_device=self.remote_device, pin_memory=self._zero_settings["pin_memory"], config_dict_or_path=config))

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
        """As the base (device, dtype, ``empty_init``), and under ZeRO-3 parameters are partitioned as they are created."""
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

    # ------------------------------------------------------------------ module state
    def module_state_dict(self) -> dict[str, Any]:
        """The module's full state dict on every rank (ZeRO-3 gathers the partitioned parameters for it)."""
        module = self._module
        assert module is not None
        partitioned = _partitioned_parameters(module)
        if not partitioned:
            return module.state_dict()
        deepspeed = _import_deepspeed()
        with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
            return {name: value.detach().clone() for name, value in module.state_dict().items()}

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        """Fitting from a DeepSpeed directory: the engine loads weights and optimizer partitions. Otherwise: full weights."""
        meta = checkpoint.get("deepspeed")
        fitting = self._engine is not None and self._engine_trains
        if fitting:
            if not isinstance(meta, dict) or "directory" not in meta:
                raise CheckpointError(
                    "Resuming DeepSpeed training needs a checkpoint directory written by DeepSpeedStrategy; this checkpoint is"
                    " an ordinary file. To start DeepSpeed training from its weights, load them into the module before fit"
                    " (TrainingModule.load_from_checkpoint) and call fit without ckpt_path."
                )
            self._load_engine_checkpoint(meta, strict)
            return
        if isinstance(meta, dict) and "directory" in meta:
            weights = load_deepspeed_checkpoint_as_full(meta["directory"])["state_dict"]
        else:
            weights = checkpoint["state_dict"]
        self._load_full_weights(weights, strict)

    def _load_engine_checkpoint(self, meta: dict[str, Any], strict: bool) -> None:
        engine = self._require_training_engine()
        saved_world_size = meta.get("world_size")
        if saved_world_size is not None and saved_world_size != self.world_size:
            raise CheckpointError(
                f"{meta['directory']} was written by {saved_world_size} processes, and DeepSpeed resumes ZeRO checkpoints only with"
                f" the same number (now {self.world_size}). Consolidate it (phalanx checkpoint consolidate) to get its weights."
            )
        saved_stage = meta.get("zero_stage")
        if saved_stage is not None and saved_stage != self.zero_stage:
            raise CheckpointError(f"{meta['directory']} was written with ZeRO stage {saved_stage}; resume it with the same stage (now {self.zero_stage}).")
        # The tag comes from the checkpoint (its state file, else 'latest'): a plain name inside it, every file
        # DeepSpeed needs present. DeepSpeed is given the checked tag, so it never reads 'latest' itself.
        directory = Path(meta["directory"])
        tag, folder = tag_directory(directory, meta.get("tag"))
        check_tag_files(folder, world_size=saved_world_size, zero_stage=saved_stage)
        reads: AbstractContextManager = nullcontext()
        if not self._allow_unsafe_checkpoint_load:
            refuse_unsafe_engine_reads(engine, directory)
            reads = safe_engine_reads(engine, directory, folder)
        with reads:
            load_path, _ = engine.load_checkpoint(str(directory), tag=tag, load_module_strict=strict, load_optimizer_states=True, load_lr_scheduler_states=False)
        if load_path is None:
            raise CheckpointError(f"DeepSpeed found no checkpoint in {directory} (tag {tag!r}).")
        self._optimizer_restored = True

    def _load_full_weights(self, weights: dict[str, Any], strict: bool) -> None:
        module = self._module
        assert module is not None
        partitioned = _partitioned_parameters(module)
        if not partitioned:
            module.load_state_dict(weights, strict=strict)
            return
        deepspeed = _import_deepspeed()
        # Every rank reads the same weights; rank 0's copy is what GatheredParameters partitions again on exit.
        with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0):
            module.load_state_dict(weights, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        """Nothing left to read: the engine restored its optimizer partitions with the weights (``load_model_state_dict``)."""
        states = checkpoint["optimizer_states"]
        if len(states) != len(self.optimizers):
            raise ValueError(f"The checkpoint holds {len(states)} optimizer state(s) but DeepSpeed drives {len(self.optimizers)}; resume with the same optimizer configuration.")
        if not all(is_optimizer_marker(state) for state in states) or not self._optimizer_restored:
            raise CheckpointError("DeepSpeed resumes its optimizer only from a DeepSpeed checkpoint directory written by DeepSpeedStrategy.")

    # ------------------------------------------------------------------ checkpoint directories
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Every rank writes its partitions into a hidden directory; rank 0 adds the Trainer's state and ``.complete``, then renames it into place."""
        from phalanx.plugins.io.directory import publish_directory, staging_directory
        from phalanx.plugins.io.torch_io import TorchCheckpointIO

        engine = self._require_training_engine()
        if storage_options is not None or is_url(filepath):
            raise ValueError(f"DeepSpeed writes checkpoints to a local (or shared) file system path; {str(filepath)!r} with storage_options={storage_options!r} is not one.")
        target = Path(filepath).absolute()
        staging = staging_directory(target, is_global_zero=self.is_global_zero, broadcast=self.broadcast)
        engine.save_checkpoint(str(staging), tag=TAG, client_state={}, exclude_frozen_parameters=self._exclude_frozen_parameters)
        if self.is_global_zero:
            state = {key: value for key, value in checkpoint.items() if key != "state_dict"}
            state["deepspeed"] = {"tag": TAG, "zero_stage": self.zero_stage, "world_size": self.world_size, "precision": self.precision_plugin.precision}
            TorchCheckpointIO().save_checkpoint(state, staging / STATE_FILE)
        self.barrier("DeepSpeedStrategy.save_checkpoint")
        if self.is_global_zero:
            publish_directory(staging, target)
        self.barrier("DeepSpeedStrategy.save_checkpoint(renamed)")

    def load_checkpoint(self, checkpoint_path: Any) -> dict[str, Any]:
        """A DeepSpeed directory: the Trainer's state (its weights stay in DeepSpeed's files, see ``load_model_state_dict``)."""
        if isinstance(checkpoint_path, (str, os.PathLike)) and not is_url(checkpoint_path) and is_deepspeed_checkpoint(checkpoint_path):
            state = read_trainer_state(checkpoint_path)
            meta = dict(state.get("deepspeed") or {})
            meta["directory"] = str(Path(checkpoint_path).absolute())
            state["deepspeed"] = meta
            state.setdefault("state_dict", {})  # DeepSpeed's files hold the weights
            return state
        return super().load_checkpoint(checkpoint_path)

    # ------------------------------------------------------------------ what the loops consult
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """True: the engine, created in ``setup``, reads its own checkpoint files."""
        return True

    @property
    def handles_gradient_accumulation(self) -> bool:
        """True: the engine accumulates gradients; the loop steps every batch."""
        return True

    # ------------------------------------------------------------------ memory
    def memory_footprint(self) -> dict[str, int]:
        """Bytes this process holds for the model: its share of the parameters, and of the optimizer states.

        ``optimizer_states`` counts the optimizer's state tensors (Adam's moments, ...) plus the float32 master weights
        the engine keeps for the optimizer when they are separate from the module's parameters (ZeRO stages 1-3, half
        precision) - what the ZeRO paper calls optimizer states (K x parameters / processes, K = 12 for Adam).
        """
        module = self._module
        assert module is not None
        # A ZeRO-3 parameter holds its shard (ds_tensor) and, while gathered or when small enough to stay
        # gathered (stage3_param_persistence_threshold), the whole tensor as well.
        parameters = sum(_bytes(p.ds_tensor) if hasattr(p, "ds_tensor") else 0 for p in module.parameters())
        parameters += sum(_bytes(p.data) for p in module.parameters())
        engine = self._engine
        states = masters = 0
        if engine is not None and engine.optimizer is not None and self._engine_trains:
            optimizer = engine.optimizer
            base = getattr(optimizer, "optimizer", optimizer)
            seen: set[int] = set()
            for state in base.state.values():
                for value in state.values():
                    if isinstance(value, Tensor) and id(value) not in seen:
                        seen.add(id(value))
                        states += _bytes(value)
            # DeepSpeed's float32 master partitions (stages 1-2, stage 3, bf16 without ZeRO), when it keeps them.
            for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition"):
                flats = getattr(optimizer, name, None)
                if isinstance(flats, list) and flats and all(isinstance(t, Tensor) for t in flats):
                    masters = sum(_bytes(t) for t in flats)
                    break
        return {"parameters": parameters, "optimizer_states": states + masters, "master_weights": masters}

    @classmethod
    def register_strategies(cls, registry: Any) -> None:
        """Register 'deepspeed' and 'deepspeed_stage_{1,2,2_offload,3,3_offload,3_offload_nvme}'."""
        nvme = {"remote_device": "nvme", "offload_params_device": "nvme", "offload_optimizer_device": "nvme"}
        entries = (
            ("deepspeed", "DeepSpeed ZeRO stage 2 (optimizer states and gradients partitioned).", {}),
            ("deepspeed_stage_1", "DeepSpeed ZeRO stage 1: optimizer states partitioned.", {"stage": 1}),
            ("deepspeed_stage_2", "DeepSpeed ZeRO stage 2: optimizer states and gradients partitioned.", {"stage": 2}),
            ("deepspeed_stage_2_offload", "DeepSpeed ZeRO stage 2, optimizer offloaded to the CPU.", {"stage": 2, "offload_optimizer": True}),
            ("deepspeed_stage_3", "DeepSpeed ZeRO stage 3: parameters, gradients and optimizer states partitioned.", {"stage": 3}),
            ("deepspeed_stage_3_offload", "DeepSpeed ZeRO stage 3, parameters and optimizer offloaded to the CPU.", {"stage": 3, "offload_optimizer": True, "offload_parameters": True}),
            ("deepspeed_stage_3_offload_nvme", "DeepSpeed ZeRO stage 3, parameters and optimizer offloaded to NVMe.", {"stage": 3, "offload_optimizer": True, "offload_parameters": True, **nvme}),
        )
        for name, description, options in entries:
            registry.register(name, cls, description=description, **options)


def _import_deepspeed_spec_or_raise() -> None:
    if not deepspeed_available():
        _import_deepspeed()  # raises the install hint


def _partitioned_parameters(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if hasattr(p, "ds_id")]


def _bytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


__all__ = ["CONFIG_ENV_VAR", "DeepSpeedOptimizerHandle", "DeepSpeedStrategy", "deepspeed_available"]
