"""fit / validate / predict with a multiprocessing launcher; the main process reports what it got back.

Usage: python launch_results.py OUT_DIR STRATEGY
"""

import sys
from pathlib import Path

import torch
from ddp_common import IndexedRegression, Net, write_json
from torch.utils.data import DataLoader

import phalanx
from phalanx.callbacks import ModelCheckpoint

if __name__ == "__main__":
    out, strategy = Path(sys.argv[1]), sys.argv[2]
    phalanx.seed_everything(3)
    model = Net()
    # 400 kB of state: rank 0's results must reach the main process even when they exceed a pipe's buffer.
    model.register_buffer("ballast", torch.arange(100_000, dtype=torch.float32))
    before = [p.detach().clone() for p in model.parameters()]
    checkpoint = ModelCheckpoint(dirpath=out, monitor="val_loss", save_top_k=1)
    trainer = phalanx.Trainer(
        strategy=strategy,
        devices=2,
        accelerator="cpu",
        max_epochs=2,
        callbacks=[checkpoint],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    data = IndexedRegression(n=40)
    trainer.fit(model, DataLoader(data, batch_size=4, shuffle=True), DataLoader(data, batch_size=8))
    predictions = trainer.predict(model, DataLoader(data, batch_size=8))
    with torch.no_grad():
        expected = model(data.x)
    write_json(
        out,
        "main.json",
        {
            "changed": not all(torch.equal(a, b) for a, b in zip(before, model.parameters())),
            "global_step": trainer.global_step,
            "current_epoch": trainer.current_epoch,
            "val_loss": trainer.callback_metrics["val_loss"].item() if "val_loss" in trainer.callback_metrics else None,
            "best_model_path": checkpoint.best_model_path,
            "predictions_match": torch.allclose(torch.cat(predictions), expected, atol=1e-6),
            "prediction_batches": [len(p) for p in predictions],
        },
    )
