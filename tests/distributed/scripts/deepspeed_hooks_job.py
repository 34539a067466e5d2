"""One process: fits under DeepSpeed ZeRO-2 on the CPU with TrainingModule.optimizer_step overridden; prints JSON.

Usage: python deepspeed_hooks_job.py ROOT_DIR. The same warm-up also runs without DeepSpeed, as the reference.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import phalanx  # noqa: E402
from phalanx.utilities.exceptions import MisconfigurationError  # noqa: E402


class Net(phalanx.TrainingModule):
    """optimizer_step as a user writes it: 'warmup' scales the LR, 'default' only steps, 'no_closure' forgets it."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.layer = nn.Linear(4, 1)
        self.calls: list[list[int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return nn.functional.mse_loss(self.layer(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        self.calls.append([batch_idx, self.trainer.global_step])
        if self.mode == "warmup":
            for group in optimizer.param_groups:
                group["lr"] = 0.05 * min(1.0, (self.trainer.global_step + 1) / 4)
        if self.mode == "no_closure":
            optimizer.step()
        else:
            optimizer.step(closure=optimizer_closure)


class Plain(Net):
    optimizer_step = phalanx.TrainingModule.optimizer_step  # not overridden: the loop steps itself


def fit(kind: type[Net], mode: str, root: str, strategy: str, accumulate: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = kind(mode)
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    trainer = phalanx.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=os.path.join(root, f"{mode}-{strategy}-{accumulate}"),
    )
    try:
        trainer.fit(model, data)
    except MisconfigurationError as error:
        return {"error": str(error), "calls": model.calls}
    return {
        "calls": model.calls,
        "weights": model.layer.weight.detach().flatten().tolist(),
        "global_step": trainer.global_step,
    }


def main(root: str) -> None:
    results = {"reference_warmup": fit(Net, "warmup", root, "auto", 1)}
    for name, kind, mode, accumulate in (
        ("plain", Plain, "plain", 2),
        ("default", Net, "default", 2),
        ("warmup", Net, "warmup", 1),
        ("no_closure", Net, "no_closure", 1),
    ):
        results[name] = fit(kind, mode, root, "deepspeed_stage_2", accumulate)
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
