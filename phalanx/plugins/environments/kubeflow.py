"""KubeflowEnvironment: a Kubeflow PyTorchJob, one process per pod (choose it explicitly, it is never auto-detected)."""

from __future__ import annotations

import os

from phalanx.plugins.environments.cluster_environment import ClusterEnvironment, _env_int, _warn_ignored

# Kubeflow's operator sets only the plain rendezvous variables, which torchrun, phalanx's launcher and hand-written
# scripts set too, and KUBERNETES_PORT exists in every pod. So detect() can say "this may be Kubeflow", but
# detect_cluster_environment() never picks it: a user who runs a PyTorchJob passes KubeflowEnvironment() explicitly.
_REQUIRED = ("KUBERNETES_PORT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


class KubeflowEnvironment(ClusterEnvironment):
    """Each pod is a node running one process: world size WORLD_SIZE, global rank = node rank = RANK, local rank 0."""

    @property
    def creates_processes_externally(self) -> bool:
        """Always: the operator started one process per pod."""
        return True

    @property
    def main_address(self) -> str:
        """MASTER_ADDR set by the operator (the master pod's service)."""
        address = os.environ.get("MASTER_ADDR")
        if not address:
            raise ValueError("MASTER_ADDR is not set; KubeflowEnvironment expects a Kubeflow PyTorchJob pod.")
        return address

    @property
    def main_port(self) -> int:
        """MASTER_PORT set by the operator."""
        return _env_int("MASTER_PORT")

    @staticmethod
    def detect() -> bool:
        """KUBERNETES_PORT, MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK are set (used only when chosen explicitly)."""
        return all(key in os.environ for key in _REQUIRED)

    def world_size(self) -> int:
        """WORLD_SIZE (the number of pods)."""
        return _env_int("WORLD_SIZE")

    def set_world_size(self, size: int) -> None:
        """Ignore (with a warning if it differs): the PyTorchJob decided the world size."""
        _warn_ignored("KubeflowEnvironment", "world size", size, self.world_size())

    def global_rank(self) -> int:
        """RANK."""
        return _env_int("RANK")

    def set_global_rank(self, rank: int) -> None:
        """Ignore (with a warning if it differs): the PyTorchJob decided the rank."""
        _warn_ignored("KubeflowEnvironment", "global rank", rank, self.global_rank())

    def local_rank(self) -> int:
        """0: one process per pod."""
        return 0

    def node_rank(self) -> int:
        """RANK: each pod is its own node."""
        return self.global_rank()

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """One process per pod: require devices=1 and num_nodes equal to WORLD_SIZE."""
        if num_devices != 1:
            raise ValueError(
                f"KubeflowEnvironment runs one process per pod but the Trainer has devices={num_devices}; set "
                "devices=1 (or run torchrun inside each pod and use TorchElasticEnvironment for several devices)."
            )
        world_size = self.world_size()
        if world_size != num_nodes:
            raise ValueError(
                f"The PyTorchJob has WORLD_SIZE={world_size} pods but the Trainer has num_nodes={num_nodes}; set "
                f"num_nodes={world_size}."
            )
