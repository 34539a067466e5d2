"""SLURMEnvironment: processes started by ``srun`` inside a SLURM allocation."""

from __future__ import annotations

import itertools
import os
import re
import signal

from phalanx.plugins.environments.cluster_environment import (
    ClusterEnvironment,
    _env_int,
    _port_from_job_id,
    _warn_ignored,
)

# Job names SLURM gives to interactive shells (``srun --pty bash``, ``salloc``): the Trainer then runs as a
# single ordinary process and must launch its own workers, so such jobs are not treated as SLURM-managed.
_INTERACTIVE_JOB_NAMES = ("bash", "interactive")


def _split_top_level(text: str) -> list[str]:
    """Split ``text`` on the commas and whitespace that are not inside brackets (a node list may separate its hosts
    either way: ``a,b`` or ``a b``)."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"Malformed SLURM host list {text!r}: nested brackets.")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"Malformed SLURM host list {text!r}: ']' without '['.")
        elif (char == "," or char.isspace()) and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"Malformed SLURM host list {text!r}: '[' without ']'.")
    parts.append(text[start:])
    return [part for part in (p.strip() for p in parts) if part]


def _expand_ranges(spec: str, hostlist: str) -> list[str]:
    """Expand the inside of one bracket group, e.g. ``01-03,07`` -> ``01 02 03 07`` (keeping zero padding)."""
    values: list[str] = []
    for item in spec.split(","):
        item = item.strip()
        low, sep, high = item.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"Malformed SLURM host list {hostlist!r}: bad range {item!r} in [{spec}].")
        if not sep:
            values.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"Malformed SLURM host list {hostlist!r}: descending range {item!r}.")
        # SLURM pads every number to the width of the lower bound ("08-10" -> 08, 09, 10).
        width = len(low)
        values.extend(str(number).zfill(width) for number in range(int(low), int(high) + 1))
    return values


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a compressed SLURM host list such as ``node[01-04,07],gpu-a[1,3]-b`` (or hosts separated by spaces)
    into host names, in order."""
    hosts: list[str] = []
    for part in _split_top_level(hostlist):
        # Alternate literal text and bracket contents: "r[1-2]n[3,5]" -> ["r", "1-2", "n", "3,5", ""].
        pieces = re.split(r"\[([^\]]*)\]", part)
        choices = [[piece] if i % 2 == 0 else _expand_ranges(piece, hostlist) for i, piece in enumerate(pieces)]
        hosts.extend("".join(combination) for combination in itertools.product(*choices))
    return hosts


def first_host(hostlist: str) -> str:
    """The first host of a compressed SLURM host list (where rank 0 runs)."""
    hosts = expand_hostlist(hostlist)
    if not hosts:
        raise ValueError(f"The SLURM host list {hostlist!r} names no host; export MASTER_ADDR instead.")
    return hosts[0]


def _tasks_per_node(value: str) -> int:
    """The task count of the first node in SLURM's per-node notation: ``2``, ``2(x3)`` or ``2(x3),1``."""
    match = re.match(r"\s*(\d+)", value)
    if match is None:
        raise ValueError(f"Cannot read SLURM_NTASKS_PER_NODE={value!r}.")
    return int(match.group(1))


class SLURMEnvironment(ClusterEnvironment):
    """Ranks and world size come from srun's SLURM_* variables; the rendezvous is derived from the job."""

    def __init__(self, auto_requeue: bool = True, requeue_signal: signal.Signals | None = None) -> None:
        # Stored for the requeue handling that the trainer's signal connector will use.
        self.auto_requeue = auto_requeue
        self.requeue_signal = requeue_signal

    @property
    def creates_processes_externally(self) -> bool:
        """Always: srun started every process."""
        return True

    @property
    def main_address(self) -> str:
        """MASTER_ADDR if set, else the first host of the job's node list."""
        if os.environ.get("MASTER_ADDR"):
            return os.environ["MASTER_ADDR"]
        nodelist = os.environ.get("SLURM_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise ValueError("Neither SLURM_NODELIST nor SLURM_JOB_NODELIST is set; export MASTER_ADDR instead.")
        return first_host(nodelist)

    @property
    def main_port(self) -> int:
        """MASTER_PORT if set, else 10000 + the last four digits of SLURM_JOB_ID."""
        if os.environ.get("MASTER_PORT"):
            return _env_int("MASTER_PORT")
        job_id = os.environ.get("SLURM_JOB_ID")
        if not job_id:
            raise ValueError("SLURM_JOB_ID is not set, so no port can be derived from it; export MASTER_PORT instead.")
        return _port_from_job_id(job_id, "SLURM_JOB_ID")

    @staticmethod
    def detect() -> bool:
        """SLURM_NTASKS is set and the job is not an interactive shell (job name ``bash`` or ``interactive``)."""
        return "SLURM_NTASKS" in os.environ and os.environ.get("SLURM_JOB_NAME") not in _INTERACTIVE_JOB_NAMES

    @staticmethod
    def job_id() -> int | None:
        """SLURM_JOB_ID as an integer, or None outside a SLURM job."""
        value = os.environ.get("SLURM_JOB_ID", "").strip()
        return int(value) if value.isdigit() else None

    def world_size(self) -> int:
        """SLURM_NTASKS."""
        return _env_int("SLURM_NTASKS")

    def set_world_size(self, size: int) -> None:
        """Ignore (with a warning if it differs): the allocation decided the world size."""
        _warn_ignored("SLURMEnvironment", "world size", size, self.world_size())

    def global_rank(self) -> int:
        """SLURM_PROCID."""
        return _env_int("SLURM_PROCID")

    def set_global_rank(self, rank: int) -> None:
        """Ignore (with a warning if it differs): srun decided the rank."""
        _warn_ignored("SLURMEnvironment", "global rank", rank, self.global_rank())

    def local_rank(self) -> int:
        """SLURM_LOCALID."""
        return _env_int("SLURM_LOCALID")

    def node_rank(self) -> int:
        """SLURM_NODEID."""
        return _env_int("SLURM_NODEID")

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Check ``--ntasks-per-node`` against ``devices``, ``--nodes`` against ``num_nodes``, and ``--ntasks``."""
        per_node = os.environ.get("SLURM_NTASKS_PER_NODE")
        if per_node and _tasks_per_node(per_node) != num_devices:
            raise ValueError(
                f"SLURM runs {_tasks_per_node(per_node)} tasks per node (#SBATCH --ntasks-per-node="
                f"{per_node}) but the Trainer has devices={num_devices}; set #SBATCH --ntasks-per-node="
                f"{num_devices} or devices={_tasks_per_node(per_node)}."
            )
        if os.environ.get("SLURM_NNODES"):
            nodes = _env_int("SLURM_NNODES")
            if nodes != num_nodes:
                raise ValueError(
                    f"SLURM allocated {nodes} nodes (#SBATCH --nodes={nodes}) but the Trainer has "
                    f"num_nodes={num_nodes}; set #SBATCH --nodes={num_nodes} or num_nodes={nodes}."
                )
        # Also catches an allocation sized with --ntasks alone, where SLURM_NTASKS_PER_NODE is not set.
        tasks = self.world_size()
        if tasks != num_devices * num_nodes:
            raise ValueError(
                f"SLURM started {tasks} tasks (#SBATCH --ntasks={tasks}) but the Trainer expects devices * num_nodes"
                f" = {num_devices} * {num_nodes} = {num_devices * num_nodes}; set #SBATCH --ntasks-per-node="
                f"{num_devices} and #SBATCH --nodes={num_nodes}."
            )
