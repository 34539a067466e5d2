"""torch.compile under the spawn launcher: ``Trainer(strategy="ddp_spawn", compile=...)`` and
``fit(torch.compile(model))`` at 2 processes against eager. Usage: python compile_spawn_job.py OUT; writes OUT/spawn.pt
(the weights the main process gets back, and whether the workers' model was compiled, as they logged it: ddp_spawn's
unit is the whole Net, whose forward is compiled and called by training_step through DistributedDataParallel)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from compile_job import Net, data

import phalanx


class Reporting(Net):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        # Outside the compiled forward: a Python float read from the module, no graph break.
        self.log("compiled", float("forward" in self.__dict__))
        return super().training_step(batch, batch_idx)


def fit(model: Any, **kwargs: Any) -> dict[str, Any]:
    trainer = phalanx.Trainer(
        strategy="ddp_spawn",
        devices=2,
        accelerator="cpu",
        max_steps=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **kwargs,
    )
    trainer.fit(model, data())
    return {"compiled": float(trainer.callback_metrics["compiled"])}


def main() -> None:
    out, result = Path(sys.argv[1]), {}
    for tag, kwargs, wrap in (
        ("eager", {}, False),
        ("compiled", {"compile": {"backend": "aot_eager"}}, False),
        ("precompiled", {}, True),
    ):
        phalanx.seed_everything(0)
        model = Reporting()
        result[tag] = fit(torch.compile(model, backend="aot_eager") if wrap else model, **kwargs)
        result[tag]["weights"] = {name: value.detach().clone() for name, value in model.state_dict().items()}
    torch.save(result, out / "spawn.pt")


if __name__ == "__main__":
    main()
