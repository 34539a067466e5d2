"""One replica group of two processes in a fault-tolerant run (the Trainer's defaults); writes where each rank ended.

Usage: python ft_multi_process_job.py OUT_DIR STRATEGY, with REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, TORCHFT_LIGHTHOUSE,
MASTER_ADDR and MASTER_PORT set; the Trainer's launcher starts the group's second process. The test steers the run
through files in OUT_DIR: every process says "ready" once its group's quorum client runs and waits for ``start``;
after a committed step, a process of group g waits for ``go<g>`` while ``hold<g>`` exists (group 0 only once it trained
without a peer group). Each committed step appends ``{"step", "indices"}`` to OUT_DIR/group<g>.rank<r>.committed (kept
across a kill and restart). ``reference_fit`` trains one process on the committed steps' batches put together.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from ddp_common import IndexedRegression, Net, write_json
from ft_harness import json_lines, log_phalanx_to_stdout
from torch.utils.data import DataLoader

import phalanx

BATCH = 2  # per process
PROCESSES = 2  # per replica group
STEPS = 5
SAMPLES = 40  # every process's share holds STEPS batches of BATCH for 2 groups of 2
WAIT_S = 240  # bound on every wait for the test's files: a lost test process fails this job instead of hanging it


class MomentumNet(Net):
    """Net with an optimizer that has state (momentum), which a joining group must receive too."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def full_weights(model: torch.nn.Module) -> list[list[float]]:
    """Every parameter whole, flattened (a sharded one gathered from the group's processes: a collective)."""
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return [p.detach().flatten().tolist() for p in whole]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {WAIT_S} s: the test steering this job is gone.")
        time.sleep(0.05)


class Steered(phalanx.Callback):
    """Records each committed step's samples, says so on stdout, and waits where the test's files say."""

    def __init__(self, out: Path, group: int) -> None:
        self.out, self.group = out, group

    def _say(self, trainer: Any, text: str) -> None:
        # One write per line: both processes of the group share this output, and a pipe keeps short writes whole.
        sys.stdout.write(f"group {self.group} rank {trainer.global_rank} pid {os.getpid()} {text}\n")
        sys.stdout.flush()

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        # The quorum client runs (it sends heartbeats): the first quorum then waits for every group that said ready.
        self._say(trainer, "ready")
        _wait_for(self.out / "start")

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        # The weights every group trains from once the first quorum synchronised them (before any update).
        if trainer.global_step == 0:
            write_json(self.out, f"initial.group{self.group}.rank{trainer.global_rank}.json", full_weights(module))

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # A declined step trains its batch again before this hook: every batch that reaches it was committed.
        path = self.out / f"group{self.group}.rank{trainer.global_rank}.committed"
        with path.open("a") as file:
            file.write(json.dumps({"step": trainer.global_step, "indices": batch[2].tolist()}) + "\n")
        groups = list(trainer.strategy.membership.groups)
        self._say(trainer, f"committed step {trainer.global_step} with groups {groups}")
        alone = len(groups) < int(os.environ["NUM_REPLICA_GROUPS"])
        if (self.out / f"hold{self.group}").exists() and (self.group != 0 or alone):
            self._say(trainer, "holding")
            _wait_for(self.out / f"go{self.group}")


def fit(
    strategy: Any,
    root: Path,
    train: DataLoader,
    steps: int,
    seed: int,
    initial: list[list[float]] | None = None,
    **trainer_kwargs: Any,
) -> Any:
    phalanx.seed_everything(seed)
    model = MomentumNet()
    with torch.no_grad():
        for parameter, values in zip(model.parameters(), initial or []):
            parameter.copy_(torch.tensor(values).view_as(parameter))
    trainer = phalanx.Trainer(
        strategy=strategy, accelerator="cpu", max_steps=steps, default_root_dir=str(root), **trainer_kwargs
    )
    trainer.fit(model, train, DataLoader(IndexedRegression(n=8, seed=1), batch_size=4))
    return trainer, model


def committed_steps(out: Path) -> list[list[int]]:
    """Each committed step's samples over every process of every group, in step order."""
    steps: dict[int, list[int]] = {}
    for path in out.glob("group*.rank*.committed"):
        for record in json_lines(path):
            steps.setdefault(record["step"], []).extend(record["indices"])
    return [sorted(steps[step]) for step in sorted(steps)]


def reference_fit(out: Path, initial: list[list[float]] | None = None) -> list[list[float]]:
    """The weights of a plain one-process run whose batches are the committed steps' samples put together, from
    ``initial`` weights (else the seed's)."""
    batches = committed_steps(out)
    train = DataLoader(IndexedRegression(n=SAMPLES), batch_sampler=batches)
    _, model = fit("single_device", out / "reference", train, len(batches), seed=7, initial=initial, devices=1)
    return [p.detach().flatten().tolist() for p in model.parameters()]


def main() -> None:
    out, strategy = Path(sys.argv[1]), sys.argv[2]
    group = int(os.environ["REPLICA_GROUP_ID"])
    # phalanx says at INFO level when a group left, joined or healed from a peer; the test reads it in this output.
    log_phalanx_to_stdout()
    train = DataLoader(IndexedRegression(n=SAMPLES), batch_size=BATCH)
    # Group 1 starts from other weights: it must receive group 0's when the first quorum forms.
    steered = Steered(out, group)
    trainer, model = fit(
        strategy, out / f"group{group}", train, STEPS, seed=7 + group, devices=PROCESSES, callbacks=[steered]
    )
    write_json(
        out,
        f"group{group}.rank{trainer.global_rank}.json",
        {
            "global_step": trainer.global_step,
            "is_global_zero": trainer.is_global_zero,
            "weights": full_weights(model),
            # What this process holds: the parameters' local bytes (its shard, when sharded) and the model's.
            "local_bytes": sum(_local(p).numel() * p.element_size() for p in model.parameters()),
            "model_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "checkpoints": sorted(str(p) for p in (out / f"group{group}").rglob("*.ckpt")),
        },
    )


if __name__ == "__main__":
    main()
