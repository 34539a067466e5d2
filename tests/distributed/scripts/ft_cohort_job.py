"""One replica group of a fault-tolerant run driven by a hand-written Cohort loop (strategy='ddp_ft').

Usage: python ft_cohort_job.py OUT_DIR, with REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, TORCHFT_LIGHTHOUSE, MASTER_ADDR and
MASTER_PORT set. Each committed step appends its batch's sample indices to OUT_DIR/group<id>.committed (kept across a
kill and restart) and prints "committed step N". With START_ON_STDIN=1 the process imports and launches, then waits
for a line on stdin before it sets up (joins the run): the test starts a group's next life ahead, so that the restart
costs no import time. Group 0 saves OUT_DIR/cohort.ckpt at the end and loads it back. ``reference`` is the same loop
in plain torch in one process on the groups' combined batches.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from ddp_common import IndexedRegression, write_json
from ft_harness import json_lines, log_phalanx_to_stdout
from torch import nn
from torch.utils.data import DataLoader

import phalanx
from phalanx import Cohort

BATCH = 4  # per replica group
STEPS = 5
SAMPLES = 48  # divisible by BATCH x 2 groups


def make_model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    phalanx.seed_everything(seed, verbose=False)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    # Momentum: optimizer state that a joining group must receive too.
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def loss_of(model: Any, batch: Any) -> torch.Tensor:
    x, y, _ = batch
    return nn.functional.mse_loss(model(x), y)


def weights(model: nn.Module) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in model.parameters()]


def reference(groups: int) -> list[list[float]]:
    """Plain torch in one process: at each step the groups' batches together (one contiguous block of samples)."""
    model, optimizer = make_model(7)
    loader = DataLoader(IndexedRegression(n=SAMPLES), batch_size=BATCH * groups)
    for _, batch in zip(range(STEPS), loader):
        optimizer.zero_grad()
        loss_of(model, batch).backward()
        optimizer.step()
    return weights(model)


def main() -> None:
    out = Path(sys.argv[1])
    group = int(os.environ["REPLICA_GROUP_ID"])
    # phalanx says at INFO level when a group healed from a peer; the test reads it in this output.
    log_phalanx_to_stdout()
    cohort = Cohort(strategy="ddp_ft", accelerator="cpu", devices=1)
    cohort.launch()
    if os.environ.get("START_ON_STDIN") == "1":
        sys.stdin.readline()  # (the group's manager starts in setup: until then it is not part of the run)
    # Groups other than 0 start from other weights: they must receive group 0's when the first quorum forms.
    model, optimizer = cohort.setup(*make_model(7 + group))
    loader = cohort.setup_dataloaders(DataLoader(IndexedRegression(n=SAMPLES), batch_size=BATCH))
    position = {"step": 0}
    cohort.start_training(position)  # a restarted group receives the weights, optimizer state and position here
    batches = list(loader)
    declined = 0
    while position["step"] < STEPS:
        batch = batches[position["step"]]
        optimizer.zero_grad()
        cohort.backward(loss_of(model, batch))
        optimizer.step()
        if not cohort.last_step_committed:  # a peer failed during the step: nothing changed, train the batch again
            declined += 1
            continue
        with (out / f"group{group}.committed").open("a") as file:
            file.write(json.dumps(batch[2].tolist()) + "\n")
        position["step"] += 1
        print(f"committed step {cohort.global_step}", flush=True)
    result = {"global_step": cohort.global_step, "weights": weights(model), "declined": declined}
    if cohort.is_global_zero:
        state = {"model": model, "optimizer": optimizer, "position": position}
        cohort.save(out / "cohort.ckpt", state)
        model.load_state_dict({name: torch.zeros_like(value) for name, value in model.state_dict().items()})
        state["position"] = {}
        cohort.load(out / "cohort.ckpt", state)
        result["loaded"] = {"weights": weights(model), "position": state["position"], "step": cohort.global_step}
    result["committed"] = json_lines(out / f"group{group}.committed")
    write_json(out, f"group{group}.json", result)


if __name__ == "__main__":
    main()
