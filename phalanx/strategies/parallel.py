"""ParallelStrategy: the base of strategies that run one process per device, across one or more nodes."""

from __future__ import annotations

import os
import sys
from abc import ABC
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

import torch
from torch import Tensor

from phalanx.accelerators.accelerator import Accelerator
from phalanx.plugins.environments.cluster_environment import ClusterEnvironment
from phalanx.plugins.io.checkpoint_io import CheckpointIO
from phalanx.plugins.layer_sync import LayerSync
from phalanx.plugins.precision.precision import Precision
from phalanx.strategies.launchers.multiprocessing import START_METHODS, MultiProcessingLauncher
from phalanx.strategies.launchers.subprocess_script import SubprocessScriptLauncher, watch_launcher_parent
from phalanx.strategies.strategy import Strategy
from phalanx.utilities import distributed
from phalanx.utilities.process_group_exit import destroy_process_group_at_exit
from phalanx.utilities.rank_zero import rank_zero_info, set_global_rank

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

_T = TypeVar("_T")

DEFAULT_TIMEOUT = timedelta(minutes=30)
#: The least time ranks wait for each other to start, whatever the collective ``timeout``.
JOIN_TIMEOUT = timedelta(minutes=5)


class _StepCollectives:
    """What ``naming_collectives`` returns: free on the way in and out of a step; on a transport failure inside it,
    a CollectiveError naming the collectives, the rank and the timeout."""

    __slots__ = ("_strategy", "_name")

    def __init__(self, strategy: ParallelStrategy, name: str) -> None:
        self._strategy = strategy
        self._name = name

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> Literal[False]:
        if not isinstance(error, RuntimeError) or isinstance(error, distributed.CollectiveError):
            return False
        strategy = self._strategy
        explained = distributed.explain_collective_failure(self._name, strategy.global_rank, strategy._timeout, error)
        if explained is None or not distributed.from_transport(error):
            return False
        raise explained from None


class ParallelStrategy(Strategy, ABC):
    """Ranks come from a ClusterEnvironment; processes start through a launcher; collectives go through
    torch.distributed."""

    multi_process: ClassVar[bool] = True

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        *,
        process_group_backend: str | None = None,
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        start_method: str = "popen",
    ) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision_plugin=precision_plugin)
        if start_method not in ("popen", *START_METHODS):
            raise ValueError(f"start_method={start_method!r} is not valid; choose one of {('popen', *START_METHODS)}.")
        if timeout is not None and not isinstance(timeout, timedelta):
            raise TypeError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}.")
        self.parallel_devices = parallel_devices
        self.cluster_environment = cluster_environment
        self._num_nodes = 1
        self._layer_sync: LayerSync | None = None
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method
        self._launched_local_rank: int | None = None

    # ------------------------------------------------------------------ processes and devices
    @property
    def root_device(self) -> torch.device:
        """This process's device: the local rank's entry of ``parallel_devices``."""
        assert self.parallel_devices is not None, "the Trainer sets parallel_devices"
        return self.parallel_devices[self.local_rank]

    @property
    def process_group_backend(self) -> str:
        """'nccl' on CUDA, 'gloo' otherwise, unless given."""
        if self._process_group_backend is not None:
            return self._process_group_backend
        return "nccl" if self.root_device.type == "cuda" else "gloo"

    @property
    def launcher(self) -> Any:
        """How the other processes start: re-running the script ('popen') or torch.multiprocessing."""
        if self._launcher is None and self.cluster_environment is not None:
            if self._start_method == "popen":
                if not self.cluster_environment.creates_processes_externally:
                    self._launcher = SubprocessScriptLauncher(
                        self.cluster_environment, self.num_processes, self.num_nodes
                    )
            elif self._launched_local_rank is None:
                self._launcher = MultiProcessingLauncher(self, start_method=self._start_method)
        return self._launcher

    def __getstate__(self) -> dict[str, Any]:
        """The pickled state, without the launcher: each worker rebuilds its own, which must not launch again."""
        state = self.__dict__.copy()
        state["_launcher"] = None
        return state

    def record_global_rank(self) -> None:
        """Tell the environment the world size and this process's global rank, known from the layout in advance."""
        # Called once devices and nodes are set (the Trainer does it at construction), so that rank-zero-guarded code
        # between ``Trainer(...)`` and ``fit`` runs once per job, not once per node, and ``trainer.world_size`` is
        # devices * num_nodes from the start, as in Lightning (environments that read it from the launcher keep theirs).
        assert self.cluster_environment is not None and self.parallel_devices is not None
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        set_global_rank(self.global_rank)

    def setup_environment(self) -> None:
        """Join the process group (once) and select this rank's device."""
        assert self.cluster_environment is not None and self.parallel_devices is not None
        if self._launched_local_rank is not None or self._start_method == "popen":
            watch_launcher_parent()
        environment = self.cluster_environment
        environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        environment.set_world_size(self.num_nodes * self.num_processes)
        set_global_rank(self.global_rank)
        if not distributed.is_initialized():
            os.environ.setdefault("MASTER_ADDR", environment.main_address)
            os.environ.setdefault("MASTER_PORT", str(environment.main_port))
            rank_zero_info(
                f"Initialising distributed: rank {self.global_rank} of {self.world_size}, backend"
                f" {self.process_group_backend}"
            )
            torch.distributed.init_process_group(
                self.process_group_backend,
                rank=self.global_rank,
                world_size=self.world_size,
                timeout=self._timeout,
                store=self._rendezvous_store(),
            )
            # Left alive until interpreter shutdown, the group's threads can abort a finished job (see the module).
            destroy_process_group_at_exit()
        super().setup_environment()

    def _rendezvous_store(self) -> Any:
        """The store the ranks meet through; waiting for the others to start is bounded by ``_join_timeout()``."""
        # Joining waits for process start-up (importing torch, building the model), which can take far longer than a
        # short collective ``timeout`` chosen to catch a stalled rank quickly. Under torchrun the keys are private to
        # this restart attempt: torchrun keeps one store across the restarts of its workers, and a restarted rank could
        # read the address a dead rank of the previous attempt published and fail, or wait forever, while connecting.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        agent_hosts_store = attempt is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = torch.distributed.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), self.world_size,
            is_master=not agent_hosts_store and self.global_rank == 0, timeout=self._join_timeout(),
        )  # fmt: skip
        if attempt is None:
            return store
        return torch.distributed.PrefixStore(f"phalanx/attempt_{attempt}", store)

    @property
    def collective_timeout(self) -> timedelta | None:
        """How long a collective waits for the other ranks (the ``timeout=`` given; None: torch's default)."""
        return self._timeout

    def _join_timeout(self) -> timedelta:
        """How long joining may wait for the other ranks: the collective ``timeout``, but at least ``JOIN_TIMEOUT``."""
        return max(self._timeout or DEFAULT_TIMEOUT, JOIN_TIMEOUT)

    def model_to_device(self) -> None:
        """Move the module to this rank's device."""
        assert self._module is not None
        self._module.to(self.root_device)

    def on_exception(self, exception: BaseException) -> None:
        """Stop the processes this one started; stay quiet about a peer's failure (that peer reports its own)."""
        self.reconciliate_processes(repr(exception))
        if self.world_size > 1 and distributed.peer_left(exception):
            # Another process failed first and reports its own traceback; a second one here would only mislead.
            print(
                f"[phalanx] rank {self.global_rank}: stopping because another process of this job failed (its error is"
                " shown above or by the launcher).",
                file=sys.stderr,
                flush=True,
            )
            raise SystemExit(1) from None

    @property
    def num_nodes(self) -> int:
        """Number of nodes."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Processes per node (one per device)."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def layer_sync(self) -> LayerSync | None:
        """The LayerSync applied while fitting (SyncBatchNorm with ``sync_batchnorm=True``)."""
        return self._layer_sync

    @layer_sync.setter
    def layer_sync(self, layer_sync: LayerSync | None) -> None:
        self._layer_sync = layer_sync

    @property
    def global_rank(self) -> int:
        """This process's rank among all processes."""
        return self.cluster_environment.global_rank() if self.cluster_environment is not None else 0

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""
        return self.cluster_environment.local_rank() if self.cluster_environment is not None else 0

    @property
    def node_rank(self) -> int:
        """This node's rank."""
        return self.cluster_environment.node_rank() if self.cluster_environment is not None else 0

    @property
    def world_size(self) -> int:
        """Number of processes in the job."""
        return self.cluster_environment.world_size() if self.cluster_environment is not None else 1

    @property
    def is_global_zero(self) -> bool:
        """Whether this is global rank 0."""
        return self.global_rank == 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any] | None:
        """Each process reads a disjoint shard: ``num_replicas`` = world size, ``rank`` = global rank."""
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    # ------------------------------------------------------------------ steps: collectives torch runs itself
    #: What the wrapper's own collectives are called in error messages, by phase of a step.
    step_collectives: dict[str, str] = {
        "forward": "forward pass",
        "backward": "backward pass (gradient synchronisation)",
        "optimizer_step": "optimizer step",
    }

    def naming_collectives(self, phase: str) -> AbstractContextManager:
        """A timeout or lost peer inside becomes a CollectiveError naming ``phase``'s collectives and the rank."""
        # Entered three times per step: one context per phase, made once, that reads the rank only when a step fails.
        namers = self.__dict__.setdefault("_step_namers", {})
        namer = namers.get(phase)
        if namer is None:
            namer = namers[phase] = _StepCollectives(self, self.step_collectives.get(phase, phase))
        return namer

    def reduce(
        self, tensor: Tensor | Any, group: ProcessGroup | None = None, reduce_op: str | None = "mean"
    ) -> Tensor | Any:
        """All-reduce a tensor by ``reduce_op`` ('mean'/'avg', 'sum', 'max', 'min', a ReduceOp); others pass through."""
        reduce_op = distributed.normalize_reduce_op(reduce_op)
        if not isinstance(tensor, Tensor) or not distributed.is_initialized():
            return tensor
        return distributed.all_reduce(tensor, reduce_op, group, self.global_rank, self._timeout)

    def all_gather(self, tensor: Tensor, group: ProcessGroup | None = None, sync_grads: bool = False) -> Tensor:
        """Stack ``tensor`` from all processes (differentiable with ``sync_grads=True``)."""
        if not distributed.is_initialized():
            return tensor
        return distributed.all_gather(tensor, group, sync_grads, self.global_rank, self._timeout)

    def all_gather_object(self, obj: _T) -> list[_T]:
        """Gather a picklable object from every process."""
        if not distributed.is_initialized():
            return [obj]
        gathered: list[Any] = [None] * torch.distributed.get_world_size()
        distributed.run_collective(
            "all_gather_object",
            self.global_rank,
            self._timeout,
            lambda: torch.distributed.all_gather_object(gathered, obj),
        )
        return gathered

    def barrier(self, name: str | None = None) -> None:
        """Wait for every process."""
        if distributed.is_initialized():
            distributed.run_collective(
                f"barrier({name})" if name else "barrier", self.global_rank, self._timeout, torch.distributed.barrier
            )

    def broadcast(self, obj: _T, src: int = 0) -> _T:
        """Send a picklable object from ``src`` to every process."""
        if not distributed.is_initialized():
            return obj
        box = [obj]
        distributed.run_collective(
            "broadcast", self.global_rank, self._timeout, lambda: torch.distributed.broadcast_object_list(box, src=src)
        )
        return box[0]

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002 - Lightning's name
        """True if every process (``all=True``) or any process (``all=False``) decided True."""
        if not distributed.is_initialized():
            return decision
        votes = self.reduce(torch.tensor(int(decision), device=self.root_device), reduce_op="sum")
        return bool(votes == self.world_size) if all else bool(votes > 0)

    def block_backward_sync(self) -> AbstractContextManager:
        """Skip gradient synchronisation while accumulating, when the wrapper supports it."""
        no_sync = getattr(self.model, "no_sync", None)
        return no_sync() if no_sync is not None and self.model is not self.module else nullcontext()

    def reconciliate_processes(self, trace: str) -> None:
        """Called when one process failed: make sure the others do not wait for it forever."""
        launcher = self.launcher
        if launcher is not None:
            launcher.kill()

    def teardown(self) -> None:
        """Unwrap the module and revert the layer sync, release the environment, then the device and plugins."""
        # The process group stays for later calls (it ends at interpreter exit).
        if self._module is not None:
            if self._layer_sync is not None:
                # LayerSync gives back this TrainingModule itself: only its batch-norm children are replaced.
                self._module = self._layer_sync.revert(self._module)  # type: ignore[assignment]
            self._model = self._module
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        super().teardown()
