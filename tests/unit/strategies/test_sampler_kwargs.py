"""``DistributedSampler(dataset, **strategy.distributed_sampler_kwargs)`` works for every strategy, as in Lightning."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

import phalanx

STRATEGIES = [
    ("ddp", False),
    ("ddp_spawn", False),
    ("fsdp", True),
    ("deepspeed_stage_2", False),
    ("deepspeed_stage_3", True),
]


@pytest.mark.parametrize(("name", "padded"), STRATEGIES)
def test_sampler_kwargs_build_a_distributed_sampler(name, padded, monkeypatch):
    for variable in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "SLURM_NTASKS"):
        monkeypatch.delenv(variable, raising=False)
    strategy = phalanx.Trainer(strategy=name, accelerator="cpu", devices=2, logger=False).strategy
    sampler = DistributedSampler(TensorDataset(torch.arange(10)), **strategy.distributed_sampler_kwargs)
    assert sampler.num_replicas == 2 and sampler.rank == 0 and len(list(sampler)) == 5
    assert strategy.traits.pads_evaluation is padded


def test_model_parallel_samples_over_its_data_parallel_ranks():
    from phalanx.strategies import ModelParallelStrategy

    strategy = ModelParallelStrategy(
        data_parallel_size=2, tensor_parallel_size=2, parallel_devices=[torch.device("cpu")] * 4
    )
    sampler = DistributedSampler(TensorDataset(torch.arange(10)), **strategy.distributed_sampler_kwargs)
    assert sampler.num_replicas == 2 and strategy.traits.pads_evaluation
