"""Putting the predictions of several ranks back in dataset order, batched as one process would have batched them.

Each rank predicts its own shard of the data (see :mod:`phalanx.data.distributed`);
:func:`batch_indices` says which dataset indices each of its batches held, and :func:`reassemble_predictions` splits
every output into samples, sorts them by index and cuts them into batches again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from phalanx.utilities.checks import is_int_at_least


def batch_indices(dataloader: DataLoader) -> list[list[int]]:
    """The dataset indices of each batch ``dataloader`` yields this epoch, in order, computed without loading data.

    Iterates the loader's batch sampler (or its sampler, one index per "batch", when automatic batching is off) once.
    It matches what iterating the DataLoader yields when the sampler is deterministic for its current epoch, as
    ``DistributedSampler``, :class:`UnrepeatedDistributedSampler` and :class:`DistributedSamplerWrapper` are (call
    ``set_epoch`` first if needed); a ``RandomSampler`` without a seeded generator draws anew on each iteration and
    will not match. A loader with ``num_workers > 0`` and ``in_order=False`` may yield batches out of this order.
    """
    if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
        raise ValueError(
            "batch_indices needs a DataLoader over a map-style dataset; an iterable dataset has no indices."
        )
    if dataloader.batch_sampler is None:
        return [[int(index)] for index in dataloader.sampler]
    return [[int(index) for index in batch] for batch in dataloader.batch_sampler]


_PER_SAMPLE_HINT = (
    "To be put back in dataset order under a distributed strategy, predict_step must return one entry per sample: a "
    "tensor whose first dimension is the batch size, a list/tuple with one element per sample, or a dict/tuple/list "
    "of those."
)


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_has_tensor(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(item) for item in value)
    return False


def _splittable(value: Any, size: int) -> bool:
    """Whether ``value`` can be read as a batch of ``size`` samples leaf by leaf (tensors along dim 0, None as is)."""
    if value is None:
        return True
    if isinstance(value, torch.Tensor):
        return value.dim() >= 1 and value.shape[0] == size
    if isinstance(value, Mapping):
        return all(_splittable(item, size) for item in value.values())
    if isinstance(value, (list, tuple)):
        return all(_splittable(item, size) for item in value) or len(value) == size
    return False


def _rebuild(like: Any, items: list[Any]) -> Any:
    if isinstance(like, tuple) and hasattr(like, "_fields"):  # namedtuple
        return type(like)(*items)
    try:
        return type(like)(items)
    except TypeError:
        return list(items) if isinstance(like, list) else tuple(items)


def _regroup(
    outputs: list[Any], sizes: list[int], order: list[int], bounds: list[tuple[int, int]], where: str
) -> list[Any]:
    """Batch outputs (same structure, batch ``i`` holding ``sizes[i]`` samples) -> one output per new batch in
    ``bounds``.

    Samples are concatenated in the given batch order, permuted by ``order`` and cut at ``bounds``.
    """
    first = outputs[0]
    if all(output is None for output in outputs):
        return [None] * len(bounds)
    if isinstance(first, torch.Tensor):
        return _regroup_tensors(outputs, sizes, order, bounds, where)
    if isinstance(first, Mapping):
        return _regroup_mappings(outputs, sizes, order, bounds, where)
    if isinstance(first, (list, tuple)):
        regrouped = _regroup_sequences(outputs, sizes, order, bounds, where)
        if regrouped is not None:
            return regrouped
    raise ValueError(
        f"A predict output{where} of type {type(first).__name__} has no per-sample first dimension. {_PER_SAMPLE_HINT}"
    )


def _regroup_tensors(
    outputs: list[Any], sizes: list[int], order: list[int], bounds: list[tuple[int, int]], where: str
) -> list[Any]:
    if not all(
        isinstance(output, torch.Tensor) and output.dim() >= 1 and output.shape[0] == size
        for output, size in zip(outputs, sizes)
    ):
        raise ValueError(
            f"A predict output{where} is not a tensor with one row per sample in every batch. {_PER_SAMPLE_HINT}"
        )
    try:
        flat = torch.cat(outputs)
    except RuntimeError as error:
        raise ValueError(f"The predict outputs{where} cannot be concatenated along dim 0: {error}") from error
    flat = flat[torch.tensor(order, dtype=torch.long, device=flat.device)]
    return [flat[start:stop] for start, stop in bounds]


def _regroup_mappings(
    outputs: list[Any], sizes: list[int], order: list[int], bounds: list[tuple[int, int]], where: str
) -> list[Any]:
    first = outputs[0]
    keys = list(first.keys())
    if not all(isinstance(output, Mapping) and list(output.keys()) == keys for output in outputs):
        raise ValueError(f"The predict outputs{where} are dicts with different keys in different batches.")
    per_key = {
        key: _regroup([output[key] for output in outputs], sizes, order, bounds, f"{where}[{key!r}]") for key in keys
    }
    regrouped = []
    for batch in range(len(bounds)):
        items = {key: per_key[key][batch] for key in keys}
        try:
            regrouped.append(type(first)(items))
        except TypeError:
            regrouped.append(items)
    return regrouped


def _regroup_sequences(
    outputs: list[Any], sizes: list[int], order: list[int], bounds: list[tuple[int, int]], where: str
) -> list[Any] | None:
    """Lists/tuples regrouped as containers or as one entry per sample; None when they are neither."""
    first = outputs[0]
    if not all(isinstance(output, (list, tuple)) for output in outputs):
        raise ValueError(f"The predict outputs{where} change type between batches. {_PER_SAMPLE_HINT}")
    # A list/tuple is either a container (its elements are batches: tensors with one row per sample, ...) or one
    # entry per sample. The reading must be the same for every batch; a container holding tensors wins a tie.
    container = all(
        len(output) == len(first) and all(_splittable(item, size) for item in output)
        for output, size in zip(outputs, sizes)
    )
    per_sample = all(len(output) == size for output, size in zip(outputs, sizes))
    if container and (not per_sample or any(_has_tensor(output) for output in outputs)):
        columns = [
            _regroup([output[position] for output in outputs], sizes, order, bounds, f"{where}[{position}]")
            for position in range(len(first))
        ]
        return [_rebuild(first, [column[batch] for column in columns]) for batch in range(len(bounds))]
    if per_sample:
        flat_items = [item for output in outputs for item in output]
        ordered = [flat_items[position] for position in order]
        return [_rebuild(first, ordered[start:stop]) for start, stop in bounds]
    return None


def reassemble_predictions(
    per_rank: list[list[tuple[list[int], Any]]], batch_size: int | None, drop_repeats: bool = False
) -> list[Any]:
    """Put the predictions of all ranks back in dataset order, batched as a single process would have batched them.

    ``per_rank[r]`` is rank ``r``'s list of ``(indices of the batch, predict_step output for that batch)``. Every output
    is split into samples (tensors along dim 0, per-sample lists/tuples element by element, dicts/tuples/lists of those
    leaf by leaf, ``None`` stays ``None``), samples are sorted by dataset index (stable, so an index drawn twice keeps
    both predictions, lower rank first), and cut into batches of ``batch_size`` (the largest batch seen when ``None``).
    Containers keep their type. ``drop_repeats=True`` keeps only the first prediction of an index (the padding
    of a padded sampler). Raises ``ValueError`` for an output without one entry per sample, such as a float per
    batch.

    With :class:`UnrepeatedDistributedSampler` over a sequential sampler this reproduces exactly the single-process
    list of outputs (the last batch short when the dataset does not divide); a loader with ``drop_last=True`` drops
    different samples per rank, so its results cannot match a single process.
    """
    if batch_size is not None and not is_int_at_least(batch_size, 1):
        raise ValueError(f"batch_size={batch_size!r} must be a positive int or None.")
    indices: list[int] = []
    outputs: list[Any] = []
    sizes: list[int] = []
    for rank_batches in per_rank:
        for batch_index_list, output in rank_batches:
            batch_index_list = [int(index) for index in batch_index_list]
            if not batch_index_list:
                continue
            indices.extend(batch_index_list)
            outputs.append(output)
            sizes.append(len(batch_index_list))
    if not outputs:
        return []
    size = batch_size if batch_size is not None else max(sizes)
    order = sorted(range(len(indices)), key=indices.__getitem__)
    if drop_repeats:
        seen: set[int] = set()
        order = [position for position in order if not (indices[position] in seen or seen.add(indices[position]))]
    bounds = [(start, min(start + size, len(order))) for start in range(0, len(order), size)]
    return _regroup(outputs, sizes, order, bounds, "")


__all__ = ["batch_indices", "reassemble_predictions"]
