"""HivemindStrategy: train one module collaboratively with peers that come and go, through hivemind's DHT.

Each peer is one process on one device. Peers find each other through a DHT (``initial_peers``), accumulate gradients
until the whole swarm has processed ``target_batch_size`` samples, average them and step together
(``hivemind.Optimizer``). hivemind is imported only when a run starts, so that phalanx can list this strategy (it
loads every entry point to do so) without paying for it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import torch
from torch import nn
from torch.optim import Optimizer

from phalanx.accelerators.accelerator import Accelerator
from phalanx.plugins.io.checkpoint_io import CheckpointIO
from phalanx.plugins.precision.precision import Precision
from phalanx.strategies import RunSettings, SingleDeviceStrategy, StrategyTraits
from phalanx.utilities.exceptions import CheckpointError
from phalanx_hivemind import options, trust
from phalanx_hivemind.download import (
    SwarmStateError,
    bound_state_download,
    keep_schedule_on_download,
    refresh_swarm_progress,
)
from phalanx_hivemind.swarm import SwarmProgress, SwarmScheduler

log = logging.getLogger("phalanx_hivemind")

#: Listen on every interface, on a port the system picks; give host_maddrs to fix the port (e.g. for a firewall).
DEFAULT_HOST_MADDRS = ("/ip4/0.0.0.0/tcp/0",)
#: Precisions whose optimizer step hivemind can run as is (float16 loss scaling would need hivemind's GradScaler).
PRECISIONS = ("32-true", "bf16-mixed")
#: The key of a checkpoint's swarm position (the Trainer's format, read with weights_only=True).
CHECKPOINT_KEY = "hivemind"


class HivemindStrategy(SingleDeviceStrategy):
    """Collaborative training with hivemind: one process per peer, peers joining and leaving at any time."""

    def __init__(
        self,
        target_batch_size: int | None = None,
        *,
        run_id: str | None = None,
        initial_peers: Sequence[str] | str | None = None,
        host_maddrs: Sequence[str] | str | None = None,
        announce_maddrs: Sequence[str] | str | None = None,
        client_mode: bool = False,
        batch_size: int | None = None,
        matchmaking_time: float = 5.0,
        averaging_timeout: float = 30.0,
        load_state_timeout: float = 60.0,
        use_local_updates: bool = False,
        offload_optimizer: bool = False,
        delay_optimizer_step: bool = False,
        delay_grad_averaging: bool = False,
        delay_state_averaging: bool = False,
        average_state_every: int = 1,
        grad_compression: Any = "none",
        state_compression: Any = "none",
        log_progress: bool = True,
        verbose: bool = False,
        max_averaged_grad_ratio: float | None = trust.DEFAULT_MAX_AVERAGED_GRAD_RATIO,
        max_averaged_state_ratio: float | None = trust.DEFAULT_MAX_AVERAGED_STATE_RATIO,
        authorizer: Any = None,
        device: str | int | torch.device = "cpu",
        accelerator: Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            device=device, accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin
        )
        self.target_batch_size = options.target_batch_size(target_batch_size)
        self.run_id = options.run_id(run_id)
        self.initial_peers = options.initial_peers(initial_peers)
        self.host_maddrs = options.addresses("host_maddrs", host_maddrs) or list(DEFAULT_HOST_MADDRS)
        self.announce_maddrs = options.addresses("announce_maddrs", announce_maddrs)
        self.batch_size = None if batch_size is None else options.positive_int("batch_size", batch_size)
        self.average_state_every = options.positive_int("average_state_every", average_state_every)
        self.matchmaking_time = options.positive_seconds("matchmaking_time", matchmaking_time)
        self.averaging_timeout = options.positive_seconds("averaging_timeout", averaging_timeout)
        self.load_state_timeout = options.positive_seconds("load_state_timeout", load_state_timeout)
        flags = dict(
            client_mode=client_mode,
            use_local_updates=use_local_updates,
            offload_optimizer=offload_optimizer,
            delay_optimizer_step=delay_optimizer_step,
            delay_grad_averaging=delay_grad_averaging,
            delay_state_averaging=delay_state_averaging,
            log_progress=log_progress,
            verbose=verbose,
        )
        for name, value in flags.items():
            setattr(self, name, options.flag(name, value))
        self.grad_compression = options.compression("grad_compression", grad_compression)
        self.state_compression = options.compression("state_compression", state_compression)
        options.check_delays(offload_optimizer, delay_optimizer_step, delay_grad_averaging, delay_state_averaging)
        options.check_local_updates(use_local_updates, delay_grad_averaging, self.grad_compression)
        self.max_averaged_grad_ratio = options.ratio("max_averaged_grad_ratio", max_averaged_grad_ratio)
        self.max_averaged_state_ratio = options.ratio("max_averaged_state_ratio", max_averaged_state_ratio)
        self.authorizer = options.authorizer(authorizer)
        self._dht: Any = None
        self._hivemind_optimizer: Any = None
        self._current_batch_size: int | None = None
        self._restored_epoch: int | None = None
        self._logged_epoch = -1
        self._in_step_with_swarm = False  # until the first step of a fit: see _catch_up_with_swarm

    # ------------------------------------------------------------------ the swarm
    @property
    def dht(self) -> Any:
        """The running ``hivemind.DHT`` (None before ``setup_environment`` and after ``teardown``)."""
        return self._dht

    @property
    def hivemind_optimizer(self) -> Any:
        """The ``hivemind.Optimizer`` wrapping the module's optimizer (None outside a fit)."""
        return self._hivemind_optimizer

    @property
    def visible_addresses(self) -> list[str]:
        """This peer's addresses as other peers pass them in ``initial_peers`` (empty before the DHT starts)."""
        if self._dht is None:
            return []
        return [str(address) for address in self._dht.get_visible_maddrs()]

    @property
    def swarm_progress(self) -> SwarmProgress | None:
        """The swarm's step, size and accumulated samples as this peer last saw them (None outside a fit)."""
        optimizer = self._hivemind_optimizer
        if optimizer is None:
            return None
        tracker = optimizer.tracker
        overall = tracker.global_progress
        return SwarmProgress(
            epoch=optimizer.local_epoch,
            global_epoch=overall.epoch,
            samples_accumulated=overall.samples_accumulated,
            target_batch_size=self.target_batch_size,
            num_peers=overall.num_peers,
            local_samples_accumulated=tracker.local_progress.samples_accumulated,
        )

    def setup_environment(self) -> None:
        """Select the device and join (or start) the swarm's DHT."""
        super().setup_environment()
        if self._dht is None:
            self._dht = self._start_dht()

    def _start_dht(self) -> Any:
        import hivemind

        try:
            dht = hivemind.DHT(
                start=True,
                initial_peers=self.initial_peers,
                host_maddrs=self.host_maddrs,
                announce_maddrs=self.announce_maddrs,
                client_mode=self.client_mode,
                # Signs and checks every DHT request and response: who may read and write the swarm's records.
                **({} if self.authorizer is None else {"authorizer": self.authorizer}),
            )
        except Exception as error:
            where = f"the initial peers {self.initial_peers}" if self.initial_peers else "no initial peers"
            raise RuntimeError(
                f"HivemindStrategy could not start its DHT (host_maddrs={self.host_maddrs}, {where}):"
                f" {type(error).__name__}: {error}. Check that the addresses are reachable from this machine and that"
                " the peers are still running."
            ) from error
        addresses = ",".join(str(address) for address in dht.get_visible_maddrs())
        action = "joined the swarm through " + ",".join(self.initial_peers) if self.initial_peers else "started a swarm"
        log.info(
            "hivemind: run %r %s; other peers join with initial_peers=[...] or %s=%s",
            self.run_id,
            action,
            options.INITIAL_PEERS_ENV,
            addresses,
        )
        return dht

    # ------------------------------------------------------------------ set-up
    @classmethod
    def precision_plugin_for(cls, precision: str, accelerator: Accelerator) -> Precision:
        """Only precisions without loss scaling: hivemind steps the optimizer itself."""
        _check_precision(precision)
        return super().precision_plugin_for(precision, accelerator)

    def check_setup(self, settings: RunSettings) -> None:
        """Refuse what the swarm cannot run: loss scaling, accumulate_grad_batches."""
        _check_precision(self.precision_plugin.precision)
        if settings.fitting and settings.accumulate_grad_batches != 1:
            raise ValueError(
                f"accumulate_grad_batches={settings.accumulate_grad_batches} does not apply to HivemindStrategy: the"
                " swarm accumulates gradients until target_batch_size samples. Remove accumulate_grad_batches and"
                " set target_batch_size."
            )

    def finish_setup(self, settings: RunSettings) -> None:
        """When fitting, wrap the optimizer in a ``hivemind.Optimizer`` bound to the swarm."""
        if settings.fitting:
            self._join_swarm()

    def _join_swarm(self) -> None:
        if self._dht is None:
            raise RuntimeError("HivemindStrategy.setup() needs the DHT: call setup_environment() first.")
        if len(self.optimizers) != 1:
            raise ValueError(
                f"HivemindStrategy trains with exactly one optimizer; configure_optimizers returned"
                f" {len(self.optimizers)}."
            )
        scheduler = self._scheduler_for_hivemind()
        optimizer = self.optimizers[0]
        from phalanx_hivemind.guarded import GuardedOptimizer

        self._hivemind_optimizer = GuardedOptimizer(
            max_averaged_grad_ratio=self.max_averaged_grad_ratio,
            max_averaged_state_ratio=self.max_averaged_state_ratio,
            dht=self._dht,
            run_id=self.run_id,
            target_batch_size=self.target_batch_size,
            batch_size_per_step=self.batch_size,
            # With offloading, hivemind keeps its own copy of the parameters and builds the optimizer over it.
            optimizer=_rebuild_with(type(optimizer)) if self.offload_optimizer else optimizer,
            params=optimizer.param_groups if self.offload_optimizer else None,
            scheduler=scheduler,
            matchmaking_time=self.matchmaking_time,
            averaging_timeout=self.averaging_timeout,
            load_state_timeout=self.load_state_timeout,
            offload_optimizer=self.offload_optimizer,
            delay_optimizer_step=self.delay_optimizer_step,
            delay_grad_averaging=self.delay_grad_averaging,
            delay_state_averaging=self.delay_state_averaging,
            average_state_every=self.average_state_every,
            use_local_updates=self.use_local_updates,
            client_mode=self.client_mode,
            grad_compression=options.make_compression(self.grad_compression),
            state_averaging_compression=options.make_compression(self.state_compression),
            load_state_compression=options.make_compression(self.state_compression),
            verbose=self.verbose,
            # hivemind warns (and may deadlock in rare cases) when a request may outlast the matchmaking window.
            averager_opts=dict(request_timeout=min(3.0, 0.6 * self.matchmaking_time)),
        )
        if scheduler is not None:
            keep_schedule_on_download(self._hivemind_optimizer.state_averager)
        bound_state_download(self._hivemind_optimizer, self.load_state_timeout)
        self.optimizers = [self._hivemind_optimizer]
        self._logged_epoch = -1
        self._in_step_with_swarm = False

    def _scheduler_for_hivemind(self) -> Any:
        """The one LR scheduler hivemind will step per swarm step; the driver keeps a handle that does not step."""
        configs = self.lr_scheduler_configs
        if not configs:
            return None
        if len(configs) > 1:
            raise ValueError(
                f"HivemindStrategy supports one LR scheduler; configure_optimizers returned {len(configs)}."
            )
        config = configs[0]
        if config.reduce_on_plateau:
            raise ValueError(
                "HivemindStrategy cannot follow a ReduceLROnPlateau (or monitored) scheduler: the learning rate must"
                " change with the swarm's step count, identically on every peer. Use a step-based scheduler."
            )
        if self.offload_optimizer:
            raise ValueError(
                "HivemindStrategy(offload_optimizer=True) re-creates the optimizer inside hivemind, so the LR"
                " scheduler from configure_optimizers cannot follow it; train without a scheduler or with"
                " offload_optimizer=False."
            )
        self.lr_scheduler_configs = [dataclasses.replace(config, scheduler=SwarmScheduler(config.scheduler))]
        return config.scheduler

    # ------------------------------------------------------------------ training
    def on_train_start(self) -> None:
        """Nothing yet: the swarm is looked at right before the fit's first batch (``_catch_up_with_swarm``)."""
        self._in_step_with_swarm = False

    def _catch_up_with_swarm(self) -> bool:
        """Before this peer's first step: read the swarm's progress afresh and, if the swarm is ahead, download its
        state; each bounded by ``load_state_timeout`` (``SwarmStateError`` otherwise). True if a state came.

        Done at the first batch, after every ``on_train_start`` hook (which may take long: a joining peer's callbacks,
        its data), from a reading of the DHT made then: hivemind's own check at a step compares with a reading that
        may be older than that, and a peer that took the swarm to be where it last looked stepped from its own
        parameters, averaging them into the swarm's.
        """
        self._in_step_with_swarm = True
        optimizer = self._hivemind_optimizer
        if self._restored_epoch is not None:  # a resumed swarm position
            optimizer.state_averager.local_epoch = self._restored_epoch
            optimizer.tracker.report_local_progress(self._restored_epoch, 0)
            self._restored_epoch = None
        if self.offload_optimizer:
            self._copy_module_into_offloaded_parameters()
        if not refresh_swarm_progress(optimizer.tracker, self.load_state_timeout):
            raise SwarmStateError(
                f"hivemind: this peer could not read the swarm's progress from the DHT within"
                f" load_state_timeout={self.load_state_timeout:g}s before its first step. Check initial_peers and"
                " that the peers are reachable, or raise load_state_timeout."
            )
        if optimizer.tracker.global_epoch <= optimizer.local_epoch:
            return False
        log.info(
            "hivemind: the swarm is at step %d, this peer at %d: downloading the state from a peer",
            optimizer.tracker.global_epoch,
            optimizer.local_epoch,
        )
        optimizer.load_state_from_peers(require_state=True)
        return True

    def _copy_module_into_offloaded_parameters(self) -> None:
        # hivemind copied the parameters when it was built; a checkpoint restored since then changed the module.
        optimizer = self._hivemind_optimizer
        offloaded = [p for group in optimizer.opt.param_groups for p in group["params"]]
        with torch.no_grad():
            for source, target in zip(optimizer.state_averager.main_parameters, offloaded):
                target.copy_(source)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Before the fit's first batch, catch up with the swarm; note the batch's size (hivemind counts samples
        towards ``target_batch_size``)."""
        if not self._in_step_with_swarm and self._hivemind_optimizer is not None:
            self._catch_up_with_swarm()
        if self.batch_size is None:
            self._current_batch_size = _batch_size_of(batch)

    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: nn.Module | None = None, **kwargs: Any
    ) -> Any:
        """Accumulate this batch's gradients into the swarm's step; the update happens when the swarm is ready."""
        if optimizer is self._hivemind_optimizer and not self._in_step_with_swarm and self._catch_up_with_swarm():
            # A loop without batch hooks (phalanx.Cohort) meets the swarm here: gradients computed on parameters the
            # swarm had left behind are dropped, as hivemind drops them when it finds a peer out of step.
            return None
        if optimizer is self._hivemind_optimizer and "batch_size" not in kwargs:
            kwargs["batch_size"] = self._step_batch_size()
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        if optimizer is self._hivemind_optimizer:
            self._report_progress()
        return result

    def _step_batch_size(self) -> int:
        size = self.batch_size or self._current_batch_size
        if size is None:
            raise ValueError(
                "HivemindStrategy could not tell how many samples this step holds (the batch has no tensor with a"
                " batch dimension, or no batch was seen, as in a phalanx.Cohort loop); pass"
                " HivemindStrategy(batch_size=...)."
            )
        return size

    def _report_progress(self) -> None:
        progress = self.swarm_progress
        assert progress is not None
        if progress.epoch != self._logged_epoch:
            self._logged_epoch = progress.epoch
            log.info(
                "hivemind: swarm step %d (%d peer(s); %d of %d samples towards the next step)",
                progress.epoch,
                progress.num_peers,
                progress.samples_accumulated,
                progress.target_batch_size,
            )
        module = self.module
        if self.log_progress and getattr(module, "_trainer", None) is not None:
            # Through the module's logging: the Trainer's loggers and callback_metrics get the swarm's progress.
            for name, value in (
                ("swarm/epoch", progress.epoch),
                ("swarm/peers", progress.num_peers),
                ("swarm/samples_accumulated", progress.samples_accumulated),
            ):
                module.log(name, float(value), on_step=True, on_epoch=False, batch_size=1)  # type: ignore[union-attr]

    def declare_traits(self) -> StrategyTraits:
        """hivemind accumulates until the swarm reaches ``target_batch_size`` (the driver steps every batch), and the
        optimizer must be known at ``setup`` (hivemind wraps it; Cohort.setup_module is refused)."""
        return dataclasses.replace(
            super().declare_traits(), handles_gradient_accumulation=True, wraps_module_with_optimizers=True
        )

    # ------------------------------------------------------------------ checkpoints
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The wrapped torch optimizer's state (the swarm step is saved beside it, under ``'hivemind'``)."""
        if optimizer is self._hivemind_optimizer:
            return optimizer.opt.state_dict()
        return super().optimizer_state(optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write the checkpoint with this peer's swarm step and run id added."""
        if self._hivemind_optimizer is not None:
            swarm = {"epoch": int(self._hivemind_optimizer.local_epoch), "run_id": self.run_id}
            checkpoint = {**checkpoint, CHECKPOINT_KEY: swarm}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any) -> dict[str, Any]:
        """Read a checkpoint and remember its swarm step (applied when training starts)."""
        checkpoint = super().load_checkpoint(checkpoint_path)
        self._restored_epoch = _saved_epoch(checkpoint, checkpoint_path)
        return checkpoint

    # ------------------------------------------------------------------ the end
    def teardown(self) -> None:
        """Say goodbye to the swarm (shut the averagers and the DHT down); the optimizer's state stays readable."""
        optimizer = self._hivemind_optimizer
        if optimizer is not None and optimizer.is_alive():
            optimizer.shutdown()  # kept: the driver may still save a checkpoint after teardown
        dht, self._dht = self._dht, None
        if dht is not None:
            dht.shutdown()
        super().teardown()

    @classmethod
    def register_strategies(cls, registry: Any) -> None:
        """Register "hivemind" (its options from the arguments of ``HivemindStrategy`` or the environment)."""
        registry.register(
            "hivemind",
            cls,
            description="Collaborative training over the internet with hivemind (phalanx-hivemind).",
        )

    def __repr__(self) -> str:
        return (
            f"HivemindStrategy(run_id={self.run_id!r}, target_batch_size={self.target_batch_size},"
            f" initial_peers={self.initial_peers}, device={self.root_device})"
        )


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(
            f"HivemindStrategy cannot train with precision={precision!r}: hivemind steps the optimizer itself, without"
            f" phalanx's loss scaling. Choose one of {list(PRECISIONS)}."
        )


def _rebuild_with(optimizer_class: type) -> Callable[[Any], Optimizer]:
    # Each parameter group carries its hyperparameters, so the class alone rebuilds the same optimizer.
    def build(param_groups: Any) -> Optimizer:
        return optimizer_class(param_groups)

    return build


def _batch_size_of(batch: Any) -> int | None:
    """The size of the first dimension of the first tensor found in ``batch`` (None when there is none)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else None
    if isinstance(batch, Mapping):
        items: Sequence[Any] = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        items = batch
    else:
        return None
    for item in items:
        size = _batch_size_of(item)
        if size is not None:
            return size
    return None


def _saved_epoch(checkpoint: dict[str, Any], path: Any) -> int | None:
    """The swarm step saved in ``checkpoint['hivemind']`` (None for a checkpoint written by another strategy)."""
    swarm = checkpoint.get(CHECKPOINT_KEY)
    if swarm is None:
        return None
    epoch = swarm.get("epoch") if isinstance(swarm, dict) else None
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise CheckpointError(
            f"{path}: checkpoint[{CHECKPOINT_KEY!r}] holds {swarm!r}; expected a dict with an int 'epoch' >= 0 (the"
            " swarm step saved by HivemindStrategy)."
        )
    return epoch
