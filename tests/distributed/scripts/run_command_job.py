"""A Cohort script for `phalanx run`: it builds ``Cohort()`` with no arguments (the command line sets them), trains two
steps and writes what each rank's Cohort sees to OUT/rank<r>.json. Usage: phalanx run [...] run_command_job.py OUT"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

import phalanx


def main() -> None:
    out, extra = Path(sys.argv[1]), sys.argv[2:]
    cohort = phalanx.Cohort()
    cohort.launch()  # started by phalanx run (or the cluster): nothing more to start
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    model, optimizer = cohort.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x = torch.randn(8, 4) + cohort.global_rank  # each rank its own data: DDP averages the gradients
    for _ in range(2):
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        cohort.backward(loss)
        optimizer.step()
    strategy = cohort.strategy
    report = {
        "pid": os.getpid(),
        "script_args": extra,
        "world_size": cohort.world_size,
        "global_rank": cohort.global_rank,
        "local_rank": cohort.local_rank,
        "node_rank": cohort.node_rank,
        "num_nodes": cohort.num_nodes,
        "num_devices": cohort.num_devices,
        "strategy": type(strategy).__name__,
        "precision": strategy.precision_plugin.precision,
        "accelerator": type(strategy.accelerator).__name__,
        "cluster_environment": type(getattr(strategy, "cluster_environment", None)).__name__,
        "main_address": os.environ.get("MASTER_ADDR"),
        "main_port": os.environ.get("MASTER_PORT"),
        "loss_dtype": str(loss.dtype),
        "rank_sum": float(cohort.all_reduce(torch.tensor(float(cohort.global_rank)), reduce_op="sum")),
        "weights": [value.double().flatten().tolist() for value in net.state_dict().values()],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{cohort.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
