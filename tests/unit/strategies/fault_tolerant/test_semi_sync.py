"""SemiSync (torchft's LocalSGD and DiLoCo in strategy='ddp_ft'): what it refuses, and one replica group in this
process (a lighthouse here too) that ends with the weights of the same algorithm replayed by hand."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from phalanx_distributed import free_port
from phalanx_testing import Regressor, regression_data
from torch.utils.data import DataLoader

import phalanx
from phalanx.plugins.environments.default import DefaultEnvironment
from phalanx.strategies import DDPFaultTolerantStrategy, FaultTolerance, RunSettings, SemiSync

pytest.importorskip("torchft")

OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}


def outer_sgd(parameters: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, **OUTER)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"algorithm": "streaming", "sync_every": 2}, r"algorithm='streaming'\) is not valid; choose one of \('local"),
        ({"algorithm": "local_sgd", "sync_every": 0}, r"sync_every=0\) must be an int >= 1"),
        ({"algorithm": "local_sgd", "sync_every": True}, r"sync_every=True\) must be an int >= 1"),
        ({"algorithm": "diloco", "sync_every": 1.5, "outer_optimizer": outer_sgd}, r"sync_every=1.5\) must be an int"),
        ({"algorithm": "diloco", "sync_every": 4}, r"algorithm='diloco'\) needs outer_optimizer, a function"),
        ({"algorithm": "diloco", "sync_every": 4, "outer_optimizer": "sgd"}, r"needs outer_optimizer.*got 'sgd'"),
        ({"algorithm": "local_sgd", "sync_every": 4, "outer_optimizer": outer_sgd}, r"choose algorithm='diloco'"),
    ],
    ids=["unknown-algorithm", "zero", "bool", "float", "diloco-no-outer", "diloco-outer-not-callable", "local-outer"],
)  # fmt: skip
def test_bad_semi_sync_options_are_refused_naming_the_valid_ones(options, message):
    with pytest.raises(ValueError, match=message):
        SemiSync(**options)


def test_fault_tolerance_takes_a_semi_sync_or_none():
    with pytest.raises(
        TypeError, match=r"takes a SemiSync\(algorithm, sync_every, outer_optimizer\) or None, got dict"
    ):
        FaultTolerance(0, 1, semi_sync={"algorithm": "local_sgd"})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("world_size", "accumulate", "message"),
    [
        (1, 2, r"accumulate_grad_batches=1 only, got 2. Raise sync_every instead"),
        (2, 1, r"one process per replica group in this release, but replica group 0 has 2"),
    ],
    ids=["accumulation", "two-processes-per-group"],
)
def test_what_semi_sync_does_not_run_is_refused(world_size, accumulate, message):
    environment = DefaultEnvironment()
    environment.set_world_size(world_size)
    strategy = DDPFaultTolerantStrategy(
        cluster_environment=environment,
        parallel_devices=[torch.device("cpu")] * world_size,
        fault_tolerance=FaultTolerance(0, 1, semi_sync=SemiSync("local_sgd", 2)),
    )
    strategy.connect(Regressor())
    with pytest.raises(ValueError, match=message):
        strategy.check_setup(RunSettings(accumulate_grad_batches=accumulate))


BATCH, STEPS, SYNC_EVERY = 8, 4, 2


def _replay(algorithm: str) -> list[torch.Tensor]:
    """The algorithm by hand for one group: LocalSGD's average of one group is its own weights (plain SGD); DiLoCo
    steps the outer optimizer with the weights of the last synchronisation minus the current ones."""
    phalanx.seed_everything(3)
    model = Regressor()
    inner = torch.optim.SGD(model.parameters(), lr=model.hparams.lr)
    synced = [p.detach().clone() for p in model.parameters()]
    outer = outer_sgd(model.parameters())
    data = regression_data()
    for step in range(STEPS):
        x, y = data[step * BATCH : (step + 1) * BATCH]
        inner.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        inner.step()
        if algorithm == "diloco" and (step + 1) % SYNC_EVERY == 0:
            with torch.no_grad():
                for parameter, weights in zip(model.parameters(), synced):
                    parameter.grad = weights - parameter
                    parameter.copy_(weights)
            outer.step()
            synced = [p.detach().clone() for p in model.parameters()]
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("algorithm", ["local_sgd", "diloco"])
def test_one_group_ends_with_the_weights_of_the_algorithm_replayed_by_hand(algorithm, monkeypatch, tmp_path):
    from phalanx.strategies.fault_tolerant import start_lighthouse

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    semi_sync = SemiSync(algorithm, SYNC_EVERY, outer_sgd if algorithm == "diloco" else None)
    with start_lighthouse(min_replicas=1) as lighthouse:
        options = FaultTolerance(0, 1, lighthouse=lighthouse.address, semi_sync=semi_sync)
        phalanx.seed_everything(3)
        model = Regressor()
        trainer = phalanx.Trainer(
            strategy=DDPFaultTolerantStrategy(fault_tolerance=options),
            accelerator="cpu",
            devices=1,
            max_steps=STEPS,
            default_root_dir=tmp_path,
            enable_progress_bar=False,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
        )
        try:
            trainer.fit(model, DataLoader(regression_data(), batch_size=BATCH))
        finally:
            torch.distributed.destroy_process_group()  # the strategy's, as DDP leaves it (Lightning does too)
    assert trainer.global_step == STEPS
    for got, want in zip(model.parameters(), _replay(algorithm)):
        torch.testing.assert_close(got.detach(), want, atol=1e-6, rtol=0)
