"""Issue 37's model fitted eagerly, then compiled (inductor), with one strategy under 'bf16-mixed'; rank 0 saves both
runs' full weights, the initial ones and what was compiled to OUT.pt.

Usage: python gpu_compile_fit.py OUT.pt STRATEGY DEVICES HOW [ACCELERATOR]   (HOW: "argument" for
``Trainer(compile=True)``, "precompiled" for ``fit(torch.compile(model))``; run by tests/gpu/test_cuda_compile.py.
ACCELERATOR defaults to cuda; cpu runs the same job on gloo to check the script without a GPU.)
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from phalanx_compile import GPTModule, token_data

import phalanx
from phalanx.strategies import ModelParallelStrategy
from phalanx.utilities.dtensor import full_module_state, has_dtensors

STEPS, LAYERS = 6, 3


class SGDModule(GPTModule):
    """SGD rather than AdamW: its updates scale with the gradients, so compiled and eager updates compare closely
    (Adam's normalised updates turn bfloat16 rounding of near-zero gradients into whole learning-rate steps)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def full_weights(trainer: phalanx.Trainer) -> dict[str, torch.Tensor]:
    module = trainer.strategy.module
    state = full_module_state(module, keep=True) if has_dtensors(module) else trainer.strategy.module_state_dict()
    return {key: value.detach().float().cpu().clone() for key, value in state.items()}


def compiled_names(module: torch.nn.Module) -> list[str]:
    names = [name for name, child in module.named_modules() if child._compiled_call_impl is not None]
    return names + (["<forward>"] if "forward" in module.__dict__ else [])


def fit(strategy: str, devices: int, accelerator: str, compiled: str | None) -> tuple[phalanx.Trainer, Any]:
    torch._dynamo.reset()
    phalanx.seed_everything(0)
    module = SGDModule(LAYERS)
    model: Any = torch.compile(module) if compiled == "precompiled" else module
    trainer = phalanx.Trainer(
        accelerator=accelerator,
        strategy=ModelParallelStrategy(devices, 1) if strategy == "model_parallel" else strategy,
        devices=devices,
        precision="bf16-mixed",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        compile=compiled == "argument" or None,
    )
    trainer.fit(model, token_data(STEPS * devices, 4))
    return trainer, module


def main() -> None:
    out, strategy, devices, how = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    accelerator = sys.argv[5] if len(sys.argv) > 5 else "cuda"
    phalanx.seed_everything(0)
    initial = {key: value.float().clone() for key, value in SGDModule(LAYERS).state_dict().items()}
    eager, _ = fit(strategy, devices, accelerator, None)
    eager_weights = full_weights(eager)
    compiled, module = fit(strategy, devices, accelerator, how)
    result = {
        "initial": initial,
        "eager": eager_weights,
        "compiled": full_weights(compiled),
        "compiled_modules": compiled_names(module),
        "steps": compiled.global_step,
        "device": next(module.parameters()).device.type,
    }
    if compiled.global_rank == 0:
        torch.save(result, out)


if __name__ == "__main__":
    main()
