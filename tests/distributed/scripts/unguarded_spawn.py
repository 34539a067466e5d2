"""ddp_spawn without an `if __name__ == "__main__":` guard: must fail with a clear message, not hang."""

from ddp_common import IndexedRegression, Net
from torch.utils.data import DataLoader

import phalanx

trainer = phalanx.Trainer(
    strategy="ddp_spawn",
    devices=2,
    accelerator="cpu",
    max_steps=2,
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    enable_checkpointing=False,
)
trainer.fit(Net(), DataLoader(IndexedRegression(n=16), batch_size=4))
