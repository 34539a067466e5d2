"""XLAEnvironment: ranks of XLA replicas, as torch_xla's runtime numbers them (no variables, no ports)."""

from __future__ import annotations

from phalanx.plugins.environments.cluster_environment import ClusterEnvironment


class XLAEnvironment(ClusterEnvironment):
    """Replica ranks for the XLA strategies.

    Before the launch the ranks are the layout's (recorded by the strategy, rank 0 in the launching process); inside a
    replica ``read_runtime`` takes them from torch_xla's runtime. Nothing is exported to ``os.environ``: on the CPU
    runtime the replicas are threads of one process, which share it.
    """

    def __init__(self) -> None:
        self._world_size = 1
        self._global_rank = 0
        self._local_rank = 0
        self._node_rank = 0

    @property
    def creates_processes_externally(self) -> bool:
        """False: torch_xla's launcher, started by the strategy, creates the replicas."""
        return False

    @property
    def main_address(self) -> str:
        """Unused: XLA replicas meet through the runtime, not through an address."""
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        """Unused: XLA replicas meet through the runtime, not through a port."""
        return 0

    @staticmethod
    def detect() -> bool:
        """Never chosen automatically: the XLA strategies create it."""
        return False

    def read_runtime(self) -> None:
        """Take this replica's ranks from torch_xla's runtime (inside a launched replica)."""
        import torch_xla.runtime as xr

        self._world_size = xr.world_size()
        self._global_rank = xr.global_ordinal()
        self._local_rank = xr.local_ordinal()
        self._node_rank = xr.host_index() if xr.device_type() == "TPU" else 0

    def world_size(self) -> int:
        """Number of replicas."""
        return self._world_size

    def set_world_size(self, size: int) -> None:
        """Record the number of replicas (before the launch)."""
        self._world_size = size

    def global_rank(self) -> int:
        """This replica's rank among all replicas."""
        return self._global_rank

    def set_global_rank(self, rank: int) -> None:
        """Record this replica's rank (before the launch)."""
        self._global_rank = rank

    def local_rank(self) -> int:
        """This replica's rank on its host."""
        return self._local_rank

    def node_rank(self) -> int:
        """This host's rank."""
        return self._node_rank
