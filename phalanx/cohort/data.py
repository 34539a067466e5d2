"""The data half of a Cohort: ``setup_dataloaders`` gives each rank its share of the data, on its device."""

from __future__ import annotations

from typing import Any, Callable

from phalanx.cohort.wrappers import CohortDataLoader
from phalanx.strategies.strategy import Strategy


class CohortData:
    """``setup_dataloaders``: samplers split (and seeded) as the Trainer's, batches moved to the strategy's device."""

    _strategy: Strategy
    _ensure_environment: Callable[[], None]

    def setup_dataloaders(
        self, *dataloaders: Any, use_distributed_sampler: bool = True, move_to_device: bool = True
    ) -> Any:
        """Give each dataloader this rank's share of the data (a DistributedSampler) and batches on ``device``."""
        if not dataloaders:
            raise ValueError("Cohort.setup_dataloaders needs at least one dataloader.")
        self._ensure_environment()
        prepared = [self._setup_dataloader(loader, use_distributed_sampler, move_to_device) for loader in dataloaders]
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def _setup_dataloader(
        self, dataloader: Any, use_distributed_sampler: bool, move_to_device: bool
    ) -> CohortDataLoader:
        import os

        if not hasattr(dataloader, "__iter__"):
            raise TypeError(
                f"Cohort.setup_dataloaders takes iterables of batches (DataLoaders), got {type(dataloader).__name__}."
            )
        sampler_kwargs = self._strategy.distributed_sampler_kwargs
        if use_distributed_sampler and sampler_kwargs:
            from phalanx.trainer.distributed_data import distributed_dataloader

            # The seed the Trainer uses too, so that both shuffle the same way.
            seed = int(os.environ.get("PHALANX_GLOBAL_SEED", "0"))
            dataloader = distributed_dataloader(dataloader, training=True, seed=seed, **sampler_kwargs)
        dataloader = self._strategy.process_dataloader(dataloader)
        return CohortDataLoader(dataloader, self._strategy if move_to_device else None)
