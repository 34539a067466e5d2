"""One benchmark run in its own process: the hand-written loop, phalanx or Lightning on a GPT of ``model.py``.

Started by ``run.py`` as ``python bench/gpu/worker.py SPEC_JSON``; prints one line ``RESULT {json}`` (rank 0 only).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

import torch

# The script's folder is on sys.path: meter.py and model.py import as top-level modules.
from meter import Meter, card_name
from model import SHAPES, Shape, batches, build, next_token_loss, parameter_count

LR = 3e-4


def adamw(parameters: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(parameters, lr=LR, fused=True)


def run_loop(spec: dict, shape: Shape, device: torch.device, meter: Meter) -> None:
    """The hand-written loop: autocast to bfloat16, backward, fused AdamW; compiled whole (the loss outside, as
    ``torch.compile(model)`` users write it) or per block when asked."""
    torch.manual_seed(0)
    model = build(shape).to(device)
    if spec["unit"] == "model":
        model.compile()
    elif spec["unit"] == "blocks":
        for block in model.blocks:
            block.compile()
    optimizer = adamw(model.parameters())
    for index, batch in enumerate(batches(shape, device, meter.total_steps)):
        meter.step_start(index)
        batch = batch.to(device, non_blocking=True)  # the independent shape's batches come from a CPU DataLoader
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = next_token_loss(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        meter.step_end(index)


def _module_class(base: type) -> type:
    """The GPT as a phalanx or Lightning module (same code: both call the same hooks)."""

    class GPTModule(base):  # type: ignore[misc, valid-type]
        def __init__(self, shape: Shape, log_loss: bool) -> None:
            super().__init__()
            self.model = build(shape)
            self.log_loss = log_loss

        def configure_model(self) -> None:
            mesh = getattr(self, "device_mesh", None)
            if mesh is None or mesh.mesh_dim_names != ("data_parallel", "tensor_parallel"):
                return  # only model_parallel leaves the parallelisation to the module
            from torch.distributed.fsdp import fully_shard

            for block in self.model.blocks:
                fully_shard(block, mesh=mesh["data_parallel"])
            fully_shard(self.model, mesh=mesh["data_parallel"])

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = next_token_loss(self.model, batch)
            if self.log_loss:
                self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self) -> Any:
            return adamw(self.parameters())

    return GPTModule


def _meter_callback(base: type, meter: Meter) -> Any:
    class MeterCallback(base):  # type: ignore[misc, valid-type]
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            meter.step_start(batch_idx)

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            meter.step_end(batch_idx)

    return MeterCallback()


def _trainer_options(spec: dict, meter: Meter, root: str) -> dict[str, Any]:
    options: dict[str, Any] = dict(
        accelerator="gpu" if spec["device"] == "cuda" else "cpu",
        devices=spec["devices"],
        precision="bf16-mixed",
        max_steps=meter.total_steps,
        max_epochs=1,
        num_sanity_val_steps=0,
        enable_model_summary=False,
        default_root_dir=root,
    )
    if spec["strategy"] != "single_device":
        options["strategy"] = spec["strategy"]
    if not spec["defaults"]:
        options.update(logger=False, enable_progress_bar=False, enable_checkpointing=False)
    return options


def run_framework(spec: dict, shape: Shape, device: torch.device, meter: Meter) -> str | None:
    """phalanx or Lightning; returns a reason when the run is not supported here (e.g. no ``compile=`` argument)."""
    if spec["kind"] == "lightning":
        import lightning.pytorch as framework
    else:
        import phalanx as framework
    torch.manual_seed(0)
    module = _module_class(framework.LightningModule if spec["kind"] == "lightning" else framework.TrainingModule)
    model = module(shape, log_loss=spec["defaults"])
    with tempfile.TemporaryDirectory() as root:
        options = _trainer_options(spec, meter, root)
        if spec["compiled"]:
            options["compile"] = True
        try:
            trainer = framework.Trainer(callbacks=[_meter_callback(framework.Callback, meter)], **options)
        except TypeError as error:
            if spec["compiled"] and "compile" in str(error):
                return f"Trainer(compile=True) is not supported by this version: {error}"
            raise
        # A distributed sampler deals each of the devices an equal share: every rank gets total_steps batches.
        trainer.fit(model, batches(shape, device, meter.total_steps * spec["devices"]))
    return None


def main(spec: dict) -> None:
    full, tiny = SHAPES[spec["shape"]]
    shape = tiny if spec["tiny"] else full
    rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    device = torch.device("cuda", rank) if spec["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    meter = Meter(device, spec["warmup"], spec["steps"], spec["profile_steps"])
    unsupported = None
    if spec["kind"] == "loop":
        run_loop(spec, shape, device, meter)
    else:
        unsupported = run_framework(spec, shape, device, meter)
    if rank != 0:
        return
    result: dict[str, Any] = {**spec, "card": card_name(device), "torch": torch.__version__}
    if unsupported:
        result.update(status="unsupported", reason=unsupported)
    else:
        with torch.device("meta"):
            parameters = parameter_count(build(shape))
        tokens = shape.batch * shape.context * spec["devices"]
        result.update(status="ok", parameters=parameters, **meter.figures(tokens, parameters, spec["devices"]))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
