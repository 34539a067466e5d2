"""GradientAccumulationScheduler, StochasticWeightAveraging and BackboneFinetuning on DDP (2 CPU processes), one fit
each: each rank writes its steps, final parameters and what the callback holds, or the error that refused the fit.

Usage: python training_callbacks_job.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from ddp_common import write_json
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.callbacks import BackboneFinetuning, GradientAccumulationScheduler, StochasticWeightAveraging


def _data() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)  # 4 batches a rank per epoch


def _layers() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU()), nn.Linear(8, 1)


def _module_class(base: type) -> type:
    class Model(base):  # type: ignore[misc, valid-type]
        def __init__(self, head_only: bool) -> None:
            super().__init__()
            self.backbone, self.head = _layers()
            self.head_only = head_only

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.head(self.backbone(x)), y)

        def configure_optimizers(self) -> Any:
            params = self.head.parameters() if self.head_only else self.parameters()
            return torch.optim.SGD(params, lr=0.02, momentum=0.9)

    return Model


def main() -> None:
    out = Path(sys.argv[1])
    model_class = _module_class(phalanx.TrainingModule)
    cases = {
        "accumulation": (GradientAccumulationScheduler({1: 2}), False),
        "swa": (StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2), False),
        "finetuning": (BackboneFinetuning(unfreeze_backbone_at_epoch=1), True),
    }
    results: dict[str, Any] = {}
    for name, (callback, head_only) in cases.items():
        model = model_class(head_only)
        trainer = phalanx.Trainer(
            accelerator="cpu", strategy="ddp", devices=2, max_epochs=3, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[callback], default_root_dir=str(out),
        )  # fmt: skip
        try:
            trainer.fit(model, _data())
        except NotImplementedError as error:
            results[name] = {"error": str(error)}
            continue
        results[name] = {
            "global_step": trainer.global_step,
            "current_epoch": trainer.current_epoch,
            "parameters": [p.detach().flatten().tolist() for p in model.parameters()],
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "n_averaged": int(getattr(callback, "n_averaged", None) or 0),
        }
    write_json(out, f"rank{trainer.global_rank}.json", results)


if __name__ == "__main__":
    main()
