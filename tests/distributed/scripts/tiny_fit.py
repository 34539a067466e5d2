"""A few DDP steps; each rank writes where it stood and its final weights.

Usage: python tiny_fit.py OUT_DIR DEVICES NUM_NODES [module-mode marker ignored]
"""

import sys
from pathlib import Path

from ddp_common import IndexedRegression, Net, write_json
from torch.utils.data import DataLoader

import phalanx


def main() -> None:
    out, devices, num_nodes = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    phalanx.seed_everything(5)
    model = Net()
    trainer = phalanx.Trainer(
        strategy="ddp",
        devices=devices,
        num_nodes=num_nodes,
        accelerator="cpu",
        max_steps=4,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, DataLoader(IndexedRegression(n=64), batch_size=4, shuffle=True))
    strategy = trainer.strategy
    write_json(
        out,
        f"rank{trainer.global_rank}.json",
        {
            "environment": type(strategy.cluster_environment).__name__,
            "world_size": trainer.world_size,
            "global_rank": trainer.global_rank,
            "local_rank": trainer.local_rank,
            "node_rank": trainer.node_rank,
            "global_step": trainer.global_step,
            "argv": sys.argv[1:],
            "weights": [p.detach().flatten().tolist() for p in model.parameters()],
        },
    )


if __name__ == "__main__":
    main()
