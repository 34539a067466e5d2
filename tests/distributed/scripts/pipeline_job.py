"""Every pipeline case of ``pipeline_common.CASES`` on 2 CPU processes (gloo), pipeline_parallel_size=2, for
tests/distributed/test_pipeline_processes.py: losses, logged metrics, each rank's parameter bytes, the whole model's
weights (both stages' state dicts together) and the predictions.

Usage: python pipeline_job.py OUT   (phalanx starts the other process itself)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from pipeline_common import CASES, fit_for_checkpoint, loader, run_case

from phalanx.strategies import ModelParallelStrategy

OUT = Path(sys.argv[1])
EXAMPLE = Path(__file__).parents[3] / "docs" / "pipeline.md"


def run_docs_example() -> list[float]:
    """Run the example's block as a script would (its asserts check it); its losses."""
    text = EXAMPLE.read_text().split("## A full example", 1)[1]
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(code, f"{EXAMPLE}:full example", "exec"), namespace)
    return namespace["model"].losses


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, (schedule, _) in CASES.items():
        strategy = ModelParallelStrategy(pipeline_parallel_size=2, pipeline_schedule=schedule, microbatches=4)
        trainer, module = run_case(name, strategy, 2, str(OUT / name))
        weights: dict[str, torch.Tensor] = {}
        for part in trainer.strategy.all_gather_object(module.state_dict()):
            weights.update(part)
        predictions = trainer.predict(module, loader()) if name == "defaults_1F1B" else None
        metrics = {key: float(value) for key, value in trainer.callback_metrics.items()}
        local_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        results[name] = {
            "losses": trainer.strategy.all_gather_object(module.losses),
            "hooks": trainer.strategy.all_gather_object(module.hooks),
            "metrics": trainer.strategy.all_gather_object(metrics),
            "bytes": trainer.strategy.all_gather_object(local_bytes),
            "stages": trainer.strategy.all_gather_object(list(trainer.strategy.pipeline_stages)),
            "log_dir": trainer.log_dir,
            "validation": trainer.strategy.all_gather_object(module.validation_losses),
            # What was on: the default logger, progress bar, checkpoint folder and sanity check (defaults_1F1B).
            "defaults": [
                type(trainer.logger).__name__,
                type(trainer.progress_bar_callback).__name__,
                trainer.checkpoint_callback.dirpath if trainer.checkpoint_callback else None,
                trainer.num_sanity_val_steps,
            ],
        }
        if trainer.is_global_zero:
            torch.save(weights, OUT / f"{name}.pt")
            if predictions is not None:
                torch.save(torch.cat(predictions), OUT / f"{name}_predictions.pt")
    # A sharded checkpoint after one epoch of a pipeline (AdamW: a state per parameter), resumed by the test on one
    # process under other strategies and consolidated into one file.
    strategy = ModelParallelStrategy(pipeline_parallel_size=2, pipeline_schedule="Interleaved1F1B", microbatches=4)
    trainer, _ = fit_for_checkpoint(strategy, 2, str(OUT / "checkpoint"), epochs=1)
    trainer.save_checkpoint(OUT / "pipeline.ckpt")
    # The full example of docs/pipeline.md, in these processes rather than a launch of its own (CI time).
    results["docs_example"] = run_docs_example()
    if trainer.is_global_zero:
        (OUT / "results.json").write_text(json.dumps(results))
