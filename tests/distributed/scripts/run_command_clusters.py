"""`phalanx run` inside a cluster's job step, simulated: two processes started here with the variables that srun (SLURM)
or torchrun give their workers, each running `python -m phalanx run ... run_command_job.py OUT/KIND`. There the
processes already exist, so phalanx run must run the script in its own process (no torchrun below it).
Usage: python run_command_clusters.py OUT PORT KIND...; writes OUT/KIND/launched.json (the pids and exit codes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FLAGS = ["--accelerator", "cpu", "--strategy", "ddp", "--devices", "2", "--num-nodes", "1", "--precision", "64-true"]


def variables(kind: str, rank: int, port: int) -> dict[str, str]:
    if kind == "slurm":  # what srun sets for task `rank` of a 2-task step on one node (the node list space-separated)
        return {
            "SLURM_NTASKS": "2", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0",
            "SLURM_NNODES": "1", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train",
            "SLURM_NODELIST": "127.0.0.1 127.0.0.2", "MASTER_PORT": str(port),
        }  # fmt: skip
    return {  # what torchrun's agent sets for its worker `rank`
        "TORCHELASTIC_RUN_ID": "simulated", "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    }  # fmt: skip


def launch(out: Path, port: int, kind: str) -> None:
    command = [sys.executable, "-m", "phalanx", "run", *FLAGS, str(HERE / "run_command_job.py"), str(out / kind), kind]
    workers = [
        subprocess.Popen(command, env={**os.environ, **variables(kind, rank, port)}, start_new_session=True)
        for rank in range(2)
    ]
    codes = []
    for worker in workers:
        try:
            codes.append(worker.wait(timeout=150))
        except subprocess.TimeoutExpired:
            for other in workers:
                other.kill()
            codes.append(None)
    (out / kind).mkdir(parents=True, exist_ok=True)
    (out / kind / "launched.json").write_text(json.dumps({"pids": [w.pid for w in workers], "codes": codes}))


if __name__ == "__main__":
    out, port = Path(sys.argv[1]), int(sys.argv[2])
    for offset, kind in enumerate(sys.argv[3:]):
        launch(out, port + offset, kind)
