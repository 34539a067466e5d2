"""What DeepSpeedStrategy builds its engine with (the optimizer to hand it), the optimizer handle and scheduler proxy
the loops see, and what the engine holds in memory."""

from __future__ import annotations

from typing import Any, Callable

from torch import Tensor, nn

from phalanx.optimization import LRSchedulerConfig
from phalanx.strategies.settings import RunSettings
from phalanx.utilities.rank_zero import rank_zero_info


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
    # Lazy for import time: `import phalanx.strategies` (and the Cohort) does not load the TrainingModule.
    from phalanx.module import TrainingModule

    return isinstance(module, TrainingModule) and getattr(type(module), name, None) is not getattr(
        TrainingModule, name, None
    )


def engine_optimizer(
    module: nn.Module, config: dict[str, Any], settings: RunSettings
) -> tuple[Any, list[LRSchedulerConfig]]:
    """The optimizer (None: the config names one) and LR scheduler configs to build the training engine with."""
    if "optimizer" in config:
        if settings.optimizers_given:
            raise ValueError(
                "An optimizer was passed, and the DeepSpeed config has an 'optimizer' section too: DeepSpeed would"
                " train with the config's optimizer and the one passed would never step. Remove the 'optimizer' section"
                " from the config (its 'scheduler' section may stay), so that the optimizer passed trains the model."
            )
        if overrides(module, "configure_optimizers"):
            rank_zero_info(
                "DeepSpeed: the optimizer (and scheduler) of the DeepSpeed config are used; "
                "configure_optimizers is not called."
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


def partitioned_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters ZeRO-3 partitioned (it marks them with ``ds_id``)."""
    return [p for p in module.parameters() if hasattr(p, "ds_id")]


def tensor_bytes(tensor: Tensor) -> int:
    """The bytes of ``tensor``'s elements."""
    return tensor.numel() * tensor.element_size()


__all__ = [
    "DeepSpeedOptimizerHandle",
    "SchedulerProxy",
    "engine_optimizer",
    "memory_footprint",
    "overrides",
    "partitioned_parameters",
    "scheduler_configs_for_engine",
]
