"""HSDPFaultTolerantStrategy: FSDP inside each replica group, fault-tolerant replication across the groups (torchft)."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any, Callable

import torch
from torch import Tensor
from torch.optim import Optimizer

from phalanx.accelerators.accelerator import Accelerator
from phalanx.optimization import load_scheduler_states, scheduler_states
from phalanx.plugins.environments.cluster_environment import ClusterEnvironment
from phalanx.plugins.io.checkpoint_io import CheckpointIO
from phalanx.plugins.precision.precision import Precision
from phalanx.strategies.fault_tolerant.membership import QuorumMembership
from phalanx.strategies.fault_tolerant.options import FaultTolerance
from phalanx.strategies.fault_tolerant.replica_group import PEER_STATE, GroupProcess, ReplicaGroup
from phalanx.strategies.fsdp._fsdp1_arguments import HYBRID_STRATEGIES
from phalanx.strategies.fsdp.strategy import FSDPStrategy
from phalanx.strategies.parallel import DEFAULT_TIMEOUT
from phalanx.strategies.settings import RunSettings
from phalanx.strategies.strategy import Strategy
from phalanx.strategies.traits import StrategyTraits
from phalanx.utilities.dtensor import is_dtensor
from phalanx.utilities.registry import Registry


def _average_shard_across_groups(manager: Any, shard: Tensor) -> None:
    """FSDP all-reduce hook: average this process's reduce-scattered gradient shard with the same shard of every other
    group in the quorum; a failure only marks the step (the Manager records it, should_commit() declines)."""
    manager.allreduce(shard).wait()


def _local(value: Any) -> Any:
    return value.to_local() if is_dtensor(value) else value


class HSDPFaultTolerantStrategy(FSDPStrategy):
    """FSDP over the processes of one replica group; the groups average gradient shards through torchft.

    Inside a group, the parameters, gradients and optimizer state are sharded over its processes (the shard axis of
    ``parallel_dims()``); across the groups (the replicate axis, torchft's), process ``r`` of every group holds the
    same shard and averages its reduce-scattered gradients with them at each step. A step's update is applied only
    when the quorum commits it. A (re)joining group receives each shard from the process of a healthy group with the
    same rank, with the optimizer state's shard and the loop position; every group must shard alike (the same number
    of processes and the same model).
    """

    step_collectives = {
        "forward": "FSDP parameter all-gather inside the replica group (forward)",
        "backward": "FSDP reduce-scatter inside the group, gradient-shard all-reduce across groups (torchft Manager)",
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
        **fsdp_options: Any,
    ) -> None:
        # First: it refuses options of another type and a missing torchft before anything is set up.
        self._replica_group = ReplicaGroup("HSDPFaultTolerantStrategy", "hsdp_ft", fault_tolerance)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            **fsdp_options,
        )
        if self.sharding_strategy in HYBRID_STRATEGIES or self.sharding_strategy == "NO_SHARD":
            raise ValueError(
                f"HSDPFaultTolerantStrategy(sharding_strategy={self.sharding_strategy!r}) is not valid: a replica group"
                f" shards over all its processes and the groups are the replicas. Use 'FULL_SHARD' or 'SHARD_GRAD_OP'."
            )
        if self._state_dict_type != "full":
            raise ValueError(
                "HSDPFaultTolerantStrategy writes whole checkpoint files (state_dict_type='full') from replica group 0;"
                " a sharded directory is not offered in this release."
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

    @property
    def is_global_zero(self) -> bool:
        """Rank 0 of replica group 0: the one process of the run that writes checkpoints."""
        return self._replica_group.is_global_zero(self.global_rank)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        """Each process of each replica group reads its own share: replicas = groups x processes per group."""
        return self._replica_group.sampler_kwargs(self.global_rank, self.world_size)

    def declare_traits(self) -> StrategyTraits:
        """As FSDP's, and the Cohort is not offered (as for ddp_ft: the quorum starts in the Trainer's hooks)."""
        return dataclasses.replace(
            super().declare_traits(),
            cohort_unsupported=(
                "HSDPFaultTolerantStrategy forms each step's quorum in the Trainer's on_train_start and optimizer_step;"
                " the Cohort's loop runs the gradient reduction before any quorum. Use it with the Trainer."
            ),
        )

    def check_setup(self, settings: RunSettings) -> None:
        """Refuse what this release does not run: manual optimization, semi-synchronous groups, a replicate axis
        inside the group."""
        self._replica_group.check_automatic_optimization(settings, self._module)
        if self.fault_tolerance.semi_sync is not None:
            raise ValueError(
                "FaultTolerance(semi_sync=...) is offered by strategy='ddp_ft' only in this release; drop semi_sync"
                " for 'hsdp_ft'."
            )
        dims = self.parallel_dims()
        if dims.data_replicate != 1:
            raise ValueError(
                f"HSDPFaultTolerantStrategy replicates across replica groups only, but the group's mesh has"
                f" data_replicate={dims.data_replicate}. Start each replica group as one shard group."
            )

    def wrap_module_and_optimizers(self, settings: RunSettings) -> None:
        """Join the replica groups' quorum service (a torchft Manager), shard as FSDP, then hook the gradient shards."""
        from torch.distributed.fsdp import FSDPModule  # lazy for import time, as FSDPStrategy does

        group = self._replica_group
        if settings.fitting and group.manager is None:
            process = GroupProcess(
                self.global_rank, self.world_size, self.root_device, self._live_state, self._load_live_state
            )
            # No catch-up: a slow group keeps its own loop counters (a warning says so); ddp_ft's is untested here.
            group.start(settings, process, catch_up=None, barrier=self.barrier)
        super().wrap_module_and_optimizers(settings)
        if not settings.fitting:
            return
        group.check_optimizers(self.optimizers)
        assert self._module is not None
        manager = group.manager
        for sub in self._module.modules():
            if isinstance(sub, FSDPModule):
                sub.set_all_reduce_hook(lambda shard: _average_shard_across_groups(manager, shard))

    # ------------------------------------------------------------------ live state, shard by shard
    def _live_state(self) -> dict[str, Any]:
        """What this process sends the process with its rank in a rejoining group: its shards of the weights and of
        the optimizer state (plain tensors: the receiver puts them back on its own mesh), and the LR schedulers'
        states (whole on every process)."""
        assert self._module is not None
        optimizers = []
        for optimizer in self.optimizers:
            state = optimizer.state_dict()
            sharded = [
                [pid, key] for pid, entries in state["state"].items() for key, v in entries.items() if is_dtensor(v)
            ]
            local = {pid: {key: _local(v) for key, v in entries.items()} for pid, entries in state["state"].items()}
            optimizers.append({"state": local, "param_groups": state["param_groups"], "sharded": sharded})
        module = {k: _local(v) for k, v in self._module.state_dict().items()}
        return {"module": module, "optimizers": optimizers, "schedulers": scheduler_states(self.lr_scheduler_configs)}

    def _load_live_state(self, state: dict[str, Any]) -> None:
        from torch.distributed.tensor import DTensor  # lazy for import time: loaded with FSDP's modules

        assert self._module is not None
        with torch.no_grad():
            for name, tensor in self._module.state_dict().items():
                _local(tensor).copy_(state["module"][name])
        for optimizer, received in zip(self.optimizers, state["optimizers"]):
            params = [p for group in optimizer.param_groups for p in group["params"]]
            entries = {pid: dict(values) for pid, values in received["state"].items()}
            for pid, key in received["sharded"]:
                param = params[pid]
                entries[pid][key] = DTensor.from_local(
                    entries[pid][key], param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
                )
            optimizer.load_state_dict({"state": entries, "param_groups": received["param_groups"]})
        load_scheduler_states(self.lr_scheduler_configs, state.get("schedulers"), PEER_STATE)

    # ------------------------------------------------------------------ steps
    def on_train_start(self) -> None:
        """Form the first step's quorum before the loop reads data (a group behind its peers takes their state)."""
        self._replica_group.join_first_quorum()

    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: torch.nn.Module | None = None, **kwargs: Any
    ) -> Any:
        """Form this step's quorum, run the closure (gradient shards averaged across groups), step only if
        committed."""
        step, group = super().optimizer_step, self._replica_group
        result = group.optimizer_step(optimizer, lambda gate: step(gate, closure, model, **kwargs))
        self.last_step_committed = group.last_step_committed
        return result

    def teardown(self) -> None:
        """Leave the quorum service (stops this group's manager server and state transport), then as FSDP."""
        self._replica_group.leave()
        super().teardown()

    @classmethod
    def register_strategies(cls, registry: Registry[Strategy]) -> None:
        """Register 'hsdp_ft'."""
        registry.register(
            "hsdp_ft",
            cls,
            description="FSDP inside fault-tolerant replica groups, replicated across them (torchft;"
            " pip install 'phalanx[ft]').",
        )
