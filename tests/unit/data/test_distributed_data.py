"""Distributed data utilities, with ranks simulated by explicit ``num_replicas``/``rank`` (no processes)."""

from __future__ import annotations

import collections
import multiprocessing
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from phalanx.data.distributed import (
    DistributedSamplerWrapper,
    UnrepeatedDistributedSampler,
    distributed_dataloader,
    with_sampler,
)
from phalanx.trainer.loops.prediction_order import batch_indices, reassemble_predictions


class Indices(Dataset):
    """Sample ``i`` is ``i`` itself, so a batch tells which indices it holds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(5))


class Reversed(Sampler[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self) -> int:
        return self.n


class PairBatches(Sampler[list]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter([[i, i + 1] for i in range(0, self.n - 1, 2)])

    def __len__(self) -> int:
        return self.n // 2


def _collate(batch: list) -> list:
    return batch


def _worker_init(worker_id: int) -> None:
    pass


# ---------------------------------------------------------------- UnrepeatedDistributedSampler


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize(("n", "num_replicas"), [(12, 3), (10, 3), (7, 2), (2, 5), (1, 1), (0, 2)])
def test_unrepeated_covers_every_index_exactly_once(n: int, num_replicas: int, shuffle: bool) -> None:
    samplers = [
        UnrepeatedDistributedSampler(Indices(n), num_replicas=num_replicas, rank=r, shuffle=shuffle, seed=3)
        for r in range(num_replicas)
    ]
    shares = [list(s) for s in samplers]
    assert sorted(i for share in shares for i in share) == list(range(n))
    assert [len(s) for s in samplers] == [len(share) for share in shares]
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    if not shuffle:
        assert shares == [list(range(n))[r::num_replicas] for r in range(num_replicas)]


def test_unrepeated_shuffle_is_torchs_permutation_and_ranks_agree() -> None:
    dataset = Indices(12)  # divisible by 3: DistributedSampler pads nothing, so the shares must be identical
    for epoch in (0, 1, 5):
        ours, theirs = [], []
        for rank in range(3):
            u = UnrepeatedDistributedSampler(dataset, num_replicas=3, rank=rank, shuffle=True, seed=11)
            d = DistributedSampler(dataset, num_replicas=3, rank=rank, shuffle=True, seed=11)
            u.set_epoch(epoch)
            d.set_epoch(epoch)
            ours.append(list(u))
            theirs.append(list(d))
        assert ours == theirs


def test_unrepeated_shuffle_changes_with_epoch_and_repeats_within_it() -> None:
    sampler = UnrepeatedDistributedSampler(Indices(40), num_replicas=2, rank=1, shuffle=True, seed=0)
    first = list(sampler)
    assert list(sampler) == first
    sampler.set_epoch(1)
    second = list(sampler)
    assert second != first
    assert sorted(second) != second  # actually shuffled


def test_unrepeated_rejects_bad_rank_and_drop_last() -> None:
    with pytest.raises(ValueError, match="rank=2"):
        UnrepeatedDistributedSampler(Indices(4), num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="drop_last"):
        UnrepeatedDistributedSampler(Indices(4), num_replicas=2, rank=0, drop_last=True)


# ---------------------------------------------------------------- DistributedSamplerWrapper


def _weighted(n: int = 10) -> WeightedRandomSampler:
    weights = torch.ones(n)
    weights[::3] = 0.0  # indices 0, 3, 6, 9 can never be drawn
    return WeightedRandomSampler(weights, num_samples=n, replacement=True)


def _expected_inner(n: int, seed: int, epoch: int) -> list[int]:
    sampler = _weighted(n)
    sampler.generator = torch.Generator().manual_seed(seed + epoch)
    return list(sampler)


@pytest.mark.parametrize("epoch", [0, 2])
def test_wrapper_deals_a_weighted_samplers_draw_consistently(epoch: int) -> None:
    n, replicas, seed = 10, 3, 4
    shares = []
    for rank in range(replicas):
        torch.manual_seed(100 + rank)  # each "process" has its own global RNG state: must not matter
        wrapper = DistributedSamplerWrapper(_weighted(n), num_replicas=replicas, rank=rank, seed=seed)
        wrapper.set_epoch(epoch)
        shares.append(list(wrapper))
        assert len(wrapper) == len(shares[-1]) == 4
    inner = _expected_inner(n, seed, epoch)
    padded = inner + inner[: 12 - n]
    assert shares == [padded[r::replicas] for r in range(replicas)]
    assert not {0, 3, 6, 9} & {i for share in shares for i in share}


def test_wrapper_draw_changes_with_epoch_and_restores_the_users_generator() -> None:
    sampler = _weighted(30)
    own = torch.Generator()
    sampler.generator = own
    wrapper = DistributedSamplerWrapper(sampler, num_replicas=2, rank=0, seed=1)
    first = list(wrapper)
    assert sampler.generator is own
    assert list(wrapper) == first
    wrapper.set_epoch(1)
    assert list(wrapper) != first


def test_wrapper_without_repeat_deals_each_draw_once() -> None:
    n, replicas = 10, 3
    shares = [
        list(DistributedSamplerWrapper(_weighted(n), num_replicas=replicas, rank=r, seed=2, repeat=False))
        for r in range(replicas)
    ]
    assert [len(s) for s in shares] == [4, 3, 3]
    inner = _expected_inner(n, 2, 0)
    assert shares == [inner[r::replicas] for r in range(replicas)]
    assert len(DistributedSamplerWrapper(_weighted(n), num_replicas=replicas, rank=2, repeat=False)) == 3


def test_wrapper_keeps_a_deterministic_samplers_order() -> None:
    shares = [list(DistributedSamplerWrapper(Reversed(7), num_replicas=2, rank=r, repeat=False)) for r in range(2)]
    assert shares == [[6, 4, 2, 0], [5, 3, 1]]
    padded = [list(DistributedSamplerWrapper(Reversed(7), num_replicas=2, rank=r)) for r in range(2)]
    assert padded == [[6, 4, 2, 0], [5, 3, 1, 6]]
    trimmed = [list(DistributedSamplerWrapper(Reversed(7), num_replicas=2, rank=r, drop_last=True)) for r in range(2)]
    assert trimmed == [[6, 4, 2], [5, 3, 1]]


def test_wrapper_rejects_unsized_sampler_and_repeat_false_with_drop_last() -> None:
    with pytest.raises(ValueError, match="no length"):
        DistributedSamplerWrapper(iter(range(3)), num_replicas=2, rank=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="drop_last"):
        DistributedSamplerWrapper(Reversed(4), num_replicas=2, rank=0, repeat=False, drop_last=True)


# ---------------------------------------------------------------- with_sampler


def test_with_sampler_keeps_every_setting() -> None:
    generator = torch.Generator()
    context = multiprocessing.get_context("spawn")
    loader = DataLoader(
        Indices(10),
        batch_size=3,
        shuffle=True,
        num_workers=2,
        collate_fn=_collate,
        pin_memory=True,
        drop_last=True,
        timeout=7.0,
        worker_init_fn=_worker_init,
        multiprocessing_context=context,
        generator=generator,
        prefetch_factor=5,
        persistent_workers=True,
        pin_memory_device="cpu",
        in_order=False,
    )
    sampler = SequentialSampler(loader.dataset)
    new = with_sampler(loader, sampler)
    assert new is not loader and type(new) is DataLoader
    assert new.sampler is sampler and new.batch_sampler.sampler is sampler
    assert new.dataset is loader.dataset
    assert (new.batch_size, new.num_workers, new.drop_last, new.timeout) == (3, 2, True, 7.0)
    assert new.collate_fn is _collate and new.worker_init_fn is _worker_init and new.generator is generator
    assert new.multiprocessing_context is loader.multiprocessing_context
    assert new.pin_memory is True and new.pin_memory_device == "cpu"
    assert new.persistent_workers is True and new.prefetch_factor == 5 and new.in_order is False


def test_with_sampler_batches_the_new_sampler_like_the_old_loader() -> None:
    loader = DataLoader(Indices(7), batch_size=3, shuffle=True)
    new = with_sampler(loader, Reversed(7))
    assert [b.tolist() for b in new] == [[6, 5, 4], [3, 2, 1], [0]]
    unbatched = with_sampler(DataLoader(Indices(3), batch_size=None), Reversed(3))
    assert unbatched.batch_size is None and [int(x) for x in unbatched] == [2, 1, 0]


def test_with_sampler_unpacks_a_plain_batch_sampler() -> None:
    loader = DataLoader(
        Indices(7), batch_sampler=BatchSampler(SequentialSampler(range(7)), batch_size=2, drop_last=True)
    )
    new = with_sampler(loader, Reversed(7))
    assert (new.batch_size, new.drop_last) == (2, True)
    assert [b.tolist() for b in new] == [[6, 5], [4, 3], [2, 1]]


def test_with_sampler_rejects_custom_batch_sampler() -> None:
    loader = DataLoader(Indices(6), batch_sampler=PairBatches(6))
    with pytest.raises(ValueError, match="custom batch_sampler.*use_distributed_sampler=False"):
        with_sampler(loader, SequentialSampler(range(6)))


def test_with_sampler_rebuilds_compatible_subclasses_and_explains_incompatible_ones() -> None:
    class Compatible(DataLoader):
        pass

    class Incompatible(DataLoader):
        def __init__(self, dataset: Any, special: int) -> None:
            super().__init__(dataset, batch_size=special)

    rebuilt = with_sampler(Compatible(Indices(4), batch_size=2), Reversed(4))
    assert type(rebuilt) is Compatible and [b.tolist() for b in rebuilt] == [[3, 2], [1, 0]]
    with pytest.raises(ValueError, match="Incompatible.*use_distributed_sampler=False") as info:
        with_sampler(Incompatible(Indices(4), special=2), Reversed(4))
    assert isinstance(info.value.__cause__, TypeError)


def test_with_sampler_leaves_iterable_datasets_alone() -> None:
    loader = DataLoader(Stream(), batch_size=2)
    assert with_sampler(loader, SequentialSampler(range(5))) is loader


# ---------------------------------------------------------------- distributed_dataloader


def _dist(loader: Any, training: bool, rank: int = 1, replicas: int = 3, seed: int = 9) -> Any:
    return distributed_dataloader(loader, num_replicas=replicas, rank=rank, training=training, seed=seed)


def test_training_policy_for_random_and_sequential_samplers() -> None:
    shuffled = _dist(DataLoader(Indices(10), batch_size=2, shuffle=True, drop_last=True), training=True)
    sampler = shuffled.sampler
    assert type(sampler) is DistributedSampler
    assert (sampler.shuffle, sampler.seed, sampler.drop_last, sampler.num_replicas, sampler.rank) == (
        True,
        9,
        True,
        3,
        1,
    )
    assert shuffled.drop_last is True and shuffled.batch_size == 2
    ordered = _dist(DataLoader(Indices(10), batch_size=2), training=True).sampler
    assert type(ordered) is DistributedSampler and ordered.shuffle is False and ordered.drop_last is False
    assert list(ordered) == [1, 4, 7, 0]  # padded with index 0 so every rank has 4 samples


def test_training_policy_wraps_other_samplers() -> None:
    loader = DataLoader(Indices(10), batch_size=2, sampler=_weighted())
    sampler = _dist(loader, training=True).sampler
    assert type(sampler) is DistributedSamplerWrapper and sampler.repeat is True and sampler.seed == 9
    with_replacement = DataLoader(Indices(10), sampler=RandomSampler(Indices(10), replacement=True))
    assert type(_dist(with_replacement, training=True).sampler) is DistributedSamplerWrapper
    subset = DataLoader(Indices(10), sampler=SubsetRandomSampler([1, 2, 3]))
    assert type(_dist(subset, training=True).sampler) is DistributedSamplerWrapper


def test_evaluation_policy_never_repeats() -> None:
    for shuffle in (False, True):
        loaders = [
            _dist(DataLoader(Indices(10), batch_size=3, shuffle=shuffle), training=False, rank=r) for r in range(3)
        ]
        assert all(
            type(loader.sampler) is UnrepeatedDistributedSampler and loader.sampler.shuffle is False
            for loader in loaders
        )
        assert sorted(int(x) for loader in loaders for batch in loader for x in batch) == list(range(10))
    custom = _dist(DataLoader(Indices(10), sampler=Reversed(10)), training=False).sampler
    assert type(custom) is DistributedSamplerWrapper and custom.repeat is False and list(custom) == [8, 5, 2]


def test_policy_leaves_distributed_iterable_and_foreign_loaders_alone() -> None:
    already = DataLoader(Indices(10), sampler=DistributedSampler(Indices(10), num_replicas=2, rank=0))
    assert _dist(already, training=True) is already
    batched = DataLoader(
        Indices(10), batch_sampler=BatchSampler(UnrepeatedDistributedSampler(Indices(10), 2, 0), 2, False)
    )
    assert _dist(batched, training=False) is batched
    stream = DataLoader(Stream(), batch_size=2)
    assert _dist(stream, training=True) is stream
    plain = [[1, 2], [3]]
    assert _dist(plain, training=False) is plain
    with pytest.raises(ValueError, match="use_distributed_sampler=False"):
        _dist(DataLoader(Indices(6), batch_sampler=PairBatches(6)), training=True)


# ---------------------------------------------------------------- batch_indices and reassemble_predictions


def _rank_loaders(n: int, batch_size: int, replicas: int, shuffle: bool = False) -> list[DataLoader]:
    return [
        with_sampler(
            DataLoader(TensorDataset(torch.arange(n)), batch_size=batch_size),
            UnrepeatedDistributedSampler(TensorDataset(torch.arange(n)), replicas, rank, shuffle=shuffle, seed=5),
        )
        for rank in range(replicas)
    ]


def test_batch_indices_match_what_the_loader_yields() -> None:
    for loader in _rank_loaders(11, 3, 3, shuffle=True):
        assert batch_indices(loader) == [batch[0].tolist() for batch in loader]
    assert batch_indices(DataLoader(Indices(3), batch_size=None)) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="iterable"):
        batch_indices(DataLoader(Stream()))


Point = collections.namedtuple("Point", ["x", "y"])


def _predict(batch: torch.Tensor) -> dict[str, Any]:
    """A predict_step with a mix of outputs: tensors, nested containers, a namedtuple and per-sample strings."""
    x = batch.float()
    return {
        "y": x.unsqueeze(1) * torch.tensor([[1.0, -1.0]]),
        "pair": (x * 2, [x + 1]),
        "point": Point(x, x.long() % 3),
        "names": [f"s{int(v)}" for v in batch],
        "nothing": None,
    }


def _distributed_predictions(
    n: int, batch_size: int, replicas: int, shuffle: bool, predict: Any
) -> list[list[tuple[list[int], Any]]]:
    per_rank = []
    for loader in _rank_loaders(n, batch_size, replicas, shuffle):
        batches = [batch[0] for batch in loader]
        per_rank.append([(idx, predict(batch)) for idx, batch in zip(batch_indices(loader), batches, strict=True)])
    return per_rank


def _assert_same(actual: Any, expected: Any) -> None:
    assert type(actual) is type(expected)
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and torch.equal(actual, expected)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected)
        for key in expected:
            _assert_same(actual[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            _assert_same(a, e)
    else:
        assert actual == expected


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize(("n", "batch_size", "replicas"), [(12, 3, 2), (11, 4, 2), (10, 3, 3), (7, 4, 3), (2, 2, 3)])
def test_reassembly_equals_a_single_process(n: int, batch_size: int, replicas: int, shuffle: bool) -> None:
    single = [_predict(batch[0]) for batch in DataLoader(TensorDataset(torch.arange(n)), batch_size=batch_size)]
    per_rank = _distributed_predictions(n, batch_size, replicas, shuffle, _predict)
    merged = reassemble_predictions(per_rank, batch_size)
    _assert_same(merged, single)
    assert len(merged[-1]["names"]) == (n % batch_size or batch_size)


def test_reassembly_of_plain_tensors_with_unknown_batch_size() -> None:
    per_rank = _distributed_predictions(10, 4, 3, False, lambda b: b * 10)
    merged = reassemble_predictions(per_rank, None)  # largest batch seen on any rank: 4
    assert [t.tolist() for t in merged] == [[0, 10, 20, 30], [40, 50, 60, 70], [80, 90]]


def test_reassembly_of_nothing_and_of_tuple_of_per_sample_lists() -> None:
    assert reassemble_predictions([[], []], 4) == []
    per_rank = [[([0, 2], ("a", "c"))], [([1], ("b",))]]
    assert reassemble_predictions(per_rank, 2) == [("a", "b"), ("c",)]


@pytest.mark.parametrize(
    "output",
    [1.5, torch.tensor(2.0), torch.zeros(3, 2), ["only", "two", "of", "four"], {"loss": 0.5}],
    ids=["float", "scalar-tensor", "wrong-rows", "wrong-length-list", "dict-of-float"],
)
def test_reassembly_rejects_outputs_without_one_entry_per_sample(output: Any) -> None:
    per_rank = [[([0, 1], output)], [([2, 3], output)]]
    with pytest.raises(ValueError, match="one entry per sample|one row per sample"):
        reassemble_predictions(per_rank, 2)


def test_reassembly_rejects_bad_batch_size() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        reassemble_predictions([[([0], torch.zeros(1))]], 0)


def test_padded_evaluation_gives_every_rank_as_many_batches_and_prediction_drops_the_repeats() -> None:
    # Sharded models (FSDP, tensor parallelism) run a collective in every forward pass: ranks must see equally many
    # batches even when the data does not divide.
    loaders = [
        distributed_dataloader(
            DataLoader(TensorDataset(torch.arange(11)), batch_size=2, shuffle=True),
            num_replicas=3,
            rank=r,
            training=False,
            seed=0,
            pad_evaluation=True,
        )
        for r in range(3)
    ]
    assert [len(loader) for loader in loaders] == [2, 2, 2]
    seen = [int(x) for loader in loaders for (batch,) in loader for x in batch]
    assert len(seen) == 12 and sorted(set(seen)) == list(range(11))  # one index twice, none missing, no shuffling
    per_rank = [[(idx, batch * 10) for idx, (batch,) in zip(batch_indices(loader), loader)] for loader in loaders]
    merged = reassemble_predictions(per_rank, 2, drop_repeats=True)
    assert [t.tolist() for t in merged] == [[0, 10], [20, 30], [40, 50], [60, 70], [80, 90], [100]]
    assert sum(len(t) for t in reassemble_predictions(per_rank, 2)) == 12  # without drop_repeats the repeat stays
