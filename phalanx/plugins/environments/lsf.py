"""LSFEnvironment: processes started by IBM Spectrum LSF's ``jsrun`` (JSM)."""

from __future__ import annotations

import os
import socket

from phalanx.plugins.environments.cluster_environment import (
    ClusterEnvironment,
    _env_int,
    _port_from_job_id,
    _warn_ignored,
)

_REQUIRED = ("LSB_JOBID", "LSB_DJOB_RANKFILE", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_RANK", "JSM_NAMESPACE_LOCAL_RANK")


def _hostname() -> str:
    """This machine's host name (a function so that tests can replace it)."""
    return socket.gethostname()


class LSFEnvironment(ClusterEnvironment):
    """Ranks come from JSM_NAMESPACE_*; nodes and the main address from the job's rank file (LSB_DJOB_RANKFILE)."""

    @property
    def creates_processes_externally(self) -> bool:
        """Always: jsrun started every process."""
        return True

    @property
    def main_address(self) -> str:
        """MASTER_ADDR if set, else the first compute host of the rank file."""
        if os.environ.get("MASTER_ADDR"):
            return os.environ["MASTER_ADDR"]
        return self.compute_hosts()[0]

    @property
    def main_port(self) -> int:
        """MASTER_PORT if set, else 10000 + the last four digits of LSB_JOBID."""
        if os.environ.get("MASTER_PORT"):
            return _env_int("MASTER_PORT")
        job_id = os.environ.get("LSB_JOBID")
        if not job_id:
            raise ValueError("LSB_JOBID is not set, so no port can be derived from it; export MASTER_PORT instead.")
        return _port_from_job_id(job_id, "LSB_JOBID")

    @staticmethod
    def detect() -> bool:
        """LSB_JOBID, LSB_DJOB_RANKFILE and JSM_NAMESPACE_SIZE / _RANK / _LOCAL_RANK are all set."""
        return all(key in os.environ for key in _REQUIRED)

    @staticmethod
    def compute_hosts() -> list[str]:
        """Unique compute hosts of the rank file, in order (its first line is the launch node and is skipped)."""
        path = os.environ.get("LSB_DJOB_RANKFILE")
        if not path:
            raise ValueError("LSB_DJOB_RANKFILE is not set; LSFEnvironment expects processes started by jsrun.")
        try:
            with open(path, encoding="utf-8") as file:
                lines = [line.strip() for line in file]
        except OSError as error:
            raise ValueError(f"Cannot read the LSF rank file LSB_DJOB_RANKFILE={path!r}: {error}") from error
        # One line per slot: a host appears once per process on it, so keep the first occurrence only.
        hosts = list(dict.fromkeys(line for line in lines[1:] if line))
        if not hosts:
            raise ValueError(
                f"The LSF rank file {path!r} lists no compute host after its first line (the launch node)."
            )
        return hosts

    def world_size(self) -> int:
        """JSM_NAMESPACE_SIZE."""
        return _env_int("JSM_NAMESPACE_SIZE")

    def set_world_size(self, size: int) -> None:
        """Ignore (with a warning if it differs): jsrun decided the world size."""
        _warn_ignored("LSFEnvironment", "world size", size, self.world_size())

    def global_rank(self) -> int:
        """JSM_NAMESPACE_RANK."""
        return _env_int("JSM_NAMESPACE_RANK")

    def set_global_rank(self, rank: int) -> None:
        """Ignore (with a warning if it differs): jsrun decided the rank."""
        _warn_ignored("LSFEnvironment", "global rank", rank, self.global_rank())

    def local_rank(self) -> int:
        """JSM_NAMESPACE_LOCAL_RANK."""
        return _env_int("JSM_NAMESPACE_LOCAL_RANK")

    def node_rank(self) -> int:
        """Index of this host among the compute hosts of the rank file."""
        hosts = self.compute_hosts()
        hostname = _hostname()
        if hostname in hosts:
            return hosts.index(hostname)
        # Rank files may hold short names while gethostname() returns a fully qualified one (or the reverse).
        short = hostname.split(".")[0]
        short_hosts = [host.split(".")[0] for host in hosts]
        if short in short_hosts:
            return short_hosts.index(short)
        raise ValueError(f"This host {hostname!r} is not among the compute hosts {hosts} of the LSF rank file.")

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Check the rank file's host count and JSM_NAMESPACE_SIZE against ``num_nodes`` and ``devices``."""
        hosts = self.compute_hosts()
        if len(hosts) != num_nodes:
            raise ValueError(
                f"The LSF rank file lists {len(hosts)} compute hosts but the Trainer has num_nodes={num_nodes}; "
                f"request {num_nodes} nodes (bsub -nnodes) or set num_nodes={len(hosts)}."
            )
        world_size = self.world_size()
        if world_size != num_devices * num_nodes:
            raise ValueError(
                f"jsrun started JSM_NAMESPACE_SIZE={world_size} processes but the Trainer expects devices * num_nodes"
                f" = {num_devices} * {num_nodes} = {num_devices * num_nodes}; make jsrun's resource sets match."
            )
