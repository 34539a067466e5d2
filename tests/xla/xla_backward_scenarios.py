"""An XLA fit in a process whose autograd engine already ran a backward pass elsewhere: one fresh process each.

``python xla_backward_scenarios.py NAME`` first runs what NAME says on the CPU (nothing, a plain PyTorch backward pass,
or a phalanx fit) before torch_xla is imported, then fits the same model with ``single_xla``, automatically and
manually optimized, and prints ``RESULT <json>``: the weights' distance to a CPU fit and the autograd setting seen.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import phalanx


class Net(phalanx.TrainingModule):
    def __init__(self, manual: bool) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.net = torch.nn.Linear(4, 1)
        self.automatic_optimization = not manual
        self.multithreaded: list[bool] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.multithreaded.append(torch._C._is_multithreading_enabled())
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return None

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(accelerator: str, manual: bool) -> Net:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=generator)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)
    options = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = Net(manual)
    phalanx.Trainer(accelerator=accelerator, devices=1, max_epochs=2, **options).fit(module, data)
    return module


def main(name: str) -> None:
    cpu = {manual: fit("cpu", manual) for manual in (False, True)} if name == "phalanx_cpu_fit" else {}
    if name == "plain_cpu_backward":
        (torch.ones(2, requires_grad=True) * 2).sum().backward()
    import torch_xla  # noqa: F401 - only now, as a program that turns to XLA after CPU work would

    result: dict[str, Any] = {}
    for manual in (False, True):
        xla = fit("xla", manual)
        reference = cpu.get(manual) or fit("cpu", manual)
        weights = zip(xla.state_dict().values(), reference.state_dict().values())
        kind = "manual" if manual else "automatic"
        result[f"{kind}_diff"] = max((a.cpu() - b).abs().max().item() for a, b in weights)
        result[f"{kind}_multithreaded"] = sorted(set(xla.multithreaded))
        result[f"{kind}_steps"] = len(xla.multithreaded)
    result["multithreaded_after"] = torch._C._is_multithreading_enabled()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
