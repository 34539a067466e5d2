"""ddp_spawn: torch's global switches set in the main process hold in the workers, and layers made in configure_model
come back to the main process. Usage: python spawn_settings.py OUT_DIR STRATEGY"""

import sys
from pathlib import Path

import torch
from ddp_common import IndexedRegression, write_json
from torch import nn
from torch.utils.data import DataLoader

import phalanx


class LateLayers(phalanx.TrainingModule):
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out
        self.head = None

    def configure_model(self) -> None:
        if self.head is None:
            self.head = nn.Linear(4, 1)

    def on_fit_start(self) -> None:
        write_json(
            self.out,
            f"rank{self.global_rank}.json",
            {
                "deterministic": torch.are_deterministic_algorithms_enabled(),
                "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
                "cudnn_deterministic": torch.backends.cudnn.deterministic,
                "matmul_precision": torch.get_float32_matmul_precision(),
            },
        )

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return nn.functional.mse_loss(self.head(x), y)

    def on_train_end(self) -> None:
        if self.global_rank == 0:
            torch.save({k: v.detach().clone() for k, v in self.state_dict().items()}, self.out / "rank0_final.pt")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    out, strategy = Path(sys.argv[1]), sys.argv[2]
    torch.set_float32_matmul_precision("medium")
    model = LateLayers(out)
    trainer = phalanx.Trainer(
        strategy=strategy,
        devices=2,
        accelerator="cpu",
        max_steps=4,
        deterministic="warn",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, DataLoader(IndexedRegression(n=32), batch_size=4))
    final = torch.load(out / "rank0_final.pt", weights_only=True)
    write_json(
        out,
        "main.json",
        {
            "has_head": model.head is not None,
            "same_as_rank0": model.head is not None
            and all(torch.equal(v, final[k]) for k, v in model.state_dict().items()),
        },
    )
