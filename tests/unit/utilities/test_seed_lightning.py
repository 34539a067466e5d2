"""``seed_everything``, ``reset_seed`` and the seed variables against Lightning 2.6's (lightning_fabric's) on the same
calls: the seed returned, the generators' draws, the variables written, the warning without a seed and the "Seed set
to" line. Lightning is the oracle where installed; without it the comparisons skip."""

from __future__ import annotations

import logging
import os
import random
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from phalanx.utilities import seed as ours

VARIABLES = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS", "PHALANX_GLOBAL_SEED", "PHALANX_SEED_WORKERS")
LIGHTNING_VARIABLES = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")


@pytest.fixture(autouse=True)
def _clean_seed_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*VARIABLES, "RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        monkeypatch.setenv(name, "0")  # so that monkeypatch restores what was there
        monkeypatch.delenv(name)


def _lightning() -> Any:
    return pytest.importorskip("lightning_fabric.utilities.seed", reason="Lightning (the oracle) is not installed")


def _observe(seed_everything: Any, kwargs: dict[str, Any], environment: dict[str, str], caplog: Any) -> dict:
    """What one call does: its result, the draws after it, the variables it leaves, its warnings and log lines."""
    for name in VARIABLES:
        os.environ.pop(name, None)
    os.environ.update(environment)
    caplog.clear()
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        result = seed_everything(**kwargs)
    return {
        "result": result,
        "draws": (torch.rand(2).tolist(), random.random(), np.random.rand(2).tolist()),
        "variables": {name: os.environ.get(name) for name in LIGHTNING_VARIABLES},
        "warnings": [str(w.message) for w in warned],
        "logged": [record.getMessage() for record in caplog.records if "Seed set to" in record.getMessage()],
    }


CALLS = [
    pytest.param({"seed": 42}, {}, id="seed"),
    pytest.param({"seed": 42, "workers": True}, {}, id="seed-workers"),
    pytest.param({"seed": 7, "verbose": False}, {}, id="seed-quiet"),
    pytest.param({}, {}, id="no-seed"),
    pytest.param({"verbose": False}, {}, id="no-seed-quiet"),
    pytest.param({}, {"PL_GLOBAL_SEED": "123"}, id="seed-from-PL_GLOBAL_SEED"),
    pytest.param({"workers": True}, {"PL_GLOBAL_SEED": "5"}, id="variable-workers"),
    pytest.param({"seed": 0}, {"RANK": "1"}, id="rank-prefixed-line"),
]


@pytest.mark.parametrize(("kwargs", "environment"), CALLS)
def test_seed_everything_does_what_lightnings_does(kwargs, environment, caplog):
    lightning = _lightning()
    theirs = _observe(lightning.seed_everything, kwargs, environment, caplog)
    mine = _observe(ours.seed_everything, kwargs, environment, caplog)
    assert mine == theirs
    assert mine["variables"]["PL_GLOBAL_SEED"] == str(mine["result"])
    assert os.environ["PHALANX_GLOBAL_SEED"] == str(mine["result"])  # phalanx's own name too


@pytest.mark.parametrize(
    "environment",
    [{}, {"PL_GLOBAL_SEED": "31"}, {"PL_GLOBAL_SEED": "31", "PL_SEED_WORKERS": "1"}],
    ids=["never-seeded", "seeded", "seeded-with-workers"],
)
def test_reset_seed_does_what_lightnings_does(environment, caplog):
    lightning = _lightning()
    seen = []
    for reset_seed in (lightning.reset_seed, ours.reset_seed):
        for name in VARIABLES:
            os.environ.pop(name, None)
        os.environ.update(environment)
        torch.manual_seed(999)  # a state reset_seed must replace when a seed was set, and keep otherwise
        caplog.clear()
        with caplog.at_level(logging.INFO):
            reset_seed()
        seen.append(
            (
                torch.rand(2).tolist(),
                {name: os.environ.get(name) for name in LIGHTNING_VARIABLES},
                [record.getMessage() for record in caplog.records],
            )
        )
    assert seen[0] == seen[1]


def test_the_cohort_takes_verbose_and_passes_it_on(caplog):
    from phalanx import Cohort

    with caplog.at_level(logging.INFO, logger="phalanx"):
        assert Cohort.seed_everything(3, verbose=False) == 3
        assert not [record for record in caplog.records if "Seed set to" in record.getMessage()]
        Cohort.seed_everything(4)
    assert [record.getMessage() for record in caplog.records] == ["Seed set to 4"]


def test_the_worker_init_function_has_lightnings_name_and_defaults_to_this_process_rank(monkeypatch):
    from phalanx.utilities.rank_zero import rank_zero_only

    assert ours.pl_worker_init_function is ours.worker_init_fn
    monkeypatch.setattr(rank_zero_only, "_process_rank", 1)
    draws = []
    for rank in (None, 1, 0):
        torch.manual_seed(1000)
        ours.worker_init_fn(0, rank)
        draws.append(torch.rand(2).tolist())
    assert draws[0] == draws[1] != draws[2]  # rank=None is this process's rank (1), not 0


@pytest.mark.parametrize("workers", [True, False])
def test_cohort_loaders_get_the_worker_init_function_as_fabrics_do(workers):
    from torch.utils.data import DataLoader, TensorDataset

    from phalanx import Cohort

    def set_up(driver: Any) -> Any:
        driver.seed_everything(1, workers=workers, verbose=False)
        loader = DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2, num_workers=1)
        return driver.setup_dataloaders(loader).worker_init_fn

    mine = set_up(Cohort(accelerator="cpu", devices=1))
    assert (mine is not None) is workers
    if workers:
        assert (mine.func, mine.keywords) == (ours.worker_init_fn, {"rank": 0})
    fabric = pytest.importorskip("lightning_fabric", reason="Lightning Fabric (the oracle) is not installed")
    assert (set_up(fabric.Fabric(accelerator="cpu", devices=1)) is not None) is workers
    untouched = DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2, num_workers=1, worker_init_fn=print)
    assert Cohort(accelerator="cpu", devices=1).setup_dataloaders(untouched).worker_init_fn is print


SAMPLER_ENVIRONMENTS = [
    pytest.param({}, 0, id="none"),
    pytest.param({"PL_GLOBAL_SEED": "17"}, 17, id="exported-by-a-lightning-user"),
    pytest.param({"PHALANX_GLOBAL_SEED": "23"}, 23, id="phalanx-name"),
    pytest.param({"PL_GLOBAL_SEED": "17", "PHALANX_GLOBAL_SEED": "23"}, 17, id="both-lightnings-first"),
]


@pytest.mark.parametrize(("environment", "expected"), SAMPLER_ENVIRONMENTS)
def test_distributed_samplers_shuffle_with_the_seed_lightnings_samplers_read(environment, expected, monkeypatch):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert ours.sampler_seed() == expected
    if "PHALANX_GLOBAL_SEED" not in environment:  # Lightning reads only its own name
        data_connector = pytest.importorskip("pytorch_lightning.trainer.connectors.data_connector")
        dataset = torch.utils.data.TensorDataset(torch.arange(8))
        loader = torch.utils.data.DataLoader(dataset)
        sampler = data_connector._get_distributed_sampler(
            loader, shuffle=True, overfit_batches=0, mode=None, num_replicas=2, rank=0
        )
        assert sampler.seed == expected


@pytest.mark.parametrize("value", ["", "x", "1.5"])
def test_a_sampler_seed_that_is_not_an_int_is_refused_by_name(value, monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", value)
    if value == "":
        assert ours.sampler_seed() == 0  # unset in effect, as for seed_everything
        return
    with pytest.raises(ValueError, match=f"PL_GLOBAL_SEED={value!r} is not a valid seed"):
        ours.sampler_seed()
