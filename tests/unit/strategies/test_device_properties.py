"""The Trainer's properties about where it runs (phalanx.strategies.properties), right from construction."""

from __future__ import annotations

import pytest

import phalanx

_LAUNCH_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "MASTER_PORT", "SLURM_NTASKS")


@pytest.mark.parametrize(
    ("arguments", "world_size"),
    [
        ({"strategy": "single_device", "devices": 1}, 1),
        ({"strategy": "ddp", "devices": 1}, 1),
        ({"strategy": "ddp", "devices": 2}, 2),
        ({"strategy": "ddp", "devices": 3, "num_nodes": 2}, 6),
        ({"strategy": "ddp_spawn", "devices": 2}, 2),
        ({"strategy": "fsdp", "devices": 2}, 2),
        ({"strategy": "fsdp", "devices": 2, "num_nodes": 2}, 4),
        ({"strategy": "ddp_fork", "devices": 2}, 2),
        ({"strategy": "model_parallel", "devices": 2}, 2),
        ({"strategy": "deepspeed", "devices": 2}, 2),
        ({"devices": 2}, 2),  # strategy="auto"
    ],
)
@pytest.mark.parametrize("stale_world_size", [None, "7"])
def test_world_size_is_devices_times_nodes_from_construction(monkeypatch, arguments, world_size, stale_world_size):
    # As in Lightning, before fit: not 1, and not a WORLD_SIZE left in the environment by something else.
    for name in _LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    if stale_world_size is not None:
        monkeypatch.setenv("WORLD_SIZE", stale_world_size)
    trainer = phalanx.Trainer(accelerator="cpu", logger=False, **arguments)
    assert trainer.world_size == world_size
    assert trainer.strategy.world_size == world_size
    assert (trainer.global_rank, trainer.local_rank, trainer.node_rank, trainer.is_global_zero) == (0, 0, 0, True)
    assert trainer.num_nodes == arguments.get("num_nodes", 1)


SHARED_PROPERTIES = [
    "global_rank", "local_rank", "node_rank", "world_size", "num_nodes", "is_global_zero", "accelerator",
    "precision_plugin", "device_ids", "num_devices",
]  # fmt: skip


@pytest.mark.parametrize("name", SHARED_PROPERTIES)
def test_the_cohort_and_the_trainer_share_one_definition_of_each_property(name: str) -> None:
    from phalanx.strategies.properties import DeviceProperties

    cohort = phalanx.Cohort(accelerator="cpu", strategy="single_device", devices=1)
    trainer = phalanx.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    assert getattr(type(cohort), name) is getattr(DeviceProperties, name) is getattr(type(trainer), name)
    # Each owns its strategy, so plugin instances differ: compare their classes.
    values = [getattr(owner, name) for owner in (cohort, trainer)]
    assert [value if isinstance(value, (int, list)) else type(value) for value in values] == [
        values[1] if isinstance(values[1], (int, list)) else type(values[1])
    ] * 2
