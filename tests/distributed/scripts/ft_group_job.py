"""One replica group of a fault-tolerant run (strategy='ddp_ft', the Trainer's defaults); writes where it ended.

Usage: python ft_group_job.py OUT_DIR, with REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, TORCHFT_LIGHTHOUSE, MASTER_ADDR and
MASTER_PORT set. Each committed step appends its batch's sample indices to OUT_DIR/group<id>.committed (kept across a
kill and restart of the group) and prints "committed step N". ``reference_fit`` is the same training in one process on
the groups' combined batches. PHALANX_FT_SLOW=N stalls group 1 (alive) while groups 0 and 2 commit N steps without it.
The model steps a StepLR per step, the kill-and-rejoin run validates after every step, and each group records at each
step's start its learning rate, scheduler state and the states of an EarlyStopping and a top-k ModelCheckpoint (in a
folder all groups name): what a rejoining group must receive from its peer. PHALANX_FT_HOLD_AT=N waits after
committing step N (for the test to kill the group) and PHALANX_FT_CKPT_PATH is the fit's ``ckpt_path`` (e.g. "auto").
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
from phalanx.callbacks import EarlyStopping, ModelCheckpoint

BATCH = 4  # per replica group
STEPS = 4
SLOW_STEPS = 6  # with PHALANX_FT_SLOW (3 groups: 4 batches an epoch): group 1 catches up inside the first epoch
SAMPLES = 48  # divisible by BATCH x groups for 2 and 3 groups: every group reads as many batches
LR_STEP = 3  # StepLR's step_size: the rate halves after step 3, whichever step (1 to 3) a restarted group rejoins at


class CommittedBatches(phalanx.Callback):
    """Records the samples of each batch that a committed step trained on, and says so on stdout (flushed)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # A declined step trains its batch again before this hook: every batch that reaches it was committed.
        with self.path.open("a") as file:
            file.write(json.dumps(batch[2].tolist()) + "\n")
        print(f"committed step {trainer.global_step}", flush=True)


class SlowGroup(phalanx.Callback):
    """PHALANX_FT_SLOW=MISSED (3 groups): group 1 stalls before its step 1 (alive, heartbeating) while groups 0 and 2
    commit MISSED steps without it; they wait at their step 1 + MISSED (bounded) until group 1 is awake again, so that
    group 1's next quorum finds them ahead of it (in a real run: a group descheduled for a while, then back)."""

    def __init__(self, out: Path, group: int, missed: int) -> None:
        self.out, self.group, self.missed = out, group, missed

    def _wait_for(self, ready: Any, what: str) -> None:
        deadline = time.monotonic() + 120
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"group {self.group} waited 120 s for {what}")
            time.sleep(0.05)

    def on_sanity_check_end(self, trainer: Any, module: Any) -> None:
        # Both groups' managers are up before either forms its first quorum: that quorum has both.
        (self.out / f"ready{self.group}").touch()
        groups = int(os.environ["NUM_REPLICA_GROUPS"])
        self._wait_for(lambda: all((self.out / f"ready{g}").exists() for g in range(groups)), "the other groups")

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        committed = self.out / "group0.committed"

        def ahead() -> bool:
            return committed.exists() and len(committed.read_text().splitlines()) >= 1 + self.missed

        if self.group == 1 and trainer.global_step == 1 and not (self.out / "awake").exists():
            self._wait_for(ahead, f"group 0 to commit {self.missed} steps alone")
            (self.out / "awake").touch()
        if self.group != 1 and trainer.global_step == 1 + self.missed:
            self._wait_for((self.out / "awake").exists, "group 1 to wake")


class Hold(phalanx.Callback):
    """Waits after committing step ``step`` (the checkpoints of earlier steps complete) until the test kills this
    process; a bounded wait, so that a test that never kills it fails instead of hanging."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            print(f"holding after committed step {self.step}", flush=True)
            time.sleep(240)
            raise TimeoutError(f"nothing killed this group within 240 s of committing step {self.step}")


class MomentumNet(Net):
    """Net with an optimizer that has state (momentum), which a joining group must receive too."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class ScheduledNet(MomentumNet):
    """MomentumNet whose learning rate a StepLR halves every LR_STEP optimizer steps (its state a peer must send)."""

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=LR_STEP, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _number(value: Any) -> float | None:
    return None if value is None else float(value)


class TrainingStates(phalanx.Callback):
    """Records, at the start of each step, the learning rate, the scheduler's and the callbacks' states (the last
    record of a step wins: a declined step starts again)."""

    def __init__(self) -> None:
        self.records: dict[int, dict[str, Any]] = {}

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self.records[trainer.global_step] = training_state(trainer)


def training_state(trainer: Any) -> dict[str, Any]:
    """What a group's training depends on besides its weights: scheduler, learning rate, callbacks' states."""
    scheduler = trainer.lr_scheduler_configs[0].scheduler.state_dict()
    stopping = next(c for c in trainer.callbacks if isinstance(c, EarlyStopping))
    best = next(c for c in trainer.callbacks if isinstance(c, ModelCheckpoint) and c.monitor == "step")
    return {
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "scheduler": {key: scheduler[key] for key in ("last_epoch", "_step_count", "_last_lr")},
        "wait_count": stopping.wait_count,
        "best_score": _number(stopping.best_score),
        "best_model_score": _number(best.best_model_score),
        "best_k_models": {str(path): float(score) for path, score in best.best_k_models.items()},
    }


def fit(
    strategy: Any,
    root: Path,
    batch_size: int,
    seed: int = 7,
    callbacks: list[Any] | None = None,
    max_steps: int = STEPS,
    val_check_interval: int | None = None,
    ckpt_path: str | None = None,
) -> tuple[phalanx.Trainer, MomentumNet]:
    phalanx.seed_everything(seed)
    model = ScheduledNet()
    trainer = phalanx.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        default_root_dir=str(root),
        callbacks=callbacks,
        val_check_interval=val_check_interval,
    )
    train = DataLoader(IndexedRegression(n=SAMPLES), batch_size=batch_size)
    trainer.fit(model, train, DataLoader(IndexedRegression(n=8, seed=1), batch_size=4), ckpt_path=ckpt_path)
    return trainer, model


def reference_fit(groups: int, root: Path) -> list[list[float]]:
    """The weights of a plain one-process run whose batches are the groups' batches of each step put together."""
    # Group g reads samples g, g + groups, ... : at each step the groups together read one contiguous block.
    _, model = fit("single_device", root, BATCH * groups)
    return [p.detach().flatten().tolist() for p in model.parameters()]


def main() -> None:
    out = Path(sys.argv[1])
    group = int(os.environ["REPLICA_GROUP_ID"])
    # phalanx says at INFO level when a group healed from a peer; the test reads it in this output.
    log_phalanx_to_stdout()
    # Groups other than 0 start from other weights: they must receive group 0's when the first quorum forms.
    committed = CommittedBatches(out / f"group{group}.committed")
    states = TrainingStates()
    callbacks: list[Any] = [
        committed,
        states,
        ModelCheckpoint(),  # the default one (monitor None), in the group's own folder: only group 0 writes
        # Every group names this folder (a shared file system): a rejoined group's top-k entries are group 0's files,
        # which it never writes nor removes. monitor="step" ranks alike on every group: each save drops the oldest.
        ModelCheckpoint(
            out / "best", "{step}", monitor="step", mode="max", save_top_k=2, save_on_train_epoch_end=False
        ),
        EarlyStopping("val_loss", patience=100),
    ]
    missed = int(os.environ.get("PHALANX_FT_SLOW", "0"))
    if missed:
        callbacks.append(SlowGroup(out, group, missed))
    if "PHALANX_FT_HOLD_AT" in os.environ:
        callbacks.append(Hold(int(os.environ["PHALANX_FT_HOLD_AT"])))
    steps = SLOW_STEPS if missed else STEPS
    # The kill-and-rejoin run validates after every step, so that EarlyStopping and ModelCheckpoint have changed by the
    # heal; the slow-group run (3 groups, more steps) validates once per epoch, as by default, to stay cheap.
    every_step = None if missed else 1
    resume = os.environ.get("PHALANX_FT_CKPT_PATH")
    trainer, model = fit("ddp_ft", out / f"group{group}", BATCH, 7 + group, callbacks, steps, every_step, resume)
    write_json(
        out,
        f"group{group}.json",
        {
            "global_step": trainer.global_step,
            "committed": json_lines(committed.path),
            "is_global_zero": trainer.is_global_zero,
            "checkpoints": sorted(p.name for p in (out / f"group{group}").rglob("*.ckpt")),
            "weights": [p.detach().flatten().tolist() for p in model.parameters()],
            "states": {str(step): record for step, record in states.records.items()},
            "final_state": training_state(trainer),
        },
    )


if __name__ == "__main__":
    main()
