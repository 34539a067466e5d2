"""TorchElasticEnvironment: processes started by ``torchrun`` (torch.distributed.elastic)."""

from __future__ import annotations

import os

from phalanx.plugins.environments.cluster_environment import ClusterEnvironment, _env_int, _warn_ignored

# torchrun's agent sets all of these (and ROLE_RANK, ROLE_NAME, LOCAL_WORLD_SIZE, GROUP_WORLD_SIZE, ...) for every
# worker. The plain rendezvous variables alone are not enough: phalanx's own launcher and hand-written scripts set
# them too, so detection also needs a variable only the elastic agent sets (TORCHELASTIC_RUN_ID, GROUP_RANK).
_REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_AGENT_MARKERS = ("TORCHELASTIC_RUN_ID", "GROUP_RANK")


class TorchElasticEnvironment(ClusterEnvironment):
    """Ranks, world size and rendezvous come from the variables torchrun exports; the environment is the truth."""

    @property
    def creates_processes_externally(self) -> bool:
        """Always: torchrun started every process."""
        return True

    @property
    def main_address(self) -> str:
        """MASTER_ADDR set by torchrun."""
        address = os.environ.get("MASTER_ADDR")
        if not address:
            raise ValueError("MASTER_ADDR is not set; TorchElasticEnvironment expects processes started by torchrun.")
        return address

    @property
    def main_port(self) -> int:
        """MASTER_PORT set by torchrun."""
        return _env_int("MASTER_PORT")

    @staticmethod
    def detect() -> bool:
        """All of RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, plus TORCHELASTIC_RUN_ID or GROUP_RANK."""
        return all(key in os.environ for key in _REQUIRED) and any(key in os.environ for key in _AGENT_MARKERS)

    def world_size(self) -> int:
        """WORLD_SIZE."""
        return _env_int("WORLD_SIZE")

    def set_world_size(self, size: int) -> None:
        """Ignore (with a warning if it differs): torchrun decided the world size."""
        _warn_ignored("TorchElasticEnvironment", "world size", size, self.world_size())

    def global_rank(self) -> int:
        """RANK."""
        return _env_int("RANK")

    def set_global_rank(self, rank: int) -> None:
        """Ignore (with a warning if it differs): torchrun decided the rank."""
        _warn_ignored("TorchElasticEnvironment", "global rank", rank, self.global_rank())

    def local_rank(self) -> int:
        """LOCAL_RANK."""
        return _env_int("LOCAL_RANK")

    def node_rank(self) -> int:
        """GROUP_RANK (torchrun's node rank); NODE_RANK or 0 if an older agent did not set it."""
        if os.environ.get("GROUP_RANK"):
            return _env_int("GROUP_RANK")
        return _env_int("NODE_RANK", 0)

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Check torchrun's processes per node and world size against the Trainer's devices x num_nodes."""
        if os.environ.get("LOCAL_WORLD_SIZE"):
            per_node = _env_int("LOCAL_WORLD_SIZE")
            if per_node != num_devices:
                raise ValueError(
                    f"torchrun started {per_node} processes per node (--nproc-per-node {per_node}) but the Trainer "
                    f"has devices={num_devices}; make them match."
                )
        world_size = self.world_size()
        if world_size != num_devices * num_nodes:
            raise ValueError(
                f"torchrun started WORLD_SIZE={world_size} processes but the Trainer expects devices * num_nodes = "
                f"{num_devices} * {num_nodes} = {num_devices * num_nodes}; make --nnodes/--nproc-per-node match "
                "num_nodes/devices."
            )
