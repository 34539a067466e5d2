"""One DDP job on 2 CPU processes exercising sharding, synced metrics, checkpoints, callbacks and prediction order.

Usage: python ddp_features.py OUT_DIR [strategy]
"""

import sys
from pathlib import Path

import torch
from ddp_common import IndexedRegression, Net, write_json
from torch.utils.data import DataLoader

import phalanx
from phalanx.callbacks import EarlyStopping, ModelCheckpoint
from phalanx.plugins import TorchCheckpointIO
from phalanx.utilities.rank_zero import rank_zero_only


class CountingIO(TorchCheckpointIO):
    def __init__(self):
        self.saved = 0

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.saved += 1
        super().save_checkpoint(checkpoint, path, storage_options)


def main() -> None:
    out = Path(sys.argv[1])
    strategy = sys.argv[2] if len(sys.argv) > 2 else "ddp"
    phalanx.seed_everything(1)
    model = Net(batchnorm=True)  # BatchNorm: evaluation must broadcast its buffers from rank 0
    io = CountingIO()
    checkpoint = ModelCheckpoint(dirpath=out / "checkpoints", monitor="val_loss", save_top_k=2, save_last=True)
    early = EarlyStopping(monitor="val_loss", patience=100)
    trainer = phalanx.Trainer(
        strategy=strategy,
        devices=2,
        accelerator="cpu",
        max_epochs=3,
        plugins=[io],
        callbacks=[checkpoint, early],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=out,
    )
    data = IndexedRegression(n=51)  # odd: the training sampler pads, evaluation must not
    train = DataLoader(data, batch_size=13, shuffle=True)
    val = DataLoader(data, batch_size=8)
    trainer.fit(model, train, val)
    rank = trainer.global_rank
    fit_metrics = {name: value.item() for name, value in trainer.callback_metrics.items()}
    order_epoch = []
    # The sampler was replaced by a DistributedSampler: record this rank's share for two epochs.
    sampler = trainer._run.train_dataloader.sampler
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        order_epoch.append(list(iter(sampler)))
    validated = trainer.validate(model, val, verbose=False)
    tested = trainer.test(model, val, verbose=False)
    predictions = trainer.predict(model, DataLoader(data, batch_size=8))
    gathered = trainer.strategy.all_gather(torch.tensor([float(rank)]))
    decision_all = trainer.strategy.reduce_boolean_decision(rank == 0, all=True)
    decision_any = trainer.strategy.reduce_boolean_decision(rank == 0, all=False)
    calls = []
    rank_zero_only(lambda: calls.append(1))()
    write_json(
        out,
        f"rank{rank}.json",
        {
            "world_size": trainer.world_size,
            "global_step": trainer.global_step,
            "seen_train_epoch_total": len(model.seen_train),
            "seen_train": model.seen_train,
            "sampler_orders": order_epoch,
            "val_count": fit_metrics["val_count"],
            "val_loss_fit": fit_metrics["val_loss"],
            "validated": validated,
            "tested": tested,
            "predictions": torch.cat(predictions).flatten().tolist(),
            "prediction_batches": [len(p) for p in predictions],
            "gathered": gathered.flatten().tolist(),
            "decision_all": decision_all,
            "decision_any": decision_any,
            "rank_zero_calls": len(calls),
            "io_saved": io.saved,
            "best_model_path": checkpoint.best_model_path,
            "best_k": sorted(checkpoint.best_k_models),
            "weights": [p.detach().flatten().tolist() for p in model.parameters()],
        },
    )
    torch.save({"x": data.x, "y": data.y, "state_dict": model.state_dict()}, out / f"state{rank}.pt")


if __name__ == "__main__":
    main()
