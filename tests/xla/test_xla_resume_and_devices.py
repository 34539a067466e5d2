"""XLA on the PJRT CPU runtime with 2 devices: ``devices=[1]`` really trains on device 1, and a model with dropout
resumes exactly on single_xla and on xla (2 replicas) because checkpoints hold each replica's XLA generator state.

Each check compares against a run that only passes because of what it tests: the same resume from a checkpoint whose
XLA generator states were removed ends elsewhere.
"""

from __future__ import annotations

from typing import Any

import pytest
from xla_helpers import run_scenario


@pytest.fixture(scope="module")
def extras(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_scenario("extras", tmp_path_factory.mktemp("xla_extras"), devices=2)


@pytest.fixture(scope="module")
def replica_dropout(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_scenario("replica_dropout", tmp_path_factory.mktemp("xla_replica_dropout"), devices=2)


def test_a_device_index_trains_on_that_device(extras: dict[str, Any]) -> None:
    assert extras["index_strategy"] == "SingleDeviceXLAStrategy"
    assert extras["index_devices"] == ["xla:1"]  # the parameters and every batch, at every step
    assert extras["index_param_diff"] < 1e-6  # the same run as plain CPU PyTorch (measured: 1.7e-8)


@pytest.mark.parametrize("strategy", ["single_xla", "xla"])
def test_dropout_resumes_exactly_from_the_xla_generator_state(
    extras: dict[str, Any], replica_dropout: dict[str, Any], strategy: str
) -> None:
    result = extras["single_xla"] if strategy == "single_xla" else replica_dropout
    seeds = result["xla_seeds"]
    assert seeds and all(isinstance(seed, int) for seed in seeds)  # one per replica, a plain int
    assert result["resume_diff"] == 0.0  # bit for bit the uninterrupted run
    assert result["resume_diff_without_xla_state"] > 1e-3  # the state is what makes it so (measured ~0.13)
