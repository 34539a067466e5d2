"""What ZeRO-3's partitioned parameters change in ``DeepSpeedStrategy``: models are created already partitioned
(``deepspeed.zero.Init``), and every forward pass gathers parameters collectively, so evaluation is padded, its batch
counts are checked, and it runs under ``no_grad`` instead of inference mode (``allows_inference_mode``)."""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any, Iterator

from phalanx.strategies.deepspeed._config import partitioning_config
from phalanx.strategies.deepspeed._engine import partitioned_parameters
from phalanx.utilities.init import empty_init_context


class DeepSpeedZero3Mixin:
    """ZeRO-3 model creation and evaluation for ``DeepSpeedStrategy`` (which provides config and ``_deepspeed()``)."""

    _module: Any
    _zero_init_active: bool
    _zero_settings: dict[str, Any]
    remote_device: str | None

    # ------------------------------------------------------------------ evaluation
    @property
    def pads_evaluation(self) -> bool:
        """Under ZeRO-3 each forward pass gathers parameters: ranks must run equally many, so evaluation is padded."""
        return self.zero_stage == 3

    @property
    def requires_equal_batches(self) -> bool:
        """Under ZeRO-3 with parameters partitioned over several processes: each forward pass gathers them."""
        return self.world_size > 1 and self._module is not None and bool(partitioned_parameters(self._module))

    @property
    def allows_inference_mode(self) -> bool:
        """Not under ZeRO-3: it keeps some parameters it gathers between steps, and made in inference mode training
        could never use them again."""
        return self.zero_stage != 3

    def _run_step(self, method: str, context: AbstractContextManager, *args: Any, **kwargs: Any) -> Any:
        if method == "training_step":
            return super()._run_step(method, context, *args, **kwargs)
        # Evaluation calls the module itself (ZeRO-3's hooks live on its submodules and still gather parameters).
        with context:
            return getattr(self._module, method)(*args, **kwargs)

    # ------------------------------------------------------------------ creating the model
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


__all__ = ["DeepSpeedZero3Mixin"]
