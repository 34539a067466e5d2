"""ClusterEnvironment: where this process stands in the job (ranks, world size, main address and port)."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod

from phalanx.utilities.rank_zero import rank_zero_warn


class ClusterEnvironment(ABC):
    """Base class of the environments phalanx can run in (plain machine, torchrun, SLURM, LSF, MPI, Kubeflow)."""

    @property
    @abstractmethod
    def creates_processes_externally(self) -> bool:
        """Whether something else (torchrun, srun, mpirun, ...) started every process, so phalanx must not."""

    @property
    @abstractmethod
    def main_address(self) -> str:
        """Address of the rank-0 process for the rendezvous (MASTER_ADDR)."""

    @property
    @abstractmethod
    def main_port(self) -> int:
        """Port of the rank-0 process for the rendezvous (MASTER_PORT)."""

    @staticmethod
    @abstractmethod
    def detect() -> bool:
        """Whether the current process runs in this environment."""

    @abstractmethod
    def world_size(self) -> int:
        """Number of processes in the job."""

    @abstractmethod
    def set_world_size(self, size: int) -> None:
        """Record the world size when the environment does not define it."""

    @abstractmethod
    def global_rank(self) -> int:
        """Rank of this process among all processes."""

    @abstractmethod
    def set_global_rank(self, rank: int) -> None:
        """Record the global rank when the environment does not define it."""

    @abstractmethod
    def local_rank(self) -> int:
        """Rank of this process on its node."""

    @abstractmethod
    def node_rank(self) -> int:
        """Rank of this node."""

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Raise a ValueError if the environment contradicts the Trainer's ``devices`` x ``num_nodes``."""

    def teardown(self) -> None:
        """Clean up what the environment set for this process."""


def _env_int(name: str, default: int | None = None) -> int:
    """Read the integer variable ``name``; ValueError if it is missing (and has no default) or is not an integer."""
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        if default is None:
            raise ValueError(f"The environment variable {name} is not set; the launcher of this job should set it.")
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"The environment variable {name}={value!r} is not an integer.") from None


def _port_from_job_id(job_id: str, variable: str) -> int:
    """Port 10000 + the last four digits of a scheduler's job id, so every process of a job agrees without talking."""
    job_id = job_id.strip()
    if not job_id.isdigit():
        raise ValueError(f"Cannot derive a port from {variable}={job_id!r} (not a number); export MASTER_PORT instead.")
    return 10000 + int(job_id[-4:])


def _warn_ignored(environment: str, what: str, given: int, actual: int) -> None:
    """Warn that a strategy tried to set a value that the environment defines differently (the environment wins)."""
    if given != actual:
        rank_zero_warn(
            f"{environment}: ignoring the {what} {given} set by the strategy; the environment says {actual}.",
            stacklevel=3,
        )
