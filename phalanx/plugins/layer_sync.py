"""LayerSync: swapping layers for their synchronised versions while training with several processes."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn


class LayerSync(ABC):
    """Converts a model's layers to synchronised versions and back."""

    @abstractmethod
    def apply(self, model: nn.Module) -> nn.Module:
        """Return ``model`` with its layers synchronised across processes."""

    @abstractmethod
    def revert(self, model: nn.Module) -> nn.Module:
        """Undo ``apply``."""


class _BatchNormXd(nn.modules.batchnorm._BatchNorm):
    """A BatchNorm that accepts any input rank: SyncBatchNorm does not record which of 1d/2d/3d it replaced."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        return


class TorchSyncBatchNorm(LayerSync):
    """Replaces every BatchNorm with ``torch.nn.SyncBatchNorm`` (statistics computed over all processes)."""

    def apply(self, model: nn.Module) -> nn.Module:
        """Convert BatchNorm layers to SyncBatchNorm."""
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)

    def revert(self, model: nn.Module) -> nn.Module:
        """Convert SyncBatchNorm layers back to plain batch norms, keeping weights and running statistics."""
        converted = model
        if isinstance(model, nn.SyncBatchNorm):
            converted = _BatchNormXd(
                model.num_features, model.eps, model.momentum, model.affine, model.track_running_stats
            )
            if model.affine:
                with torch.no_grad():
                    converted.weight = model.weight
                    converted.bias = model.bias
            converted.running_mean = model.running_mean
            converted.running_var = model.running_var
            converted.num_batches_tracked = model.num_batches_tracked
            converted.training = model.training
        for name, child in model.named_children():
            converted.add_module(name, self.revert(child))
        return converted
