"""MPIEnvironment: processes started by ``mpirun`` / ``mpiexec`` (Open MPI, MPICH, Intel MPI, MVAPICH)."""

from __future__ import annotations

import os
import socket
from typing import NamedTuple

from phalanx.plugins.environments.cluster_environment import ClusterEnvironment, _env_int, _warn_ignored
from phalanx.plugins.environments.default import find_free_port


class _MPIVariables(NamedTuple):
    """Names one MPI implementation uses for world size, global rank, local rank and processes per node."""

    size: str
    rank: str
    local_rank: str
    local_size: str


# Detection reads only these variables, so it needs no mpi4py. Open MPI's OMPI_COMM_WORLD_NODE_RANK is not used:
# despite its name it is the process's rank on its node (across jobs), not the index of the node.
_IMPLEMENTATIONS = (
    _MPIVariables(  # Open MPI
        "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"
    ),
    _MPIVariables("PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # MPICH / Intel MPI (Hydra)
    _MPIVariables(  # MVAPICH2
        "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"
    ),
)


def _variables() -> _MPIVariables | None:
    """The variable names of the first MPI implementation whose four variables are all set."""
    for names in _IMPLEMENTATIONS:
        if all(name in os.environ for name in names):
            return names
    return None


class MPIEnvironment(ClusterEnvironment):
    """Ranks come from the MPI launcher's variables; the rendezvous from MASTER_* or a broadcast over mpi4py."""

    def __init__(self) -> None:
        self._rendezvous: tuple[str, int] | None = None

    @property
    def creates_processes_externally(self) -> bool:
        """Always: mpirun started every process."""
        return True

    @property
    def main_address(self) -> str:
        """MASTER_ADDR if set, else rank 0's host name broadcast over MPI."""
        if os.environ.get("MASTER_ADDR"):
            return os.environ["MASTER_ADDR"]
        return self._broadcast_rendezvous()[0]

    @property
    def main_port(self) -> int:
        """MASTER_PORT if set, else a free port of rank 0 broadcast over MPI."""
        if os.environ.get("MASTER_PORT"):
            return _env_int("MASTER_PORT")
        return self._broadcast_rendezvous()[1]

    @staticmethod
    def detect() -> bool:
        """The world size, rank, local rank and local size variables of Open MPI, MPICH/Intel MPI or MVAPICH are set."""
        return _variables() is not None

    def _names(self) -> _MPIVariables:
        """The variable names of the detected MPI implementation; ValueError outside an MPI job."""
        names = _variables()
        if names is None:
            raise ValueError(
                "No MPI launcher variables found (e.g. OMPI_COMM_WORLD_RANK or PMI_RANK); start the job with mpirun."
            )
        return names

    def _broadcast_rendezvous(self) -> tuple[str, int]:
        """Rank 0's address and a free port, sent to every rank over MPI.COMM_WORLD (once; all ranks must call)."""
        if self._rendezvous is None:
            try:
                from mpi4py import MPI  # Lazy: mpi4py initialises MPI on import, only wanted when needed.
            except ImportError:
                raise ValueError(
                    "MPIEnvironment needs the rendezvous address: export MASTER_ADDR (host of rank 0) and MASTER_PORT "
                    "(a free port there) to every process (e.g. mpirun -x MASTER_ADDR -x MASTER_PORT), or install "
                    "mpi4py (pip install mpi4py) so that rank 0 can broadcast them."
                ) from None
            comm = MPI.COMM_WORLD
            payload = None
            if comm.Get_rank() == 0:
                address = os.environ.get("MASTER_ADDR") or socket.gethostname()
                port = int(os.environ.get("MASTER_PORT") or find_free_port(""))
                payload = (address, port)
            address, port = comm.bcast(payload, root=0)
            self._rendezvous = (str(address), int(port))
        return self._rendezvous

    def world_size(self) -> int:
        """The MPI world size (e.g. OMPI_COMM_WORLD_SIZE or PMI_SIZE)."""
        return _env_int(self._names().size)

    def set_world_size(self, size: int) -> None:
        """Ignore (with a warning if it differs): mpirun decided the world size."""
        _warn_ignored("MPIEnvironment", "world size", size, self.world_size())

    def global_rank(self) -> int:
        """The MPI rank (e.g. OMPI_COMM_WORLD_RANK or PMI_RANK)."""
        return _env_int(self._names().rank)

    def set_global_rank(self, rank: int) -> None:
        """Ignore (with a warning if it differs): mpirun decided the rank."""
        _warn_ignored("MPIEnvironment", "global rank", rank, self.global_rank())

    def local_rank(self) -> int:
        """The rank on this node (e.g. OMPI_COMM_WORLD_LOCAL_RANK or MPI_LOCALRANKID)."""
        return _env_int(self._names().local_rank)

    def local_size(self) -> int:
        """The number of processes on this node (e.g. OMPI_COMM_WORLD_LOCAL_SIZE or MPI_LOCALNRANKS)."""
        return _env_int(self._names().local_size)

    def node_rank(self) -> int:
        """global_rank // local_size: assumes ranks are placed in blocks of equal size per node (mpirun's default)."""
        return self.global_rank() // self.local_size()

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Check processes per node against ``devices`` and the world size against ``devices * num_nodes``."""
        local_size = self.local_size()
        if local_size != num_devices:
            raise ValueError(
                f"mpirun started {local_size} processes on this node but the Trainer has devices={num_devices}; "
                f"start {num_devices} per node (e.g. mpirun --npernode {num_devices} / -ppn {num_devices})."
            )
        world_size = self.world_size()
        if world_size != num_devices * num_nodes:
            raise ValueError(
                f"mpirun started {world_size} processes but the Trainer expects devices * num_nodes = {num_devices} "
                f"* {num_nodes} = {num_devices * num_nodes}; set -np {num_devices * num_nodes} or fix num_nodes."
            )
