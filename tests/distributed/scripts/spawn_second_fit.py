"""A second fit on the same Trainer after a spawned or forked one; the main process reports what it ended with.

Usage: python spawn_second_fit.py OUT_DIR STRATEGY
"""

import sys
from pathlib import Path

import torch
from ddp_common import IndexedRegression, Net, write_json
from torch.utils.data import DataLoader

import phalanx


def trainer_for(strategy: str, max_steps: int) -> phalanx.Trainer:
    return phalanx.Trainer(
        strategy=strategy, devices=2, accelerator="cpu", max_epochs=5, max_steps=max_steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip


if __name__ == "__main__":
    out, strategy = Path(sys.argv[1]), sys.argv[2]
    data = IndexedRegression(n=40)  # 20 samples a rank, batches of 4: 5 steps an epoch
    phalanx.seed_everything(3)
    whole = Net()
    trainer_for(strategy, 12).fit(whole, DataLoader(data, batch_size=4, shuffle=True))
    phalanx.seed_everything(3)
    model = Net()
    trainer = trainer_for(strategy, 7)
    world_size_before_fit = trainer.world_size
    trainer.fit(model, DataLoader(data, batch_size=4, shuffle=True))  # stops inside epoch 1
    first = (trainer.current_epoch, trainer.global_step)
    trainer.max_steps = 12
    trainer.fit(model, DataLoader(data, batch_size=4, shuffle=True))
    write_json(
        out,
        "main.json",
        {
            "world_size_before_fit": world_size_before_fit,
            "first": first,
            "second": (trainer.current_epoch, trainer.global_step),
            "same_as_one_fit": all(torch.equal(a, b) for a, b in zip(model.parameters(), whole.parameters())),
        },
    )
