"""ReplicaGroup: this process's replica group in the quorum of groups, which ddp_ft and hsdp_ft each own one of."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch.optim import Optimizer

from phalanx.plugins.precision.precision import evaluates_closure_once
from phalanx.strategies.fault_tolerant.membership import QuorumMembership
from phalanx.strategies.fault_tolerant.options import FaultTolerance
from phalanx.strategies.fault_tolerant.process_group import cross_group_gloo
from phalanx.strategies.fault_tolerant.semi_sync import SemiSyncGroup
from phalanx.strategies.fault_tolerant.torchft_import import require_torchft
from phalanx.strategies.settings import RunSettings
from phalanx.utilities.rank_zero import rank_zero_info, rank_zero_warn

#: Declined steps in a row after which a group gives up (each one has waited for its quorum and all-reduce already).
MAX_DECLINED_IN_A_ROW = 10
#: Who holds the state a rejoining group loads, as its errors name it.
PEER_STATE = "The live state a peer replica group sent"


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


@dataclass(frozen=True)
class GroupProcess:
    """This process as the torchft Manager of its group sees it: its place in the group, and how the strategy reads
    and loads its live state (what a healthy peer sends a rejoining group: weights, optimizer state, and the LR
    schedulers' states as a list under "schedulers")."""

    rank: int
    world_size: int
    device: torch.device
    state_dict: Callable[[], dict[str, Any]]
    load_state_dict: Callable[[dict[str, Any]], None]


class ReplicaGroup:
    """What a fault-tolerant strategy does as a member of the replica groups' quorum, whatever holds its model.

    It reads the options, makes the torchft Manager (with the callbacks' states and the loop position as live states
    beside the strategy's own), forms each step's quorum, steps the optimizer only when the quorum commits, gives up
    after ``MAX_DECLINED_IN_A_ROW`` declined steps, logs who left and joined and what a healed group received, and
    leaves the quorum service at teardown. The strategy passes in what depends on how it holds the model (its live
    state, as a :class:`GroupProcess`) and keeps its own gradient hook.
    """

    def __init__(self, owner: str, strategy_name: str, fault_tolerance: FaultTolerance | None) -> None:
        if fault_tolerance is not None and not isinstance(fault_tolerance, FaultTolerance):
            raise TypeError(
                f"{owner}(fault_tolerance=...) takes a FaultTolerance, got {type(fault_tolerance).__name__}."
            )
        #: The strategy's class name, as messages name it.
        self.owner = owner
        self.torchft = require_torchft(f"{owner} (strategy={strategy_name!r})")
        self._fault_tolerance = fault_tolerance
        #: This group's torchft Manager while fitting (None before ``start`` and after ``leave``).
        self.manager: Any = None
        #: Which replica groups the latest quorum had (set when fitting starts); it logs who left and who joined.
        self.membership: QuorumMembership | None = None
        #: torchft's LocalSGD or DiLoCo, with FaultTolerance(semi_sync=...) (``start_semi_sync``).
        self.semi_sync: SemiSyncGroup | None = None
        #: False after a step the quorum declined (nothing changed anywhere).
        self.last_step_committed = True
        self._loop_position: Callable[[], dict[str, int]] | None = None
        self._load_loop_position: Callable[[Mapping[str, int]], None] | None = None
        self._catch_up: Callable[[Mapping[str, int]], bool] | None = None
        self._callback_states: Callable[[], dict[str, Any]] | None = None
        self._load_callback_states: Callable[[Mapping[str, Any]], None] | None = None
        self._process: GroupProcess | None = None
        # What the latest heal loaded besides the weights and the optimizer state, for its log line.
        self._schedulers_received = 0
        self._callbacks_received: int | None = None
        self._joining = False  # forming the first quorum, before the loop reads data: a received position applies
        self._quorum_open = False  # the step in progress has its quorum (on_train_start's, a forward's or its own)
        self._declined_in_a_row = 0

    @property
    def fault_tolerance(self) -> FaultTolerance:
        """The options given, else the environment's (REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, TORCHFT_LIGHTHOUSE)."""
        if self._fault_tolerance is None:
            self._fault_tolerance = FaultTolerance.from_environment()
        return self._fault_tolerance

    # ------------------------------------------------------------------ data and ranks
    def is_global_zero(self, rank: int) -> bool:
        """Rank 0 of replica group 0: the one process of the run that writes checkpoints."""
        return rank == 0 and self.fault_tolerance.replica_group_id == 0

    def sampler_kwargs(self, rank: int, world_size: int) -> dict[str, Any]:
        """Each process of each replica group reads its own share: replicas = groups x processes per group."""
        options = self.fault_tolerance
        return {
            "num_replicas": options.num_replica_groups * world_size,
            "rank": options.replica_group_id * world_size + rank,
        }

    # ------------------------------------------------------------------ set-up
    def check_automatic_optimization(self, settings: RunSettings, module: torch.nn.Module | None) -> None:
        """Refuse manual optimization: the quorum starts and commits inside the optimizer step the strategy drives."""
        if settings.fitting and module is not None and not getattr(module, "automatic_optimization", True):
            raise ValueError(
                f"{self.owner} supports automatic optimization only: the quorum starts and commits inside"
                f" the optimizer step it drives. Set automatic_optimization = True."
            )

    def start(
        self,
        settings: RunSettings,
        process: GroupProcess,
        catch_up: Callable[[Mapping[str, int]], bool] | None,
        barrier: Callable[[str], None],
    ) -> None:
        """Join the replica groups' quorum service (a torchft Manager) for this fit: the group's rank 0 first, then,
        after ``barrier`` (the group's own), its other ranks. ``catch_up`` moves the loop's counters inside a step (a
        slow group's); None: such a group keeps its own counters, with a warning.

        torchft's Manager on a rank other than 0 reads rank 0's manager address from the group's store. The store
        outlives a fit (the process group stays until the process ends): a second fit in these processes found the
        first fit's address there (its manager shut down at teardown) whenever it read before rank 0 wrote the new one,
        and its quorum failed after connect_timeout.
        """
        self._loop_position, self._load_loop_position = settings.loop_position, settings.load_loop_position
        self._callback_states, self._load_callback_states = settings.callback_states, settings.load_callback_states
        self._catch_up = catch_up
        if process.rank == 0:
            self.manager = self.make_manager(process)
        barrier("torchft Manager started on the replica group's rank 0")
        if process.rank != 0:
            self.manager = self.make_manager(process)

    def make_manager(self, process: GroupProcess) -> Any:
        """This group's torchft Manager, on a cross-group gloo group whose reconfigurations ``membership`` logs."""
        torchft, options = self.torchft, self.fault_tolerance
        group = cross_group_gloo(torchft, options.connect_timeout, options.step_timeout)
        self.membership = QuorumMembership(options.replica_group_id)
        self.membership.watch(group)
        if options.transport == "pg":
            transport = torchft.pg_transport.PGTransport(group, timeout=options.step_timeout, device=process.device)
        else:
            transport = torchft.http_transport.HTTPTransport(timeout=options.step_timeout, num_chunks=0)
        self._process = process
        manager = torchft.manager.Manager(
            pg=group,
            load_state_dict=self._load_live_state,
            state_dict=process.state_dict,
            min_replica_size=options.min_replicas,
            # A (re)joining group loads the peer's state before its first step and takes part in it at once.
            use_async_quorum=False,
            timeout=options.step_timeout,
            quorum_timeout=options.quorum_timeout,
            connect_timeout=options.connect_timeout,
            rank=process.rank,
            world_size=process.world_size,
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

    def _load_live_state(self, state: dict[str, Any]) -> None:
        """Load the strategy's live state from a peer, counting its schedulers' states for the log line."""
        assert self._process is not None
        self._process.load_state_dict(state)
        self._schedulers_received = len(state.get("schedulers") or [])

    def check_optimizers(self, optimizers: list[Optimizer]) -> None:
        """One optimizer (one commit vote per step) that evaluates its closure once."""
        if len(optimizers) > 1:
            raise ValueError(
                f"{self.owner} steps one optimizer per step (one commit vote), got {len(optimizers)};"
                f" combine their parameter groups into one optimizer."
            )
        for optimizer in optimizers:
            if not evaluates_closure_once(optimizer):
                raise ValueError(
                    f"{self.owner} cannot step {type(optimizer).__name__}, which re-evaluates its closure"
                    f" (as LBFGS does): a quorum commits each step once. Use an optimizer such as SGD or AdamW."
                )

    def start_semi_sync(self, module: torch.nn.Module, optimizers: list[Optimizer]) -> None:
        """With FaultTolerance(semi_sync=...): hook torchft's LocalSGD or DiLoCo on the (one) optimizer."""
        semi_sync = self.fault_tolerance.semi_sync
        if semi_sync is not None and self.semi_sync is None:
            self.semi_sync = SemiSyncGroup(self.torchft.local_sgd, self.manager, module, optimizers[0], semi_sync)

    # ------------------------------------------------------------------ the callbacks and the loop in the live state
    def _callbacks(self) -> dict[str, Any] | None:
        """What a healthy group sends with its weights: its callbacks' states, as a checkpoint stores them (None
        without callbacks to ask: the Cohort)."""
        return None if self._callback_states is None else self._callback_states()

    def _load_callbacks(self, states: dict[str, Any] | None) -> None:
        if states is not None and self._load_callback_states is not None:
            self._load_callback_states(states)
            self._callbacks_received = len(states)

    def _received(self, last: str | None = None) -> str:
        """What this group loaded from a peer, as a phrase for the log: the weights, the optimizer state, the LR
        schedulers' and the callbacks' states (where there were any), and ``last``."""
        parts = ["weights", "optimizer state"]
        if self._schedulers_received:
            parts.append(f"the state of {self._schedulers_received} learning-rate scheduler(s)")
        if self._callbacks_received is not None:
            parts.append(f"the states of {self._callbacks_received} callback(s)")
        parts += [last] if last else []
        return ", ".join(parts[:-1]) + f" and {parts[-1]}"

    def _position(self) -> dict[str, int] | None:
        """What a healthy group sends with its weights: where its loop stands (None without a loop to ask)."""
        if self._loop_position is None:
            return None
        if self.semi_sync is not None and self.semi_sync.stepping is not None:
            # Semi-synchronous groups synchronise after the optimizer step: the joining group starts at the next one.
            return {key: value + 1 if key != "epoch" else value for key, value in self.semi_sync.stepping.items()}
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
        if self.semi_sync is None and self._catch_up is not None and self._catch_up(position):
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
    def join_first_quorum(self) -> bool:
        """Form the first quorum while the loop has not read data (a received loop position applies); True when it is
        the first step's quorum (False: not fitting, formed already, or semi-synchronous groups, whose next quorum
        forms at their next synchronisation)."""
        manager = self.manager
        if manager is None or self._quorum_open:
            return False
        self._joining = True
        try:
            self._start_quorum(manager)
        finally:
            self._joining = False
        if self.semi_sync is not None:
            self.semi_sync.join()
            return False
        self._quorum_open = True
        return True

    def open_quorum(self) -> None:
        """Form this step's quorum unless it is formed (a training forward's, before the backward all-reduces)."""
        if self._quorum_open or self.manager is None:
            return
        self._start_quorum(self.manager)
        self._quorum_open = True

    def optimizer_step(self, optimizer: Optimizer, step: Callable[[Optimizer], Any]) -> Any:
        """Run ``step`` (the strategy's optimizer step with its closure) on ``optimizer``: behind the commit gate of
        this step's quorum; every step local with semi-synchronous groups; as it is when not fitting."""
        manager, semi_sync = self.manager, self.semi_sync
        if manager is None:
            return step(optimizer)
        if semi_sync is not None:
            # Every step is local; torchft's hooks on the optimizer synchronise the groups every sync_every steps.
            semi_sync.stepping = None if self._loop_position is None else self._loop_position()
            try:
                return step(optimizer)
            finally:
                semi_sync.stepping = None
        return self._committed_step(manager, optimizer, step)

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

    def leave(self) -> None:
        """Leave the quorum service: stop torchft's LocalSGD/DiLoCo hooks, this group's manager server and transport."""
        manager, self.manager = self.manager, None
        self._quorum_open = False
        if self.semi_sync is not None:
            self.semi_sync.close()
            self.semi_sync = None
        if manager is not None:
            manager.shutdown(wait=False)
