"""Cluster environments: where a process stands in the job, read from its launcher's variables."""

from __future__ import annotations

from typing import Any

from phalanx.plugins.environments.cluster_environment import ClusterEnvironment
from phalanx.plugins.environments.default import DefaultEnvironment
from phalanx.plugins.environments.kubeflow import KubeflowEnvironment
from phalanx.plugins.environments.lsf import LSFEnvironment
from phalanx.plugins.environments.mpi import MPIEnvironment
from phalanx.plugins.environments.slurm import SLURMEnvironment, expand_hostlist, first_host
from phalanx.plugins.environments.torchelastic import TorchElasticEnvironment
from phalanx.plugins.environments.xla import XLAEnvironment
from phalanx.utilities.lightning_names import NotOffered, missing_name_error

# Most specific first: torchrun may run inside a SLURM or LSF allocation (then torchrun's variables describe the
# processes), and srun / jsrun may start MPI programs. Kubeflow is absent on purpose: its variables are the generic
# ones that any launcher sets, so it must be chosen explicitly.
_DETECTION_ORDER: tuple[type[ClusterEnvironment], ...] = (
    TorchElasticEnvironment,
    SLURMEnvironment,
    LSFEnvironment,
    MPIEnvironment,
)


def detect_cluster_environment() -> ClusterEnvironment:
    """An instance of the first environment that detects itself (torchrun, SLURM, LSF, MPI), else DefaultEnvironment."""
    for environment in _DETECTION_ORDER:
        if environment.detect():
            return environment()
    return DefaultEnvironment()


#: Lightning's cluster environments that phalanx does not have, with what to use instead.
NOT_OFFERED = {
    "LightningEnvironment": NotOffered(
        "DefaultEnvironment, phalanx's environment for processes it starts itself (MASTER_ADDR, MASTER_PORT, ranks)"
    ),
}


def __getattr__(name: str) -> Any:
    raise missing_name_error(__name__, name, NOT_OFFERED)


__all__ = [
    "ClusterEnvironment",
    "DefaultEnvironment",
    "KubeflowEnvironment",
    "LSFEnvironment",
    "MPIEnvironment",
    "SLURMEnvironment",
    "TorchElasticEnvironment",
    "XLAEnvironment",
    "detect_cluster_environment",
    "expand_hostlist",
    "first_host",
]
