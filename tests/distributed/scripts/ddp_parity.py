"""50 SGD steps of phalanx DDP on 2 CPU processes; rank 0 saves the final weights. Usage: python ddp_parity.py OUT.pt
[STRATEGY]"""

import sys

import torch
from ddp_common import IndexedRegression, Net
from torch.utils.data import DataLoader

import phalanx

if __name__ == "__main__":
    phalanx.seed_everything(0)
    model = Net(lr=0.05)
    trainer = phalanx.Trainer(
        strategy=sys.argv[2] if len(sys.argv) > 2 else "ddp",
        devices=2,
        accelerator="cpu",
        max_steps=50,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, DataLoader(IndexedRegression(n=800), batch_size=8, shuffle=True))
    if trainer.is_global_zero:
        torch.save([p.detach() for p in model.parameters()], sys.argv[1])
