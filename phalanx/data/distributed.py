"""Sharding dataloaders across ranks (:mod:`phalanx.trainer.loops.prediction_order` puts distributed predictions back in
dataset order).

Everything here is pure and single-process: a sampler is told its ``num_replicas`` and ``rank`` (or reads them from an
initialised ``torch.distributed`` group when they are left out), so each rank's share can be computed and tested
without starting processes.

Policy (:func:`distributed_dataloader`, called by the Trainer when ``use_distributed_sampler=True``):

- training shards with padding, so every rank runs the same number of batches (DDP's collectives need that);
- validation, test and predict shard *without* padding (:class:`UnrepeatedDistributedSampler`), so no sample is
  evaluated twice and metrics and predictions are exact; ranks may then differ by one sample;
- a user's own sampler (``WeightedRandomSampler``, a length-bucketing sampler, ...) keeps deciding *which* indices come
  in *which* order; :class:`DistributedSamplerWrapper` only splits that order between ranks.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

_FIX_HINT = (
    "Pass `use_distributed_sampler=False` to the Trainer and shard the data yourself, e.g. build the DataLoader with "
    "`sampler=torch.utils.data.DistributedSampler(dataset)` (or a batch sampler that yields only this rank's batches)."
)


def _epoch_order(length: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The index order of one epoch: the permutation ``torch.utils.data.DistributedSampler`` draws for seed+epoch."""
    if not shuffle:
        return list(range(length))
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(length, generator=generator).tolist()


def _rank_count(length: int, num_replicas: int, rank: int) -> int:
    """How many of ``length`` items land on ``rank`` when dealt round-robin without padding."""
    return len(range(rank, length, num_replicas))


def _resolve_replicas(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    if num_replicas is None or rank is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("Pass `num_replicas` and `rank`, or initialise torch.distributed first.")
        num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        rank = dist.get_rank() if rank is None else rank
    if num_replicas < 1:
        raise ValueError(f"num_replicas={num_replicas} must be >= 1.")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank={rank} must be in [0, {num_replicas - 1}] for num_replicas={num_replicas}.")
    return num_replicas, rank


class UnrepeatedDistributedSampler(Sampler[int]):
    """Deal a map-style dataset's indices round-robin across ranks, every index exactly once (no padding).

    Same constructor and same shuffle as ``torch.utils.data.DistributedSampler`` (a permutation seeded with
    ``seed + epoch``, so all ranks agree), but rank ``r`` gets ``order[r::num_replicas]`` of the whole order: the union
    over ranks is exactly the dataset, and ``len()`` may differ by one between ranks. Meant for validation, test and
    predict, where padded duplicates would bias metrics; do not use it for training under DDP, where unequal batch
    counts make ranks wait on each other forever.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if drop_last:
            raise ValueError(
                "UnrepeatedDistributedSampler never pads nor drops samples; use DistributedSampler for drop_last=True."
            )
        self.num_replicas, self.rank = _resolve_replicas(num_replicas, rank)
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = False
        self.epoch = 0

    @property
    def num_samples(self) -> int:
        """This rank's number of indices."""
        return _rank_count(len(self.dataset), self.num_replicas, self.rank)

    @property
    def total_size(self) -> int:
        """The number of indices over all ranks: the dataset's length."""
        return len(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch, which with ``seed`` decides the shuffle; call it on every rank with the same value."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        order = _epoch_order(len(self.dataset), self.shuffle, self.seed, self.epoch)
        return iter(order[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


class _Positions(Sequence[int]):
    """A stand-in dataset of ``length`` positions, so DistributedSampler's partition can deal positions of a list."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, position: Any) -> Any:
        return range(self.length)[position]


class DistributedSamplerWrapper(DistributedSampler):
    """Split the indices an arbitrary sampler yields between ranks.

    Each epoch the inner ``sampler`` is iterated once, in full, on every rank, and the resulting list of indices is
    dealt round-robin like ``DistributedSampler`` deals a dataset: with padding when ``repeat=True`` (training, equal
    batch counts on every rank; ``drop_last=True`` trims instead of padding), without padding when ``repeat=False``
    (evaluation, every drawn index exactly once).

    Ranks must draw the same inner order. When the inner sampler has a ``generator`` attribute (``RandomSampler``,
    ``WeightedRandomSampler``, ``SubsetRandomSampler``, ...), it is set, for that one iteration, to a
    ``torch.Generator`` seeded with ``seed + epoch`` and then restored, so the draw depends only on ``seed`` and the
    epoch passed to :meth:`set_epoch`. Any other inner sampler must be deterministic on its own (the same order on
    every rank for the same epoch); otherwise samples are duplicated or skipped across ranks.

    ``shuffle`` (default ``False``) additionally permutes the drawn positions before dealing them; it is off by default
    because the inner sampler already decides the order.
    """

    def __init__(
        self,
        sampler: Sampler[int],
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        repeat: bool = True,
    ) -> None:
        if not isinstance(sampler, Sized):
            raise ValueError(f"Cannot distribute {type(sampler).__name__}: it has no length. {_FIX_HINT}")
        if not repeat and drop_last:
            raise ValueError(
                "repeat=False deals every drawn index exactly once; it cannot be combined with drop_last=True."
            )
        num_replicas, rank = _resolve_replicas(num_replicas, rank)
        super().__init__(
            _Positions(len(sampler)),
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.sampler = sampler
        self.repeat = repeat
        if not repeat:
            self.num_samples = _rank_count(len(sampler), num_replicas, rank)
            self.total_size = len(sampler)

    def _inner_indices(self) -> list[int]:
        if not hasattr(self.sampler, "generator"):
            return list(self.sampler)
        original = self.sampler.generator
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        self.sampler.generator = generator
        try:
            return list(self.sampler)
        finally:
            self.sampler.generator = original

    def __iter__(self) -> Iterator[int]:
        indices = self._inner_indices()
        if len(indices) != len(self.dataset):
            raise RuntimeError(
                f"{type(self.sampler).__name__} yielded {len(indices)} indices but its length was {len(self.dataset)} "
                "when the DistributedSamplerWrapper was built; a wrapped sampler must keep its length."
            )
        if self.repeat:
            positions: Any = super().__iter__()
        else:
            positions = _epoch_order(len(indices), self.shuffle, self.seed, self.epoch)[self.rank :: self.num_replicas]
        return iter([indices[position] for position in positions])


def _sampling(dataloader: DataLoader) -> tuple[Any, int | None, bool]:
    """The sample-level sampler, batch size and drop_last a DataLoader effectively uses.

    A plain ``BatchSampler`` (built by the DataLoader from ``batch_size``, or passed by the user) is unpacked into its
    parts; any other ``batch_sampler`` cannot be redistributed and raises.
    """
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is None:  # automatic batching off (batch_size=None): the sampler yields one sample at a time
        return dataloader.sampler, None, False
    if type(batch_sampler) is BatchSampler:
        return batch_sampler.sampler, batch_sampler.batch_size, batch_sampler.drop_last
    raise ValueError(
        f"The DataLoader uses a custom batch_sampler ({type(batch_sampler).__name__}); phalanx cannot distribute it "
        f"across processes. {_FIX_HINT}"
    )


def _dataloader_parameters() -> set[str]:
    return set(inspect.signature(DataLoader.__init__).parameters)


def with_sampler(dataloader: DataLoader, sampler: Sampler | Any) -> DataLoader:
    """A new DataLoader like ``dataloader`` in every setting, but drawing samples from ``sampler``.

    Batching is kept: the new loader batches ``sampler``'s indices with the original batch size and drop_last (a plain
    ``BatchSampler`` the user passed is turned into those two settings). A DataLoader over an ``IterableDataset`` has
    no sampler to replace and is returned unchanged. A DataLoader subclass is rebuilt as
    ``type(dataloader)(**settings)``; one whose ``__init__`` does not accept the DataLoader arguments raises a
    ``ValueError`` that says how to shard the data yourself, and so does a custom ``batch_sampler``.
    """
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"with_sampler needs a torch DataLoader, got {type(dataloader).__name__}.")
    if isinstance(dataloader.dataset, IterableDataset):
        return dataloader
    _, batch_size, drop_last = _sampling(dataloader)
    return _rebuild(
        dataloader, {"batch_size": batch_size, "sampler": sampler, "drop_last": drop_last}, "a distributed sampler"
    )


def with_batch_sampler(dataloader: DataLoader, batch_sampler: Sampler | Any) -> DataLoader:
    """A new DataLoader like ``dataloader`` in every setting, but drawing its batches' indices from ``batch_sampler``
    (which replaces the batch size, sampler and drop_last). Raises as :func:`with_sampler` does."""
    if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
        raise TypeError(f"with_batch_sampler needs a torch DataLoader over a map-style dataset, got {dataloader!r}.")
    return _rebuild(dataloader, {"batch_sampler": batch_sampler}, "a batch sampler of its own")


def _rebuild(dataloader: DataLoader, sampling: dict[str, Any], what: str) -> DataLoader:
    """``type(dataloader)`` made anew with ``dataloader``'s settings and the ``sampling`` arguments."""
    settings: dict[str, Any] = {
        "dataset": dataloader.dataset,
        **sampling,
        "num_workers": dataloader.num_workers,
        "collate_fn": dataloader.collate_fn,
        "pin_memory": dataloader.pin_memory,
        "timeout": dataloader.timeout,
        "worker_init_fn": dataloader.worker_init_fn,
        "multiprocessing_context": dataloader.multiprocessing_context,
        "generator": dataloader.generator,
        "persistent_workers": dataloader.persistent_workers,
    }
    if dataloader.num_workers > 0:  # DataLoader rejects a prefetch_factor without workers
        settings["prefetch_factor"] = dataloader.prefetch_factor
    available = _dataloader_parameters()
    for optional in ("pin_memory_device", "in_order"):  # newer torch arguments
        if optional in available and hasattr(dataloader, optional):
            settings[optional] = getattr(dataloader, optional)
    cls = type(dataloader)
    try:
        return cls(**settings)
    except TypeError as error:
        if cls is DataLoader:
            raise
        raise ValueError(
            f"phalanx could not rebuild your {cls.__name__} with {what}: calling "
            f"{cls.__name__}(**DataLoader arguments) failed with: {error}. Make {cls.__name__}.__init__ accept the "
            f"DataLoader arguments (dataset, batch_size, sampler, ... as keyword arguments), or: {_FIX_HINT}"
        ) from error


def _is_distributed(sampler: Any) -> bool:
    return isinstance(sampler, (DistributedSampler, UnrepeatedDistributedSampler))


def _is_plain_random(sampler: Any) -> bool:
    """A RandomSampler that draws each index once: a permutation, which DistributedSampler(shuffle=True) reproduces."""
    return (
        type(sampler) is RandomSampler and not sampler.replacement and sampler.num_samples == len(sampler.data_source)
    )


def distributed_dataloader(
    dataloader: Any, *, num_replicas: int, rank: int, training: bool, seed: int, pad_evaluation: bool = False
) -> Any:
    """``dataloader`` with its sampler replaced by this rank's share of the data.

    Left unchanged: anything that is not a DataLoader, a DataLoader over an IterableDataset (its dataset must shard
    itself, e.g. with ``torch.utils.data.get_worker_info`` and the rank), and a DataLoader that already samples with a
    ``DistributedSampler`` or :class:`UnrepeatedDistributedSampler`.

    Training (every rank gets the same number of samples):

    - a ``RandomSampler`` (without replacement, full length) becomes ``DistributedSampler(shuffle=True, seed=seed)``;
    - a ``SequentialSampler`` becomes ``DistributedSampler(shuffle=False)``;
    - any other sampler is wrapped in :class:`DistributedSamplerWrapper`.

    The DataLoader's ``drop_last`` is passed on as the DistributedSampler's ``drop_last``. A user who set
    ``drop_last=True`` already accepted losing a few samples per epoch, so the sampler trims the tail to a multiple of
    ``num_replicas`` instead of padding it with duplicates; with ``drop_last=False`` nothing is lost and up to
    ``num_replicas - 1`` samples are repeated. Either way all ranks see equally many samples and hence equally many
    batches, which DDP requires.

    Evaluation (``training=False``): :class:`UnrepeatedDistributedSampler` (``shuffle=False``) for a random or
    sequential sampler, and ``DistributedSamplerWrapper(repeat=False)`` for any other, so every sample is evaluated
    exactly once. With ``pad_evaluation=True`` (strategies whose every forward pass is a collective, such as FSDP and
    tensor parallelism, where ranks must run equally many batches) evaluation is padded like training, without
    shuffling: up to ``num_replicas - 1`` samples are evaluated twice (predictions drop the repeats).

    A custom ``batch_sampler`` raises a ``ValueError`` unless it already draws from a distributed sampler.
    """
    if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
        return dataloader
    if _is_distributed(dataloader.sampler) or _is_distributed(getattr(dataloader.batch_sampler, "sampler", None)):
        return dataloader
    sampler, _, drop_last = _sampling(dataloader)
    dataset = dataloader.dataset
    if training or pad_evaluation:
        if not training:
            sampler = SequentialSampler(dataset) if _is_plain_random(sampler) else sampler
        if _is_plain_random(sampler) or type(sampler) is SequentialSampler:
            new: Sampler = DistributedSampler(
                dataset,
                num_replicas=num_replicas,
                rank=rank,
                shuffle=type(sampler) is RandomSampler,
                seed=seed,
                drop_last=drop_last,
            )
        else:
            new = DistributedSamplerWrapper(
                sampler, num_replicas=num_replicas, rank=rank, seed=seed, drop_last=drop_last
            )
    elif _is_plain_random(sampler) or type(sampler) is SequentialSampler:
        new = UnrepeatedDistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, seed=seed)
    else:
        new = DistributedSamplerWrapper(sampler, num_replicas=num_replicas, rank=rank, seed=seed, repeat=False)
    return with_sampler(dataloader, new)
