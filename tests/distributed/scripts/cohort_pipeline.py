"""A hand-written Cohort loop over a pipeline of two stages (ModelParallelStrategy with pipeline_parallel_size=2, 1F1B),
run by cohort_strategies_job.py's 'ddp' processes for tests/distributed/test_cohort_strategies.py: the losses, the whole
model's weights and the predictions, the refusal of ``cohort.backward``, and a save and load that goes on as the
unbroken run; then the Cohort example of docs/pipeline.md, in the same processes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from pipeline_common import AdamNet, loader

import phalanx
from phalanx.strategies import ModelParallelStrategy
from phalanx.strategies.pipeline_split import keep_stage

EXAMPLE = Path(__file__).parents[3] / "docs" / "pipeline.md"
SAVE_AT = 2  # of the 4 batches of 8 samples


class MeshNet(AdamNet):
    """``AdamNet`` whose stage comes from the mesh's pipeline axis, which a Trainer and a Cohort both give."""

    def configure_model(self) -> None:
        pipeline = self.device_mesh["pipeline_parallel"]
        keep_stage(self, "blocks", pipeline.get_local_rank(), pipeline.size(), first=["embed"], last=["head"])


def steps(cohort: phalanx.Cohort, state: dict[str, Any], batches: list[Any], start: int, out: Path) -> list[float]:
    losses = []
    for index, batch in enumerate(batches[start:], start):
        losses.append(float(cohort.forward_backward(batch, index)))
        state["optimizer"].step()
        state["optimizer"].zero_grad()
        if index + 1 == SAVE_AT and start == 0:
            cohort.save(out / "pipeline_cohort.ckpt", state)
    return losses


def whole_weights(cohort: phalanx.Cohort, model: Any) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for part in cohort.strategy.all_gather_object({name: value.clone() for name, value in model.state_dict().items()}):
        weights.update(part)
    return weights


def run_pipeline(out: Path) -> dict[str, Any]:
    """The loop, saved at SAVE_AT and loaded back at the end to run the rest again; rank 0 writes OUT/pipeline.pt."""
    strategy = ModelParallelStrategy(pipeline_parallel_size=2, pipeline_schedule="1F1B", microbatches=4)
    cohort = phalanx.Cohort(accelerator="cpu", devices=2, strategy=strategy)
    cohort.launch()
    phalanx.seed_everything(1)
    module = MeshNet()
    # Made before setup, over the whole model: setup keeps this rank's stage's parameters.
    model, optimizer = cohort.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    state = {"model": model, "optimizer": optimizer}
    batches = list(cohort.setup_dataloaders(loader(8)))
    losses = steps(cohort, state, batches, 0, out)
    weights = whole_weights(cohort, model)
    predictions = model.predict_step(batches[0], 0)  # the whole pipeline, forward only, on every rank
    try:
        cohort.backward(sum(p.sum() for p in model.parameters()))
        refusal = None
    except RuntimeError as error:
        refusal = str(error)
    cohort.load(out / "pipeline_cohort.ckpt", state)  # back to the save: the rest of the run again
    resumed = steps(cohort, state, batches, SAVE_AT, out)
    resumed_weights = whole_weights(cohort, model)
    if cohort.is_global_zero:
        torch.save({"weights": weights, "resumed": resumed_weights, "predictions": predictions}, out / "pipeline.pt")
    return {
        "losses": cohort.strategy.all_gather_object(losses),
        "resumed": cohort.strategy.all_gather_object(resumed),
        "refusal": refusal,
        "held": cohort.strategy.all_gather_object(sum(p.numel() for p in model.parameters())),
        "steps": cohort.global_step,
        "docs_example": run_docs_example(out),
    }


def run_docs_example(out: Path) -> list[float]:
    """Run the Cohort example of docs/pipeline.md as a script would (its asserts check it) in ``out``; its losses."""
    text = EXAMPLE.read_text().split("## The Cohort", 1)[1]
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, Any] = {"__name__": "__main__"}
    here = os.getcwd()
    os.chdir(out)  # the example saves into the working directory
    try:
        exec(compile(code, f"{EXAMPLE}:Cohort example", "exec"), namespace)
    finally:
        os.chdir(here)
    return namespace["losses"]
