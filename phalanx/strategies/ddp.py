"""DDPStrategy: one process per device, gradients all-reduced by torch's DistributedDataParallel."""

from __future__ import annotations

import difflib
import inspect
import sys
from datetime import timedelta
from functools import partial
from typing import Any, Callable

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from phalanx.accelerators.accelerator import Accelerator
from phalanx.plugins.environments.cluster_environment import ClusterEnvironment
from phalanx.plugins.io.checkpoint_io import CheckpointIO
from phalanx.plugins.precision.precision import Precision
from phalanx.strategies.forward_redirection import redirect_forward
from phalanx.strategies.parallel import DEFAULT_TIMEOUT, ParallelStrategy
from phalanx.strategies.settings import RunSettings
from phalanx.strategies.strategy import Strategy
from phalanx.utilities import distributed
from phalanx.utilities.checks import check_int_at_least
from phalanx.utilities.registry import Registry

_UNUSED_PARAMETERS_HINT = (
    "DistributedDataParallel found parameters that received no gradient in this step (some layers were not used to"
    " compute the loss). Either use every parameter in training_step, or pass find_unused_parameters=True (e.g."
    " strategy='ddp_find_unused_parameters_true' or DDPStrategy(find_unused_parameters=True)), which costs an extra"
    " traversal of the graph each step."
)

# DistributedDataParallel arguments the strategy sets itself.
_OWN_DDP_ARGUMENTS = frozenset({"self", "module", "device_ids", "output_device"})


def _check_ddp_kwargs(kwargs: dict[str, Any]) -> None:
    # A misspelt option must fail here, not when the model is wrapped after the processes started.
    # None is what tools that fill every parameter in (jsonargparse) pass; only a real value would be overridden.
    owned = sorted(name for name in set(kwargs) & {"device_ids", "output_device"} if kwargs[name] is not None)
    if owned:
        raise TypeError(f"DDPStrategy sets {owned} itself from the process's device; remove them.")
    accepted = sorted(set(inspect.signature(DistributedDataParallel.__init__).parameters) - _OWN_DDP_ARGUMENTS)
    unknown = sorted(set(kwargs) - set(accepted) - {"device_ids", "output_device"})
    if unknown:
        hints = [
            f"{name!r} (did you mean {close[0]!r}?)"
            if (close := difflib.get_close_matches(name, accepted, n=1))
            else repr(name)
            for name in unknown
        ]
        raise TypeError(
            f"DDPStrategy got unknown keyword argument(s) {', '.join(hints)}; it passes extra keywords to"
            f" DistributedDataParallel, which accepts {accepted}."
        )


class DDPStrategy(ParallelStrategy):
    """Data parallelism: every process holds the whole model and trains on its shard of each batch."""

    step_collectives = {
        "forward": "DDP forward (buffer broadcast)",
        "backward": "DDP gradient all-reduce (backward)",
        "optimizer_step": "optimizer step (DDP forward and gradient all-reduce)",
    }

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        ddp_comm_state: object | None = None,
        ddp_comm_hook: Callable | None = None,
        ddp_comm_wrapper: Callable | None = None,
        model_averaging_period: int | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        start_method: str = "popen",
        **kwargs: Any,
    ) -> None:
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
        if model_averaging_period is not None:
            check_int_at_least("model_averaging_period", model_averaging_period, 1)
        if model_averaging_period is None and type(ddp_comm_state).__name__ == "PostLocalSGDState":
            raise ValueError(
                "Post-local SGD (ddp_comm_state=PostLocalSGDState) needs model_averaging_period= (optimizer steps"
                " between model averages)."
            )
        _check_ddp_kwargs(kwargs)
        kwargs = {name: value for name, value in kwargs.items() if name not in ("device_ids", "output_device")}
        self._ddp_comm_state = ddp_comm_state
        self._ddp_comm_hook = ddp_comm_hook
        self._ddp_comm_wrapper = ddp_comm_wrapper
        self._model_averaging_period = model_averaging_period
        self._ddp_kwargs = kwargs

    # ------------------------------------------------------------------ wrapping
    def prepare_module(self, module: torch.nn.Module, settings: RunSettings) -> torch.nn.Module:
        """Apply the layer sync (when fitting), then convert the module."""
        if settings.fitting and self._layer_sync is not None:
            module = self._layer_sync.apply(module)
        return super().prepare_module(module, settings)

    def wrap_module(self, module: torch.nn.Module, settings: RunSettings) -> torch.nn.Module:
        """Wrap with ``configure_ddp`` when fitting; evaluation runs unwrapped, from rank 0's weights."""
        if settings.fitting:
            self.configure_ddp()
            assert self._model is not None
            return self._model
        for tensor in module.state_dict().values():
            distributed.run_collective(
                "broadcast(weights)",
                self.global_rank,
                self._timeout,
                partial(torch.distributed.broadcast, tensor, src=0),
            )
        return module

    def wrap_module_and_optimizers(self, settings: RunSettings) -> None:
        """Wrap, create the optimizers, then start model averaging (post-local SGD) when fitting."""
        super().wrap_module_and_optimizers(settings)
        if settings.fitting:
            self._enable_model_averaging()

    def configure_ddp(self) -> None:
        """Wrap ``self.module`` in DistributedDataParallel as ``self.model`` and register the comm hook (override to
        customise)."""
        assert self._module is not None
        self._model = self._wrap(self._module)
        self._register_comm_hook()

    def _wrap(self, module: torch.nn.Module) -> DistributedDataParallel:
        device_ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=device_ids, **self._ddp_kwargs)

    def _register_comm_hook(self) -> None:
        if self._ddp_comm_hook is None:
            return
        state = self._ddp_comm_state
        if type(state).__name__ == "PostLocalSGDState" and state.subgroup is None:  # type: ignore[union-attr]
            # torch's default subgroup size is the number of CUDA devices; averaging within each node works anywhere.
            state.subgroup, _ = torch.distributed.new_subgroups(group_size=self.num_processes)  # type: ignore[union-attr]
        hook = self._ddp_comm_hook
        if self._ddp_comm_wrapper is not None:
            hook = self._ddp_comm_wrapper(hook)
        assert isinstance(self._model, DistributedDataParallel)
        self._model.register_comm_hook(state=self._ddp_comm_state, hook=hook)

    def _enable_model_averaging(self) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState

        if not isinstance(self._ddp_comm_state, PostLocalSGDState):
            return
        assert self._model_averaging_period is not None, "checked in __init__"
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import DistributedOptimizer, PostLocalSGDOptimizer, ZeroRedundancyOptimizer

        for optimizer in self.optimizers:
            if isinstance(optimizer, (DistributedOptimizer, ZeroRedundancyOptimizer, PostLocalSGDOptimizer)):
                raise ValueError(
                    f"Model averaging cannot wrap a distributed optimizer ({type(optimizer).__name__}); use a regular"
                    " torch optimizer."
                )
        averager = PeriodicModelAverager(
            period=self._model_averaging_period, warmup_steps=self._ddp_comm_state.start_localSGD_iter
        )
        self.optimizers = [PostLocalSGDOptimizer(optim=optimizer, averager=averager) for optimizer in self.optimizers]

    # ------------------------------------------------------------------ steps
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Through DDP's forward; in manual optimization the reducer is prepared by ``pre_backward`` instead."""
        model, module = self._model, self._module
        if not isinstance(model, DistributedDataParallel) or getattr(module, "automatic_optimization", True):
            return super().training_step(*args, **kwargs)
        assert module is not None
        with self.naming_collectives("forward"), self.precision_plugin.train_step_context():
            # manual_backward runs inside training_step, i.e. inside DDP's forward: keep DDP from preparing the
            # reducer for the (already finished) backward when the forward returns.
            try:
                return redirect_forward(
                    model,
                    module,
                    "training_step",
                    *args,
                    after_step=lambda: setattr(model, "require_backward_grad_sync", False),
                    **kwargs,
                )
            finally:
                model.require_backward_grad_sync = True

    def _run_step(self, method: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        if method == "training_step":
            return super()._run_step(method, context, *args, **kwargs)
        # Evaluation bypasses DDP: ranks may see different numbers of batches (no padded duplicates), so no
        # collective (e.g. DDP's buffer broadcast) may run per batch.
        with context:
            return getattr(self._module, method)(*args, **kwargs)

    def pre_backward(self, closure_loss: Tensor) -> None:
        """In manual optimization, prepare DDP's reducer for the backward the user triggers."""
        model = self._model
        manual = not getattr(
            self._module, "automatic_optimization", True
        )  # a plain nn.Module (your own loop) runs DDP's forward
        if (
            isinstance(model, DistributedDataParallel)
            and manual
            and torch.is_grad_enabled()
            and model.require_backward_grad_sync
        ):
            model.require_forward_param_sync = True
            model.reducer.prepare_for_backward([closure_loss] if model.find_unused_parameters else [])

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The whole state of every optimizer; a ZeroRedundancyOptimizer's shards are first gathered on rank 0.

        Every rank must call this (the gathering is a collective); ranks other than 0 then return an empty dict.
        """
        zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
        if zero is None or not isinstance(optimizer, zero.ZeroRedundancyOptimizer):
            return super().optimizer_state(optimizer)
        distributed.run_collective(
            "ZeroRedundancyOptimizer.consolidate_state_dict",
            self.global_rank,
            self._timeout,
            lambda: optimizer.consolidate_state_dict(to=0),
        )
        return optimizer.state_dict() if self.is_global_zero else {}

    def twin_for_tuning(self) -> DDPStrategy | None:
        """A DDPStrategy with these settings and devices, for processes started by re-running the script (or by
        torchrun, SLURM, ...); None for spawned or forked workers, where another Trainer would start processes anew."""
        if self._start_method != "popen":
            return None
        twin = DDPStrategy(
            ddp_comm_state=self._ddp_comm_state,
            ddp_comm_hook=self._ddp_comm_hook,
            ddp_comm_wrapper=self._ddp_comm_wrapper,
            model_averaging_period=self._model_averaging_period,
            process_group_backend=self._process_group_backend,
            timeout=self._timeout,
            **self._ddp_kwargs,
        )
        twin.parallel_devices = self.parallel_devices
        twin.layer_sync = self._layer_sync
        return twin

    def on_exception(self, exception: BaseException) -> None:
        """Stop the processes this one started; explain DDP's unused-parameter error; stay quiet on a peer's failure."""
        if isinstance(exception, RuntimeError) and "Expected to have finished reduction" in str(exception):
            self.reconciliate_processes(repr(exception))
            raise RuntimeError(_UNUSED_PARAMETERS_HINT) from exception
        super().on_exception(exception)

    @classmethod
    def register_strategies(cls, registry: Registry[Strategy]) -> None:
        """Register 'ddp', 'ddp_spawn', 'ddp_fork', 'ddp_notebook' and their find_unused_parameters variants."""
        entries = (
            ("ddp", "popen", "processes started by re-running the script"),
            ("ddp_spawn", "spawn", "processes started with spawn"),
            ("ddp_fork", "fork", "processes started with fork"),
            ("ddp_notebook", "fork", "fork, usable from notebooks"),
        )
        for name, start_method, how in entries:
            registry.register(name, cls, description=f"DistributedDataParallel, {how}.", start_method=start_method)
            for flag in (True, False):
                registry.register(
                    f"{name}_find_unused_parameters_{str(flag).lower()}",
                    cls,
                    description=f"DistributedDataParallel, {how}, find_unused_parameters={flag}.",
                    start_method=start_method,
                    find_unused_parameters=flag,
                )
