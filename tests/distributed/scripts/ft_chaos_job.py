"""One life of one replica group in the chaos tier (strategy='ddp_ft'); it may be killed at any point and restarted.

Usage: python ft_chaos_job.py OUT_DIR STEPS [HIDDEN BATCH], with REPLICA_GROUP_ID, NUM_REPLICA_GROUPS,
TORCHFT_LIGHTHOUSE, MASTER_ADDR and MASTER_PORT set. Every line it appends to OUT_DIR/group<id>.jsonl (kept across the
group's lives) is written and flushed whole before the next step's collectives: "attempt" before a step's gradient
all-reduce (the step, the epoch and the batch's sample indices), "commit" after a committed step (with the quorum's
size), and a line when a life starts, forms its first quorum, receives a peer's state and heals (with times, for the
bench). ``replay`` trains one process on the committed steps' batches put together.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the imports: the bench splits a restart into process start and import

import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from dataclasses import replace  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Iterable  # noqa: E402

import torch  # noqa: E402
from ddp_common import IndexedRegression, write_json  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import phalanx  # noqa: E402
from phalanx.strategies import DDPFaultTolerantStrategy, FaultTolerance  # noqa: E402

GROUPS = 3
WAIT = timedelta(seconds=180)  # a group's quorum and step waits; the test's deadline bounds the run
#: Connecting, and the groups' rendezvous at a quorum change: a group killed inside it holds its peers this long (it was
#: WAIT: 180 s stalls, about 2 runs in 5 on a loaded machine). Localhost connects in well under a second.
CONNECT = timedelta(seconds=20)
BATCHES = 10  # per group and epoch
SEED = 7  # every life of every group starts from these weights, so that any group may be the first quorum's source
#: What the torchft and phalanx logs say when a life forms its quorum, starts and ends receiving a peer's state.
MILESTONES = {
    "reconfiguring for quorum_id": "quorum",
    "healing required": "transfer start",
    "Loaded state dict": "transfer end",
    "healed from a peer": "heal",
}


class Journal(phalanx.Callback):
    """Writes what each step of this life attempted and committed; counts checkpoint reads (there must be none)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with self.path.open("a") as file:
            file.write("\n")  # ends a line a kill of the previous life may have torn (an empty line is skipped)
        self.write({"event": "start", "pid": os.getpid(), "started": STARTED})

    def write(self, record: dict[str, Any]) -> None:
        # One write of one whole line, flushed: a kill leaves at most a torn last line, which the reader skips.
        record["time"] = time.time()
        with self.path.open("a") as file:
            file.write(json.dumps(record) + "\n")
            file.flush()

    def setup(self, trainer: Any, module: Any, stage: str) -> None:
        # With a lighthouse that commits steps without every group, the first lives start training together: a group
        # slower to set up would otherwise find its peers done. A restarted life finds the file already there.
        go = os.environ.get("PHALANX_CHAOS_GO")
        if go:
            print("ready", flush=True)
            deadline = time.monotonic() + 600
            while not Path(go).exists() and time.monotonic() < deadline:
                time.sleep(0.05)

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        step, epoch, indices = trainer.global_step, trainer.current_epoch, batch[2].tolist()
        self.write({"event": "attempt", "step": step, "epoch": epoch, "indices": indices})

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # A declined step trains its batch again before this hook: a batch that reaches it was committed.
        manager = trainer.strategy.manager
        self.write({"event": "commit", "step": trainer.global_step - 1, "participants": manager.num_participants()})
        print(f"committed step {trainer.global_step}", flush=True)

    def on_load_checkpoint(self, trainer: Any, module: Any, checkpoint: dict[str, Any]) -> None:
        self.write({"event": "checkpoint read"})


class Mlp(phalanx.TrainingModule):
    """Two hidden layers of ``hidden`` units; SGD with momentum, a state a rejoining group must receive too."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class _Milestones(logging.Handler):
    """Journals the torchft and phalanx log lines of MILESTONES, with their times."""

    def __init__(self, journal: Journal) -> None:
        super().__init__(logging.INFO)
        self.journal = journal

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        for text, event in MILESTONES.items():
            if text in message:
                self.journal.write({"event": event, "message": message[:300]})
                print(f"milestone {event}", flush=True)  # the supervisor may time a kill from it


def samples(batch: int) -> int:
    """The training set's size: BATCHES batches of each of GROUPS groups per epoch."""
    return batch * GROUPS * BATCHES


def main() -> None:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    hidden, batch = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (16, 4)
    group = int(os.environ["REPLICA_GROUP_ID"])
    journal = Journal(out / f"group{group}.jsonl")
    for name in ("phalanx", "torchft.manager"):
        logging.getLogger(name).addHandler(_Milestones(journal))
        logging.getLogger(name).setLevel(logging.INFO)
    phalanx.seed_everything(SEED)
    model = Mlp(hidden)
    root = out / f"group{group}"
    # Group 0 saves every few steps, so that some kills land during a save.
    saves = phalanx.callbacks.ModelCheckpoint(dirpath=root / "checkpoints", every_n_train_steps=5, save_top_k=-1)
    # A loaded machine can take most of a minute to restart a group, while its peers wait for it: generous bounds.
    options = replace(
        FaultTolerance.from_environment(), quorum_timeout=WAIT, step_timeout=WAIT, connect_timeout=CONNECT
    )
    trainer = phalanx.Trainer(
        strategy=DDPFaultTolerantStrategy(fault_tolerance=options),
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        default_root_dir=str(root),
        callbacks=[journal, saves],
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, DataLoader(IndexedRegression(n=samples(batch)), batch_size=batch))
    weights = [p.detach().flatten().tolist() for p in model.parameters()]
    write_json(out, f"group{group}.json", {"global_step": trainer.global_step, "weights": weights})


def replay(batches: Iterable[list[int]], hidden: int = 16, batch: int = 4) -> list[list[float]]:
    """The weights of one process trained, from the groups' first weights, on each given batch in order."""
    phalanx.seed_everything(SEED)
    model = Mlp(hidden)
    optimizer = model.configure_optimizers()
    data = IndexedRegression(n=samples(batch))
    for indices in batches:
        x, y = data.x[indices], data.y[indices]
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


if __name__ == "__main__":
    main()
