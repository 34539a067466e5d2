"""DDPFaultTolerantStrategy: data parallelism across replica groups that survive each other's failures (torchft)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Callable, Mapping

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from phalanx.accelerators.accelerator import Accelerator
from phalanx.plugins.environments.cluster_environment import ClusterEnvironment
from phalanx.plugins.io.checkpoint_io import CheckpointIO
from phalanx.plugins.precision.precision import Precision, evaluates_closure_once
from phalanx.strategies.ddp import DDPStrategy
from phalanx.strategies.fault_tolerant.membership import QuorumMembership
from phalanx.strategies.fault_tolerant.options import FaultTolerance
from phalanx.strategies.fault_tolerant.process_group import cross_group_gloo
from phalanx.strategies.fault_tolerant.schedulers import load_scheduler_states, scheduler_states
from phalanx.strategies.fault_tolerant.semi_sync import SemiSyncGroup
from phalanx.strategies.fault_tolerant.torchft_import import require_torchft
from phalanx.strategies.parallel import DEFAULT_TIMEOUT
from phalanx.strategies.settings import RunSettings
from phalanx.strategies.strategy import Strategy
from phalanx.utilities import distributed
from phalanx.utilities.rank_zero import rank_zero_info, rank_zero_warn
from phalanx.utilities.registry import Registry


class _CommitGate(Optimizer):
    """Steps the wrapped optimizer only when the replica groups' quorum commits the step (``should_commit``)."""

    def __init__(self, optimizer: Optimizer, manager: Any) -> None:
        # Optimizer.__init__ is skipped on purpose: the gate owns no parameters, it forwards to ``optim``.
        self.optim = optimizer
        self.manager = manager
        self.committed = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optim.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.optim.load_state_dict(dict(state_dict))

    def step(self) -> None:  # type: ignore[override]
        # No closure parameter: the precision plugin then runs the closure (forward, backward, gradient all-reduce
        # across groups) before this, and the commit vote sees that step's errors.
        self.committed = bool(self.manager.should_commit())
        if self.committed:
            self.optim.step()


def _average_across_groups(manager: Any, group_size: int, bucket: Any) -> torch.futures.Future[Tensor]:
    """DDP comm hook: average a gradient bucket over the groups in the quorum; a failure only marks the step."""
    buffer = bucket.buffer()
    if group_size > 1:
        # Several processes per group: first their average inside the group (torch's process group of this job, which
        # the group's launcher ends as a whole when one of its processes dies), then across the groups.
        torch.distributed.all_reduce(buffer)
        buffer.div_(group_size)
    # False when a peer failed: the Manager has recorded the error, so should_commit() declines this step and the
    # buffer's (partial) values are never applied.
    manager.allreduce(buffer).wait()
    done: torch.futures.Future[Tensor] = torch.futures.Future()
    done.set_result(buffer)
    return done


#: Declined steps in a row after which a group gives up (each one has waited for its quorum and all-reduce already).
MAX_DECLINED_IN_A_ROW = 10


class DDPFaultTolerantStrategy(DDPStrategy):
    """One DDP replica per replica group; the groups average gradients through torchft and survive each other's loss.

    Each replica group is its own job (one process in this release), started with its group id; a lighthouse forms
    a quorum of the live groups at every step, and a step's update is applied only when the quorum commits it. A
    group that (re)joins receives the weights and optimizer state from a healthy peer before it trains.
    """

    step_collectives = {
        "forward": "torchft DDP forward",
        "backward": "gradient all-reduce across replica groups (torchft Manager)",
        "optimizer_step": "quorum and commit vote across replica groups (torchft Manager)",
    }

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        fault_tolerance: FaultTolerance | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        start_method: str = "popen",
    ) -> None:
        if fault_tolerance is not None and not isinstance(fault_tolerance, FaultTolerance):
            raise TypeError(
                f"DDPFaultTolerantStrategy(fault_tolerance=...) takes a FaultTolerance, got"
                f" {type(fault_tolerance).__name__}."
            )
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
        self._torchft = require_torchft("DDPFaultTolerantStrategy (strategy='ddp_ft')")
        self._fault_tolerance = fault_tolerance
        self._manager: Any = None
        self._loop_position: Callable[[], dict[str, int]] | None = None
        self._load_loop_position: Callable[[Mapping[str, int]], None] | None = None
        self._catch_up: Callable[[Mapping[str, int]], bool] | None = None
        self._callback_states: Callable[[], dict[str, Any]] | None = None
        self._load_callback_states: Callable[[Mapping[str, Any]], None] | None = None
        self._callbacks_received: int | None = None  # how many callbacks' states the latest heal loaded
        self._joining = False  # forming the first quorum, before the loop reads data: a received position applies
        self._quorum_open = False  # the step in progress has its quorum (on_train_start's, a forward's or its own)
        self._declined_in_a_row = 0
        self._semi_sync: SemiSyncGroup | None = None  # torchft's LocalSGD or DiLoCo, with FaultTolerance(semi_sync=...)
        #: Which replica groups the latest quorum had (set when fitting starts); it logs who left and who joined.
        self.membership: QuorumMembership | None = None

    @property
    def fault_tolerance(self) -> FaultTolerance:
        """The options given, else the environment's (REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, TORCHFT_LIGHTHOUSE)."""
        if self._fault_tolerance is None:
            self._fault_tolerance = FaultTolerance.from_environment()
        return self._fault_tolerance

    @property
    def manager(self) -> Any:
        """This group's torchft Manager while fitting (None before setup and after teardown)."""
        return self._manager

    # ------------------------------------------------------------------ data and ranks
    @property
    def is_global_zero(self) -> bool:
        """Rank 0 of replica group 0: the one process of the run that writes checkpoints."""
        return self.global_rank == 0 and self.fault_tolerance.replica_group_id == 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        """Each process of each replica group reads its own share: replicas = groups x processes per group."""
        options = self.fault_tolerance
        return {
            "num_replicas": options.num_replica_groups * self.world_size,
            "rank": options.replica_group_id * self.world_size + self.global_rank,
        }

    # ------------------------------------------------------------------ set-up
    def check_setup(self, settings: RunSettings) -> None:
        """Refuse what this release does not run: manual optimization; with semi_sync, gradient accumulation and
        several processes per group."""
        module = self._module
        if settings.fitting and module is not None and not getattr(module, "automatic_optimization", True):
            raise ValueError(
                "DDPFaultTolerantStrategy supports automatic optimization only: the quorum starts and commits inside"
                " the optimizer step it drives. Set automatic_optimization = True."
            )
        if self.fault_tolerance.semi_sync is None:
            return
        if settings.accumulate_grad_batches > 1:
            raise ValueError(
                f"FaultTolerance(semi_sync=...) synchronises every sync_every optimizer steps and supports"
                f" accumulate_grad_batches=1 only, got {settings.accumulate_grad_batches}. Raise sync_every instead"
                f" (or the batch size)."
            )
        if self.world_size > 1:
            raise ValueError(
                f"FaultTolerance(semi_sync=...) runs one process per replica group in this release, but replica group"
                f" {self.fault_tolerance.replica_group_id} has {self.world_size} (devices x num_nodes). Start each"
                f" group with devices=1 and num_nodes=1, or drop semi_sync."
            )

    def wrap_module_and_optimizers(self, settings: RunSettings) -> None:
        """Join the replica groups' quorum service (a torchft Manager), wrap, then check the optimizers."""
        if settings.fitting and self._manager is None:
            self._loop_position, self._load_loop_position = settings.loop_position, settings.load_loop_position
            self._catch_up = settings.catch_up_loop_position
            self._take_callback_states(settings)
            self._manager = self._make_manager()
        super().wrap_module_and_optimizers(settings)
        if not settings.fitting:
            return
        self._check_optimizers()
        semi_sync = self.fault_tolerance.semi_sync
        if semi_sync is not None and self._semi_sync is None:
            assert self._module is not None
            self._semi_sync = SemiSyncGroup(
                self._torchft.local_sgd, self._manager, self._module, self.optimizers[0], semi_sync
            )

    def _check_optimizers(self) -> None:
        """One optimizer (one commit vote per step) that evaluates its closure once."""
        name = type(self).__name__
        if len(self.optimizers) > 1:
            raise ValueError(
                f"{name} steps one optimizer per step (one commit vote), got {len(self.optimizers)};"
                f" combine their parameter groups into one optimizer."
            )
        for optimizer in self.optimizers:
            if not evaluates_closure_once(optimizer):
                raise ValueError(
                    f"{name} cannot step {type(optimizer).__name__}, which re-evaluates its closure"
                    f" (as LBFGS does): a quorum commits each step once. Use an optimizer such as SGD or AdamW."
                )

    def _wrap(self, module: torch.nn.Module) -> DistributedDataParallel:
        # As torchft.ddp.DistributedDataParallel: a dummy group soaks up DDP's own collectives (one process per group),
        # buckets are never rebuilt (a rejoining group must bucket as its peers do), and the gradients go through the
        # Manager. Its hook
        # is not used: in torchft 0.2.0 it fails an assertion when a peer dies during the all-reduce, killing the
        # surviving group too, where the Manager only needs the error recorded so that the step is not committed.
        # Several processes per group keep the group's own process group: DDP then starts them from rank 0's weights.
        group = None if self.world_size > 1 else self._torchft.process_group.ProcessGroupDummy(0, 1)
        model = DistributedDataParallel(module, process_group=group, find_unused_parameters=True)
        if self.fault_tolerance.semi_sync is None:  # (semi-synchronous groups form no quorum per step)
            # A hand-written loop (the Cohort) runs forward and backward before its optimizer step: the quorum forms
            # before the forward whose backward all-reduces, as torchft's own loop forms it at zero_grad.
            model.register_forward_pre_hook(self._quorum_before_forward)
        # DDP checks a hook's annotations against the classes; this module's are strings (postponed evaluation).
        if self.fault_tolerance.semi_sync is None:  # semi-synchronous groups average gradients inside the group only
            state = (self._manager, self.world_size)
            model.register_comm_hook(state, lambda state, bucket: _average_across_groups(state[0], state[1], bucket))
        return model

    def _make_manager(self) -> Any:
        torchft, options = self._torchft, self.fault_tolerance
        group = cross_group_gloo(torchft, options.connect_timeout, options.step_timeout)
        self.membership = QuorumMembership(options.replica_group_id)
        self.membership.watch(group)
        if options.transport == "pg":
            transport = torchft.pg_transport.PGTransport(group, timeout=options.step_timeout, device=self.root_device)
        else:
            transport = torchft.http_transport.HTTPTransport(timeout=options.step_timeout, num_chunks=0)
        manager = torchft.manager.Manager(
            pg=group,
            load_state_dict=self._load_live_state,
            state_dict=self._live_state,
            min_replica_size=options.min_replicas,
            # A (re)joining group loads the peer's state before its first step and takes part in it at once.
            use_async_quorum=False,
            timeout=options.step_timeout,
            quorum_timeout=options.quorum_timeout,
            connect_timeout=options.connect_timeout,
            rank=self.global_rank,
            world_size=self.world_size,
            store_addr=os.environ["MASTER_ADDR"],
            store_port=int(os.environ["MASTER_PORT"]),
            lighthouse_addr=options.lighthouse,
            replica_id=f"phalanx_group_{options.replica_group_id}",
            checkpoint_transport=transport,
        )
        # More states in torchft's live transfer, loaded in this order after the weights: the callbacks' states, then
        # the loop's counters and data position (whose loading logs what the group received).
        manager.register_state_dict_fn("callbacks", self._load_callbacks, self._callbacks)
        manager.register_state_dict_fn("loop", self._load_position, self._position)
        return manager

    def _live_state(self) -> dict[str, Any]:
        """What a healthy group sends a rejoining one: the weights, the optimizer and the LR schedulers' states."""
        assert self._module is not None
        return {
            "module": self._module.state_dict(),
            "optimizers": [o.state_dict() for o in self.optimizers],
            "schedulers": scheduler_states(self.lr_scheduler_configs),
        }

    def _load_live_state(self, state: dict[str, Any]) -> None:
        assert self._module is not None
        self._module.load_state_dict(state["module"])
        for optimizer, optimizer_state in zip(self.optimizers, state["optimizers"]):
            optimizer.load_state_dict(optimizer_state)
        load_scheduler_states(self.lr_scheduler_configs, state.get("schedulers"))

    def _take_callback_states(self, settings: RunSettings) -> None:
        """Keep the driver's functions that read and load its callbacks' states (None: it has no callbacks)."""
        self._callback_states, self._load_callback_states = settings.callback_states, settings.load_callback_states

    def _callbacks(self) -> dict[str, Any] | None:
        """What a healthy group sends with its weights: its callbacks' states, as a checkpoint stores them."""
        return None if self._callback_states is None else self._callback_states()

    def _load_callbacks(self, states: dict[str, Any] | None) -> None:
        if states is not None and self._load_callback_states is not None:
            self._load_callback_states(states)
            self._callbacks_received = len(states)

    def _received(self, last: str | None = None) -> str:
        """What this group loaded from a peer, as a phrase for the log: the weights, the optimizer state, the LR
        schedulers' and the callbacks' states (where there are), and ``last``."""
        parts = ["weights", "optimizer state"]
        if self.lr_scheduler_configs:
            parts.append(f"the state of {len(self.lr_scheduler_configs)} learning-rate scheduler(s)")
        if self._callbacks_received is not None:
            parts.append(f"the states of {self._callbacks_received} callback(s)")
        parts += [last] if last else []
        return ", ".join(parts[:-1]) + f" and {parts[-1]}"

    def _position(self) -> dict[str, int] | None:
        """What a healthy group sends with its weights: where its loop stands (None without a loop to ask)."""
        if self._loop_position is None:
            return None
        if self._semi_sync is not None and self._semi_sync.stepping is not None:
            # Semi-synchronous groups synchronise after the optimizer step: the joining group starts at the next one.
            return {key: value + 1 if key != "epoch" else value for key, value in self._semi_sync.stepping.items()}
        return self._loop_position()

    def _load_position(self, position: dict[str, int] | None) -> None:
        group = self.fault_tolerance.replica_group_id
        if position is None or self._load_loop_position is None:
            return
        if not self._joining:
            self._catch_up_during_step(position)
            return
        self._load_loop_position(position)
        if "epoch" in position and "batches_done" in position:  # the Trainer's loop
            where = f", epoch {position['epoch']}, batch {position['batches_done']}"
        else:  # a hand-written loop's counters (the Cohort's start_training)
            where = "".join(f", {key}={value}" for key, value in position.items() if key != "global_step")
        rank_zero_info(
            f"Replica group {group} healed from a peer (no checkpoint read): {self._received('loop position')}"
            f" received; it continues at global_step={position['global_step']}{where}."
        )

    def _catch_up_during_step(self, position: dict[str, int]) -> None:
        """A group left out of quorums while alive (slow, not dead) received its peers' state inside a step: it takes
        their counters too, so that it counts and ends as they do (not a step behind, waiting for a quorum alone)."""
        group, step = self.fault_tolerance.replica_group_id, position["global_step"]
        if self._semi_sync is None and self._catch_up is not None and self._catch_up(position):
            rank_zero_info(
                f"Replica group {group} fell behind its peers (left out of a quorum) and took their"
                f" {self._received('loop counters')} during a step: it continues at global_step={step}, epoch"
                f" {position['epoch']}, batch {position['batches_done']}; the batch it had read trains in this step,"
                f" and its share of the steps it missed is skipped."
            )
            return
        # The loop is inside a batch of another epoch: its data position cannot move there.
        rank_zero_warn(
            f"Replica group {group} fell behind its peers and received their {self._received()} during"
            f" a step; its loop counters and data position stay its own (global_step of the peer: {step})."
        )

    # ------------------------------------------------------------------ steps
    def on_train_start(self) -> None:
        """Form the first step's quorum before the loop reads data: a group behind its peers takes their state, its
        loop's counters and data position included, and then reads its share from the same place."""
        manager = self._manager
        if manager is None or self._quorum_open:
            return
        self._join_first_quorum(manager)
        if self._semi_sync is not None:
            self._semi_sync.join()  # the groups' next quorum forms at their next synchronisation
            return
        self._quorum_open = True
        if self.world_size > 1:
            # torchft spreads a first quorum's state transfers over the groups by rank in the group (rank r copies
            # from group r mod groups): the processes of one group may have received different groups' weights.
            assert self._module is not None
            with distributed.naming_collective_failures(
                "broadcast(weights inside the replica group)", self.global_rank, self._timeout
            ):
                for tensor in self._module.state_dict().values():
                    torch.distributed.broadcast(tensor, src=0)

    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: torch.nn.Module | None = None, **kwargs: Any
    ) -> Any:
        """Form this step's quorum, run the closure (gradients averaged across groups), step only if committed."""
        manager, semi_sync = self._manager, self._semi_sync
        if manager is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        if semi_sync is not None:
            # Every step is local; torchft's hooks on the optimizer synchronise the groups every sync_every steps.
            semi_sync.stepping = None if self._loop_position is None else self._loop_position()
            try:
                return super().optimizer_step(optimizer, closure, model, **kwargs)
            finally:
                semi_sync.stepping = None
        step = super().optimizer_step
        return self._committed_step(manager, optimizer, lambda gate: step(gate, closure, model, **kwargs))

    def _join_first_quorum(self, manager: Any) -> None:
        """Form the first quorum while the loop has not read data: a received loop position applies."""
        self._joining = True
        try:
            self._start_quorum(manager)
        finally:
            self._joining = False

    def _committed_step(self, manager: Any, optimizer: Optimizer, step: Callable[[Optimizer], Any]) -> Any:
        """Form this step's quorum (unless on_train_start or a training forward did), run ``step`` with the optimizer
        behind a commit gate, and count declined steps in a row."""
        if not self._quorum_open:
            self._start_quorum(manager)
        self._quorum_open = True  # the closure's forward finds it formed
        gate = _CommitGate(optimizer, manager)
        try:
            result = step(gate)
        finally:
            self._quorum_open = False
        self.last_step_committed = gate.committed
        self._declined_in_a_row = 0 if gate.committed else self._declined_in_a_row + 1
        if self._declined_in_a_row >= MAX_DECLINED_IN_A_ROW:
            # The loop trains a declined batch again: a quorum that never commits would otherwise retry it forever.
            raise RuntimeError(
                f"The replica groups' quorum declined {self._declined_in_a_row} steps in a row on replica group"
                f" {self.fault_tolerance.replica_group_id}; each failed in the gradient all-reduce or the commit."
                " Look at the other groups' logs and the lighthouse for the failing group, then restart this one."
            )
        return result

    def _quorum_before_forward(self, model: DistributedDataParallel, args: Any) -> None:
        # Only a forward whose backward all-reduces: not evaluation (no grad), not no_sync's accumulation micro-batches.
        if self._quorum_open or self._manager is None or not torch.is_grad_enabled():
            return
        if model.require_backward_grad_sync:
            self._start_quorum(self._manager)
            self._quorum_open = True

    def _start_quorum(self, manager: Any) -> None:
        options = self.fault_tolerance
        try:
            manager.start_quorum()
        except Exception as error:
            raise TimeoutError(
                f"Replica group {options.replica_group_id} formed no quorum of at least {options.min_replicas} replica"
                f" group(s) within quorum_timeout={options.quorum_timeout} at the lighthouse {options.lighthouse}:"
                f" {error}. Check that the lighthouse runs there and that the other groups were started."
            ) from error

    def teardown(self) -> None:
        """Leave the quorum service (stops this group's manager server and state transport), then as DDP."""
        manager, self._manager = self._manager, None
        self._quorum_open = False
        if self._semi_sync is not None:
            self._semi_sync.close()
            self._semi_sync = None
        if manager is not None:
            manager.shutdown(wait=False)
        super().teardown()

    @classmethod
    def register_strategies(cls, registry: Registry[Strategy]) -> None:
        """Register 'ddp_ft'."""
        registry.register(
            "ddp_ft", cls, description="DDP across fault-tolerant replica groups (torchft; pip install 'phalanx[ft]')."
        )
