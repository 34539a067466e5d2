"""The DeepSpeed engine: how it is built for training or evaluation, the optimizer handle and scheduler proxy the loops
see, and what the engine holds in memory."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn

from phalanx.optimization import LRSchedulerConfig
from phalanx.strategies.deepspeed._config import partitioning_config
from phalanx.strategies.settings import RunSettings
from phalanx.utilities import distributed
from phalanx.utilities.rank_zero import rank_zero_info, rank_zero_warn


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
        """Refused: the DeepSpeed engine steps (``engine.step()``) through ``Trainer`` / ``strategy.optimizer_step``."""
        raise RuntimeError(
            "Under DeepSpeed the engine steps the optimizer; in manual optimization call step() on the optimizer from"
            " self.optimizers()."
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)

    def __repr__(self) -> str:
        return f"DeepSpeedOptimizerHandle({type(self.optimizer).__name__})"


class SchedulerProxy:
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


def overrides(module: nn.Module, name: str) -> bool:
    """Whether ``module`` is a TrainingModule whose class overrides hook ``name`` (a plain nn.Module has none)."""
    from phalanx.module import TrainingModule

    return isinstance(module, TrainingModule) and getattr(type(module), name, None) is not getattr(
        TrainingModule, name, None
    )


def engine_optimizer(
    module: nn.Module, config: dict[str, Any], settings: RunSettings
) -> tuple[Any, list[LRSchedulerConfig]]:
    """The optimizer (None: the config names one) and LR scheduler configs to build the training engine with."""
    if "optimizer" in config:
        if overrides(module, "configure_optimizers"):
            rank_zero_info(
                "DeepSpeed: the optimizer (and scheduler) of the DeepSpeed config are used; configure_optimizers is"
                " not called."
            )
        return None, []
    if settings.configure_optimizers is None:
        raise ValueError(
            "DeepSpeedStrategy.setup(RunSettings(stage='fit')) needs configure_optimizers= in the settings, or an"
            " 'optimizer' section in the DeepSpeed config."
        )
    optimizers, scheduler_configs = settings.configure_optimizers(module)
    if len(optimizers) != 1:
        raise ValueError(
            f"DeepSpeed drives exactly one optimizer, but configure_optimizers returned {len(optimizers)}."
            " Return one optimizer (put several parameter groups in it), or name the optimizer in the DeepSpeed config."
        )
    if "scheduler" in config and scheduler_configs:
        raise ValueError("Both configure_optimizers and the DeepSpeed config define an LR scheduler; keep one of them.")
    return optimizers[0], scheduler_configs


def scheduler_configs_for_engine(
    configs: list[LRSchedulerConfig], engine_scheduler: Any, accumulation: int, updated_last_step: Callable[[], bool]
) -> list[LRSchedulerConfig]:
    """What the loops step: a config scheduler (the engine steps it), or step schedulers held back to one step per
    update."""
    if engine_scheduler is not None:
        return [LRSchedulerConfig(SchedulerProxy(engine_scheduler, None), interval="step")]
    if accumulation > 1:
        for config in configs:
            if config.interval == "step":
                config.scheduler = SchedulerProxy(config.scheduler, updated_last_step)
    return configs


def memory_footprint(module: nn.Module, engine: Any, engine_trains: bool) -> dict[str, int]:
    """Bytes this process holds for the model: its share of the parameters, and of the optimizer states (see the
    strategy's method)."""
    # A ZeRO-3 parameter holds its shard (ds_tensor) and, while gathered or when small enough to stay
    # gathered (stage3_param_persistence_threshold), the whole tensor as well.
    parameters = sum(tensor_bytes(p.ds_tensor) if hasattr(p, "ds_tensor") else 0 for p in module.parameters())
    parameters += sum(tensor_bytes(p.data) for p in module.parameters())
    states = masters = 0
    if engine is not None and engine.optimizer is not None and engine_trains:
        optimizer = engine.optimizer
        base = getattr(optimizer, "optimizer", optimizer)
        seen: set[int] = set()
        for state in base.state.values():
            for value in state.values():
                if isinstance(value, Tensor) and id(value) not in seen:
                    seen.add(id(value))
                    states += tensor_bytes(value)
        # DeepSpeed's float32 master partitions (stages 1-2, stage 3, bf16 without ZeRO), when it keeps them.
        for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition"):
            flats = getattr(optimizer, name, None)
            if isinstance(flats, list) and flats and all(isinstance(t, Tensor) for t in flats):
                masters = sum(tensor_bytes(t) for t in flats)
                break
    return {"parameters": parameters, "optimizer_states": states + masters, "master_weights": masters}


class DeepSpeedEngineMixin:
    """Building and releasing the engine, for ``DeepSpeedStrategy`` (which provides the module, the ranks and
    ``_deepspeed()``)."""

    _module: Any
    _model: Any
    _engine: Any
    _engine_trains: bool
    _accumulation: int
    _updated_last_step: bool
    _checkpoints: Any
    _warned_backward_hook: bool
    optimizers: list[Any]
    lr_scheduler_configs: list[LRSchedulerConfig]

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
        self.optimizers = [DeepSpeedOptimizerHandle(ds_optimizer)]
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
                lambda t=tensor: torch.distributed.broadcast(t, src=0),
            )

    def _release_engine(self) -> None:
        engine, self._engine = self._engine, None
        self._engine_trains = False
        if engine is not None:
            engine.destroy()  # removes ZeRO-3's module hooks before another engine installs its own

    def _require_training_engine(self) -> Any:
        if self._engine is None or not self._engine_trains:
            raise RuntimeError(
                "The DeepSpeed engine with its optimizer exists during and after fit; call this while fitting (or"
                " after fit)."
            )
        return self._engine


def partitioned_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters ZeRO-3 partitioned (it marks them with ``ds_id``)."""
    return [p for p in module.parameters() if hasattr(p, "ds_id")]


def tensor_bytes(tensor: Tensor) -> int:
    """The bytes of ``tensor``'s elements."""
    return tensor.numel() * tensor.element_size()


__all__ = [
    "DeepSpeedEngineMixin",
    "DeepSpeedOptimizerHandle",
    "SchedulerProxy",
    "engine_optimizer",
    "memory_footprint",
    "overrides",
    "partitioned_parameters",
    "scheduler_configs_for_engine",
]
