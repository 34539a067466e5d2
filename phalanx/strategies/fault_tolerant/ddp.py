"""DDPFaultTolerantStrategy: data parallelism across replica groups that survive each other's failures (torchft)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from phalanx.accelerators.accelerator import Accelerator
from phalanx.optimization import load_scheduler_states, scheduler_states
from phalanx.plugins.environments.cluster_environment import ClusterEnvironment
from phalanx.plugins.io.checkpoint_io import CheckpointIO
from phalanx.plugins.precision.precision import Precision
from phalanx.strategies.ddp import DDPStrategy
from phalanx.strategies.fault_tolerant.membership import QuorumMembership
from phalanx.strategies.fault_tolerant.options import FaultTolerance
from phalanx.strategies.fault_tolerant.replica_group import PEER_STATE, GroupProcess, ReplicaGroup
from phalanx.strategies.parallel import DEFAULT_TIMEOUT
from phalanx.strategies.settings import RunSettings
from phalanx.strategies.strategy import Strategy
from phalanx.utilities import distributed
from phalanx.utilities.registry import Registry


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
        # First: it refuses options of another type and a missing torchft before anything is set up.
        self._replica_group = ReplicaGroup("DDPFaultTolerantStrategy", "ddp_ft", fault_tolerance)
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

    @property
    def fault_tolerance(self) -> FaultTolerance:
        """The options given, else the environment's (REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, TORCHFT_LIGHTHOUSE)."""
        return self._replica_group.fault_tolerance

    @property
    def manager(self) -> Any:
        """This group's torchft Manager while fitting (None before setup and after teardown)."""
        return self._replica_group.manager

    @property
    def membership(self) -> QuorumMembership | None:
        """Which replica groups the latest quorum had (set when fitting starts); it logs who left and who joined."""
        return self._replica_group.membership

    # ------------------------------------------------------------------ data and ranks
    @property
    def is_global_zero(self) -> bool:
        """Rank 0 of replica group 0: the one process of the run that writes checkpoints."""
        return self._replica_group.is_global_zero(self.global_rank)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        """Each process of each replica group reads its own share: replicas = groups x processes per group."""
        return self._replica_group.sampler_kwargs(self.global_rank, self.world_size)

    # ------------------------------------------------------------------ set-up
    def check_setup(self, settings: RunSettings) -> None:
        """Refuse what this release does not run: manual optimization; with semi_sync, gradient accumulation and
        several processes per group."""
        self._replica_group.check_automatic_optimization(settings, self._module)
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
        group = self._replica_group
        if settings.fitting and group.manager is None:
            process = GroupProcess(
                self.global_rank, self.world_size, self.root_device, self._live_state, self._load_live_state
            )
            group.start(settings, process, catch_up=settings.catch_up_loop_position, barrier=self.barrier)
        super().wrap_module_and_optimizers(settings)
        if not settings.fitting:
            return
        group.check_optimizers(self.optimizers)
        assert self._module is not None
        group.start_semi_sync(self._module, self.optimizers)

    def _wrap(self, module: torch.nn.Module) -> DistributedDataParallel:
        # As torchft.ddp.DistributedDataParallel: a dummy group soaks up DDP's own collectives (one process per group),
        # buckets are never rebuilt (a rejoining group must bucket as its peers do), and the gradients go through the
        # Manager. Its hook
        # is not used: in torchft 0.2.0 it fails an assertion when a peer dies during the all-reduce, killing the
        # surviving group too, where the Manager only needs the error recorded so that the step is not committed.
        # Several processes per group keep the group's own process group: DDP then starts them from rank 0's weights.
        torchft = self._replica_group.torchft
        group = None if self.world_size > 1 else torchft.process_group.ProcessGroupDummy(0, 1)
        model = DistributedDataParallel(module, process_group=group, find_unused_parameters=True)
        if self.fault_tolerance.semi_sync is None:  # (semi-synchronous groups form no quorum per step)
            # A hand-written loop (the Cohort) runs forward and backward before its optimizer step: the quorum forms
            # before the forward whose backward all-reduces, as torchft's own loop forms it at zero_grad.
            model.register_forward_pre_hook(self._quorum_before_forward)
        # DDP checks a hook's annotations against the classes; this module's are strings (postponed evaluation).
        if self.fault_tolerance.semi_sync is None:  # semi-synchronous groups average gradients inside the group only
            state = (self._replica_group.manager, self.world_size)
            model.register_comm_hook(state, lambda state, bucket: _average_across_groups(state[0], state[1], bucket))
        return model

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
        load_scheduler_states(self.lr_scheduler_configs, state.get("schedulers"), PEER_STATE)

    # ------------------------------------------------------------------ steps
    def on_train_start(self) -> None:
        """Form the first step's quorum before the loop reads data: a group behind its peers takes their state, its
        loop's counters and data position included, and then reads its share from the same place."""
        if self._replica_group.join_first_quorum() and self.world_size > 1:
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
        step, group = super().optimizer_step, self._replica_group
        result = group.optimizer_step(optimizer, lambda gate: step(gate, closure, model, **kwargs))
        self.last_step_committed = group.last_step_committed
        return result

    def _quorum_before_forward(self, model: DistributedDataParallel, args: Any) -> None:
        # Only a forward whose backward all-reduces: not evaluation (no grad), not no_sync's accumulation micro-batches.
        if torch.is_grad_enabled() and model.require_backward_grad_sync:
            self._replica_group.open_quorum()

    def teardown(self) -> None:
        """Leave the quorum service (stops this group's manager server and state transport), then as DDP."""
        self._replica_group.leave()
        super().teardown()

    @classmethod
    def register_strategies(cls, registry: Registry[Strategy]) -> None:
        """Register 'ddp_ft'."""
        registry.register(
            "ddp_ft", cls, description="DDP across fault-tolerant replica groups (torchft; pip install 'phalanx[ft]')."
        )
