"""The small model and data the conformance kit trains: it records every hook the loops call on it, in order."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from phalanx.module import TrainingModule
from phalanx.strategies.parallel_dims import MeshAxis

FEATURES, HIDDEN = 4, 8
SAMPLES_PER_REPLICA, BATCH_SIZE = 8, 2  # four batches per data-parallel rank and epoch

#: Module hooks the kit expects once per run, and once per batch, during a fit (besides ``training_step``).
RUN_HOOKS = (
    "setup",
    "configure_model",
    "configure_optimizers",
    "on_fit_start",
    "on_train_start",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_train_end",
    "on_fit_end",
    "teardown",
)
BATCH_HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
)


def conformance_data(replicas: int) -> DataLoader:
    """A fixed regression set, sized so that every data-parallel rank trains on four batches of two each epoch."""
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES_PER_REPLICA * replicas, FEATURES, generator=generator)
    y = x.sum(dim=1, keepdim=True).tanh() + 0.1 * torch.randn(len(x), 1, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH_SIZE, shuffle=False)


def probe_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch only ranks given the same ``seed`` share (the no-sync check gives each data-parallel rank its own)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH_SIZE, FEATURES, generator=generator)
    return x, torch.randn(BATCH_SIZE, 1, generator=generator)


def make_net() -> nn.Sequential:
    """The plain network (also the single-process reference the no-sync check computes gradients with)."""
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


def loss_of(net: nn.Module, batch: Any) -> torch.Tensor:
    """The training loss of ``batch`` (a pair ``(x, y)``)."""
    x, y = batch
    return nn.functional.mse_loss(net(x), y)


class ConformanceModule(TrainingModule):
    """Two linear layers and Adam; appends each hook's name to ``events`` while ``recording`` is True.

    Under a strategy with a tensor-parallel device mesh (ModelParallelStrategy), ``configure_model`` splits the
    layers column-/row-wise and shards them over the data-parallel dimension, as a user's model would.
    """

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()
        self.events: list[str] = []
        self.recording = True

    def _record(self, name: str) -> None:
        if self.recording:
            self.events.append(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._record("training_step")
        return loss_of(self, batch)

    def train_dataloader(self) -> DataLoader:
        # Asked for once the processes are set up: each data-parallel rank then reads four batches.
        sampler = self.trainer.strategy.distributed_sampler_kwargs or {}
        return conformance_data(int(sampler.get("num_replicas", 1)))

    def configure_optimizers(self) -> Any:
        self._record("configure_optimizers")
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def configure_model(self) -> None:
        self._record("configure_model")
        mesh = self.device_mesh
        if mesh is None or MeshAxis.TENSOR.value not in (mesh.mesh_dim_names or ()):
            return
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tensor, data = mesh[MeshAxis.TENSOR.value], mesh[MeshAxis.DATA.value]
        if tensor.size() > 1:
            parallelize_module(self.net, tensor, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        if data.size() > 1:
            from torch.distributed.fsdp import fully_shard

            fully_shard(self, mesh=data)

    def setup(self, stage: str) -> None:
        self._record("setup")

    def teardown(self, stage: str) -> None:
        self._record("teardown")


def _recording(name: str) -> Any:
    def hook(self: ConformanceModule, *args: Any, **kwargs: Any) -> None:
        self._record(name)

    hook.__name__ = hook.__qualname__ = name
    hook.__doc__ = f"Record that {name} was called."
    return hook


for _name in RUN_HOOKS + BATCH_HOOKS:
    if _name not in ConformanceModule.__dict__:
        setattr(ConformanceModule, _name, _recording(_name))
