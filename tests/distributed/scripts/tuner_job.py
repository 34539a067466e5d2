"""The tuner on DDP (2 CPU processes), the same project under phalanx and then, in the same processes, under
Lightning 2.6: lr_find through the Tuner and through the callback, scale_batch_size in power mode (Tuner) and binsearch
mode (callback) against an out-of-memory error the model raises above a batch size, each followed by its fit. Lightning
refuses to search batch sizes on DDP: its side records the refusal, searches on one device (in the same process) and
fits on DDP at the size found. Each rank writes {framework: {case: what was found, the weights after the fit}} to
OUT_DIR/rank<N>.json.

Usage: python tuner_job.py OUT_DIR
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
from phalanx.callbacks import BatchSizeFinder, LearningRateFinder
from phalanx.tuner import Tuner

#: Above this batch size a training step raises what CUDA raises when a batch does not fit.
MEMORY_LIMIT = 12


def _dataset() -> TensorDataset:
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


def _module_class(base: type) -> type:
    class Project(base):  # type: ignore[misc, valid-type]
        def __init__(self, lr: float = 0.01) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.batch_size = 4
            torch.manual_seed(7)
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

        def train_dataloader(self) -> DataLoader:
            # Lightning's DDP sampler shuffles any training loader (a documented difference): shuffle=True on both.
            return DataLoader(_dataset(), batch_size=self.batch_size, shuffle=True)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.batch_size > MEMORY_LIMIT:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.5)

    return Project


def _lr_cases(tuner: type, lr_finder: type) -> dict[str, tuple[Any, list, bool]]:
    """name -> (what runs before the fit or reads the callback after it, the fit's callbacks, Trainer defaults on)."""
    # The loss diverges at the 18th of 24 steps on both ranks (Lightning's ranks each decide alone; ours together).
    lr_callback = lr_finder(min_lr=1e-3, max_lr=30.0, num_training_steps=24, early_stop_threshold=10.0)
    return {
        # No early stop: the whole curve, rank 0's on every rank.
        "lr_find_tuner": (
            lambda trainer, model: tuner(trainer).lr_find(
                model, min_lr=1e-3, max_lr=0.5, num_training=20, early_stop_threshold=None
            ),
            [],
            False,
        ),
        # With the Trainer's defaults (logger, checkpoints, progress bar, summary): the fit's checkpoint only.
        "lr_find_callback": (lambda trainer, model: lr_callback.optimal_lr, [lr_callback], True),
    }


def _trainer(trainer_class: type, out: Path, callbacks: list, devices: int = 2, defaults: bool = False) -> Any:
    quiet = {} if defaults else {"logger": False, "enable_checkpointing": False, "enable_model_summary": False}
    return trainer_class(
        accelerator="cpu", strategy="ddp" if devices > 1 else "auto", devices=devices, max_epochs=3,
        enable_progress_bar=defaults, callbacks=callbacks, default_root_dir=str(out), **quiet,
    )  # fmt: skip


def _summary(result: Any, trainer: Any, model: Any, out: Path) -> dict[str, Any]:
    return {
        "lr": getattr(result, "results", {}).get("lr"),
        "loss": getattr(result, "results", {}).get("loss"),
        "suggestion": result.suggestion() if hasattr(result, "suggestion") else None,
        "size": result if isinstance(result, int) else None,
        "model_lr": model.hparams.lr,
        "model_batch_size": model.batch_size,
        "global_step": trainer.global_step,
        "weights": [p.detach().flatten().tolist() for p in model.parameters()],
        # A sweep's temporary checkpoint left behind, or a checkpoint other than the fit's own (its defaults on).
        "checkpoints": sorted(p.name for p in out.rglob("*.ckpt")),
    }


def _lr_runs(module_class: type, trainer_class: type, cases: dict, out: Path) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name, (tune, callbacks, defaults) in cases.items():
        model = module_class()
        trainer = _trainer(trainer_class, out, callbacks, defaults=defaults)
        before = None if callbacks else tune(trainer, model)
        trainer.fit(model)
        found[name] = _summary(tune(trainer, model) if callbacks else before, trainer, model, out)
    return found


def _ours(out: Path) -> tuple[dict[str, Any], int]:
    module_class = _module_class(phalanx.TrainingModule)
    found = _lr_runs(module_class, phalanx.Trainer, _lr_cases(Tuner, LearningRateFinder), out)
    model = module_class()
    trainer = _trainer(phalanx.Trainer, out, [])
    size = Tuner(trainer).scale_batch_size(model, mode="power", max_trials=6)
    trainer.fit(model)
    found["power_tuner"] = _summary(size, trainer, model, out)
    finder = BatchSizeFinder(mode="binsearch", max_trials=6)
    model = module_class()
    trainer = _trainer(phalanx.Trainer, out, [finder])
    trainer.fit(model)
    found["binsearch_callback"] = _summary(finder.optimal_batch_size, trainer, model, out)
    return found, trainer.global_rank


def _theirs(out: Path) -> dict[str, Any]:
    import pytorch_lightning as pl  # the oracle, imported after phalanx's run so that it cannot change it
    from pytorch_lightning.callbacks import LearningRateFinder as PLLearningRateFinder
    from pytorch_lightning.tuner import Tuner as PLTuner

    module_class = _module_class(pl.LightningModule)
    found = _lr_runs(module_class, pl.Trainer, _lr_cases(PLTuner, PLLearningRateFinder), out)
    for name, mode in (("power_tuner", "power"), ("binsearch_callback", "binsearch")):
        # Lightning refuses to search on DDP: its search on one device, then its DDP fit at the size found.
        try:
            PLTuner(_trainer(pl.Trainer, out, [])).scale_batch_size(module_class(), mode=mode, max_trials=6)
            refusal = ""
        except ValueError as error:
            refusal = str(error)
        size = PLTuner(_trainer(pl.Trainer, out, [], devices=1)).scale_batch_size(
            module_class(), mode=mode, max_trials=6
        )
        model = module_class()
        model.batch_size = size
        trainer = _trainer(pl.Trainer, out, [])
        trainer.fit(model)
        found[name] = {**_summary(size, trainer, model, out), "ddp_refusal": refusal}
    return found


def main() -> None:
    out = Path(sys.argv[1])
    ours, rank = _ours(out / "phalanx")
    # The processes phalanx started hold LOCAL_RANK, WORLD_SIZE and the process group now: Lightning joins them.
    theirs = _theirs(out / "lightning")
    write_json(out, f"rank{rank}.json", {"phalanx": ours, "lightning": theirs})


if __name__ == "__main__":
    main()
