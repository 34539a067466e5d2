"""A training job that survives interruptions: it always calls fit(ckpt_path="auto").

Usage: python resumable_job.py OUT_DIR DEVICES [--signal RANK STEP NAME] [--kill RANK STEP] [--slow-save STEP]
[--strategy NAME]
  --signal    rank RANK sends itself signal NAME after STEP optimizer steps (only on the first attempt)
  --kill      rank RANK kills itself with SIGKILL after STEP steps (only on the first torchrun attempt)
  --slow-save the checkpoint written at STEP sleeps before it is renamed into place (a window to kill the job)
  --strategy  the registered strategy name (default: 'ddp' on several devices)
Rank 0 writes the final parameters to OUT_DIR/final.pt.
"""

import argparse
import os
import signal
import time
from pathlib import Path

import torch
from ddp_common import IndexedRegression
from torch import nn
from torch.utils.data import DataLoader

import phalanx
from phalanx.callbacks import ModelCheckpoint
from phalanx.plugins import TorchCheckpointIO
from phalanx.trainer import Preemption


class Net(phalanx.TrainingModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


class Faults(phalanx.Callback):
    def __init__(self, args, out):
        self.args, self.out = args, out
        self.first_attempt = (
            os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and not (out / "attempted").exists()
        )

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if not self.first_attempt:
            return
        if (
            self.args.signal
            and trainer.global_rank == int(self.args.signal[0])
            and trainer.global_step == int(self.args.signal[1])
        ):
            (self.out / "attempted").touch()
            os.kill(os.getpid(), getattr(signal, self.args.signal[2]))
        if (
            self.args.kill
            and trainer.global_rank == int(self.args.kill[0])
            and trainer.global_step == int(self.args.kill[1])
        ):
            (self.out / "attempted").touch()
            os.kill(os.getpid(), signal.SIGKILL)


class SlowIO(TorchCheckpointIO):
    """Stalls inside one save, after the bytes are written but before the file is complete."""

    def __init__(self, out, step):
        self.out, self.step = out, step

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        if checkpoint["global_step"] == self.step and not (self.out / "attempted").exists():
            from phalanx.plugins.io import serialization

            original = serialization.os.replace

            def slow_replace(source, target):
                (self.out / "attempted").touch()
                (self.out / "saving").touch()
                time.sleep(60)
                original(source, target)

            serialization.os.replace = slow_replace
            try:
                return super().save_checkpoint(checkpoint, path, storage_options)
            finally:
                serialization.os.replace = original
        return super().save_checkpoint(checkpoint, path, storage_options)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("devices", type=int)
    parser.add_argument("--signal", nargs=3)
    parser.add_argument("--kill", nargs=2)
    parser.add_argument("--slow-save", type=int)
    parser.add_argument("--strategy")
    args = parser.parse_args()
    out = Path(args.out)
    phalanx.seed_everything(7)
    model = Net()
    plugins = [SlowIO(out, args.slow_save)] if args.slow_save else []
    trainer = phalanx.Trainer(
        strategy=args.strategy or ("ddp" if args.devices > 1 else "auto"),
        devices=args.devices,
        accelerator="cpu",
        max_epochs=3,
        callbacks=[
            ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=4, save_top_k=-1),
            Faults(args, out),
        ],
        plugins=plugins,
        preemption=Preemption(check_every_n_steps=1),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        deterministic=True,
    )
    trainer.fit(model, DataLoader(IndexedRegression(n=60), batch_size=4, shuffle=True), ckpt_path="auto")
    state = trainer.strategy.module_state_dict()  # whole tensors (a collective under the sharded strategies)
    if trainer.is_global_zero:
        torch.save([value.detach().cpu() for value in state.values()], out / "final.pt")


if __name__ == "__main__":
    main()
