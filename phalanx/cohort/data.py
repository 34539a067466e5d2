"""The data half of a Cohort: ``setup_dataloaders`` gives each rank its share of the data, on its device."""

from __future__ import annotations

import weakref
from functools import partial
from typing import Any, Callable

from phalanx.cohort.checkpoint import COHORT_ENTRY
from phalanx.cohort.wrappers import CohortDataLoader
from phalanx.strategies.strategy import Strategy
from phalanx.utilities.seed import sampler_seed, worker_init_fn


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
        # Lazy for import time: `from phalanx import Cohort` does not load phalanx.data.
        from phalanx.data.distributed import distributed_dataloader

        sampler_kwargs = self._strategy.distributed_sampler_kwargs
        # The seed the Trainer uses too, so that both shuffle the same way.
        seed = sampler_seed()
        if use_distributed_sampler and sampler_kwargs:
            dataloader = distributed_dataloader(dataloader, training=True, seed=seed, **sampler_kwargs)
        elif use_distributed_sampler and _shuffles_from_the_global_generator(dataloader):
            # One process: a permutation drawn from the global generator differs after Cohort.load (which restores the
            # generator as it was at the save, mid-epoch), so shuffle as the only replica of a seeded
            # DistributedSampler instead: epoch e's order depends on the seed and e alone, as on DDP, and a resumed
            # loop sees the batches the uninterrupted one saw.
            dataloader = distributed_dataloader(dataloader, num_replicas=1, rank=0, training=True, seed=seed)
        if (
            os.environ.get("PHALANX_SEED_WORKERS") == "1"
            and getattr(dataloader, "num_workers", 0) > 0
            and getattr(dataloader, "worker_init_fn", False) is None
        ):
            # seed_everything(workers=True), as in the Trainer and Fabric: each worker of each rank its own seed.
            dataloader.worker_init_fn = partial(worker_init_fn, rank=self._strategy.global_rank)
        dataloader = self._strategy.process_dataloader(dataloader)
        prepared = CohortDataLoader(dataloader, self._strategy if move_to_device else None)
        epoch = getattr(self, "_loaded_epoch", None)
        if epoch is not None:
            prepared.set_epoch(epoch)
        loaders = self.__dict__.setdefault("_dataloaders", [])
        loaders.append(weakref.ref(prepared))
        return prepared

    def _continue_dataloaders(self, checkpoint: dict[str, Any]) -> None:
        """After ``Cohort.load`` of a Cohort checkpoint: the loaders set up by this Cohort (now or later) iterate the
        saved epoch next, so that its shuffle is the one the uninterrupted run drew (the user may still
        ``set_epoch``)."""
        epoch = checkpoint.get("epoch")
        if COHORT_ENTRY not in checkpoint or isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            return
        self._loaded_epoch = epoch
        for reference in self.__dict__.get("_dataloaders", []):
            loader = reference()
            if loader is not None:
                loader.set_epoch(epoch)


def _shuffles_from_the_global_generator(dataloader: Any) -> bool:
    from torch.utils.data import DataLoader, RandomSampler

    sampler = getattr(dataloader, "sampler", None) if isinstance(dataloader, DataLoader) else None
    # A user's own generator (or sampling with replacement) is left as given: a full permutation is what the seeded
    # sampler reproduces.
    return (
        type(sampler) is RandomSampler
        and sampler.generator is None
        and not sampler.replacement
        and sampler.num_samples == len(sampler.data_source)
    )
