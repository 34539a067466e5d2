"""DefaultEnvironment: a plain machine (or a set of them) where phalanx starts the processes itself."""

from __future__ import annotations

import os
import socket

from phalanx.plugins.environments.cluster_environment import ClusterEnvironment, _env_int


def find_free_port(host: str = "127.0.0.1") -> int:
    """Ask the OS for a port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class DefaultEnvironment(ClusterEnvironment):
    """Ranks come from the strategy (and from LOCAL_RANK / NODE_RANK set by phalanx's launcher or the user)."""

    def __init__(self) -> None:
        self._world_size: int = _env_int("WORLD_SIZE", 1)
        self._global_rank: int = _env_int("RANK", 0)
        # Remember what we exported, so that teardown never removes a variable the user provided.
        self._exported_world_size: str | None = None

    @property
    def creates_processes_externally(self) -> bool:
        """True when LOCAL_RANK is set: phalanx's launcher or a user script already started this process."""
        return "LOCAL_RANK" in os.environ

    @property
    def main_address(self) -> str:
        """MASTER_ADDR, or the loopback address for a single machine."""
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        """MASTER_PORT, else a free port chosen once and exported so that child processes inherit it."""
        if "MASTER_PORT" not in os.environ:
            # Exporting it makes the choice stick: later calls, and the processes we launch, read the same port.
            os.environ["MASTER_PORT"] = str(find_free_port())
        return _env_int("MASTER_PORT")

    @staticmethod
    def detect() -> bool:
        """Always usable: the fallback when no cluster is detected."""
        return True

    def world_size(self) -> int:
        """World size set by the strategy (default: WORLD_SIZE or 1)."""
        return self._world_size

    def set_world_size(self, size: int) -> None:
        """Record the world size and export WORLD_SIZE if nobody set it, for processes started later."""
        self._world_size = size
        if "WORLD_SIZE" not in os.environ or os.environ["WORLD_SIZE"] == self._exported_world_size:
            self._exported_world_size = str(size)
            os.environ["WORLD_SIZE"] = self._exported_world_size

    def global_rank(self) -> int:
        """Global rank set by the strategy (node_rank * devices + local_rank; default: RANK or 0)."""
        return self._global_rank

    def set_global_rank(self, rank: int) -> None:
        """Record the global rank computed by the strategy."""
        self._global_rank = rank

    def local_rank(self) -> int:
        """LOCAL_RANK, or 0 in the process that launches the others."""
        return _env_int("LOCAL_RANK", 0)

    def node_rank(self) -> int:
        """NODE_RANK (phalanx's own name) or GROUP_RANK (torch's name), default 0."""
        if os.environ.get("NODE_RANK"):
            return _env_int("NODE_RANK")
        return _env_int("GROUP_RANK", 0)

    def teardown(self) -> None:
        """Remove WORLD_SIZE if this environment exported it (and nobody changed it since)."""
        if self._exported_world_size is not None and os.environ.get("WORLD_SIZE") == self._exported_world_size:
            del os.environ["WORLD_SIZE"]
        self._exported_world_size = None
