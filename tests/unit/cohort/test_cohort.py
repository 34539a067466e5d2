"""phalanx.Cohort in one process: the API, its errors, save/load, and checkpoints shared with the Trainer."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.cohort import CohortModule
from phalanx.strategies import StrategyTraits
from phalanx.utilities.exceptions import CheckpointError


def _data(n: int = 48) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


class Regressor(phalanx.TrainingModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def _cohort() -> phalanx.Cohort:
    return phalanx.Cohort(accelerator="cpu", strategy="single_device", devices=1)


def _cohort_steps(cohort: phalanx.Cohort, module: Regressor, steps: int) -> tuple[Any, Any]:
    model, optimizer = cohort.setup(module, torch.optim.SGD(module.parameters(), lr=module.hparams.lr, momentum=0.9))
    loader = cohort.setup_dataloaders(DataLoader(_data(), batch_size=8))
    for index, batch in enumerate(loader):
        if index == steps:
            break
        optimizer.zero_grad()
        cohort.backward(model.training_step(batch, index))
        optimizer.step()
    return model, optimizer


def _trainer(tmp_path, max_steps: int) -> phalanx.Trainer:
    return phalanx.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
    )


def _weights(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def test_single_device_loop_equals_plain_torch_and_the_trainer(tmp_path):
    torch.manual_seed(0)
    plain = Regressor()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    for batch in list(DataLoader(_data(), batch_size=8))[:5]:
        optimizer.zero_grad()
        plain.training_step(batch, 0).backward()
        optimizer.step()

    torch.manual_seed(0)
    ours = Regressor()
    cohort = _cohort()
    model, wrapped = _cohort_steps(cohort, ours, 5)
    assert isinstance(model, CohortModule) and model.module is ours
    assert isinstance(wrapped, torch.optim.SGD) and cohort.global_step == 5
    assert all(torch.equal(a, b) for a, b in zip(_weights(ours), _weights(plain)))

    torch.manual_seed(0)
    fitted = Regressor()
    _trainer(tmp_path, 5).fit(fitted, DataLoader(_data(), batch_size=8))
    assert all(torch.equal(a, b) for a, b in zip(_weights(fitted), _weights(plain)))


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")
def test_save_load_round_trip_restores_weights_optimizer_scheduler_and_objects(tmp_path):
    torch.manual_seed(0)
    cohort = _cohort()
    module = Regressor()
    model, optimizer = _cohort_steps(cohort, module, 3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    scheduler.step()
    path = tmp_path / "cohort.ckpt"
    cohort.save(
        path, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "note": "hello", "extra": [1, 2]}
    )
    saved_weights, saved_optimizer = _weights(module), copy.deepcopy(optimizer.state_dict())

    _cohort_steps_more(cohort, model, optimizer)
    scheduler.step()
    assert not all(torch.equal(a, b) for a, b in zip(_weights(module), saved_weights))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "note": None}
    unread = cohort.load(path, state)
    assert unread == {"extra": [1, 2]} and state["note"] == "hello"
    assert all(torch.equal(a, b) for a, b in zip(_weights(module), saved_weights))
    restored = optimizer.state_dict()
    assert restored["param_groups"] == saved_optimizer["param_groups"]
    for key, value in saved_optimizer["state"].items():
        assert torch.equal(restored["state"][key]["momentum_buffer"], value["momentum_buffer"])
    assert scheduler.last_epoch == 1 and cohort.global_step == 3


def _cohort_steps_more(cohort: phalanx.Cohort, model: Any, optimizer: Any) -> None:
    for batch in list(DataLoader(_data(), batch_size=8))[:2]:
        optimizer.zero_grad()
        cohort.backward(model.training_step(batch, 0))
        optimizer.step()


def test_trainer_resumes_a_cohort_checkpoint_exactly(tmp_path):
    torch.manual_seed(0)
    straight = Regressor()
    _trainer(tmp_path / "a", 5).fit(straight, DataLoader(_data(), batch_size=8))

    torch.manual_seed(0)
    cohort = _cohort()
    module = Regressor()
    model, optimizer = _cohort_steps(cohort, module, 2)
    cohort.save(tmp_path / "cohort.ckpt", {"model": model, "optimizer": optimizer})
    resumed = Regressor()
    trainer = _trainer(tmp_path / "b", 5)
    trainer.fit(resumed, DataLoader(_data(), batch_size=8), ckpt_path=str(tmp_path / "cohort.ckpt"))
    assert trainer.global_step == 5
    assert all(torch.equal(a, b) for a, b in zip(_weights(resumed), _weights(straight)))


def test_cohort_resumes_a_trainer_checkpoint_exactly(tmp_path):
    torch.manual_seed(0)
    straight = Regressor()
    _trainer(tmp_path / "a", 5).fit(straight, DataLoader(_data(), batch_size=8))

    torch.manual_seed(0)
    first = Regressor()
    trainer = _trainer(tmp_path / "b", 2)
    trainer.fit(first, DataLoader(_data(), batch_size=8))
    trainer.save_checkpoint(str(tmp_path / "trainer.ckpt"))

    cohort = _cohort()
    module = Regressor()
    model, optimizer = cohort.setup(module, torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9))
    state = {"model": model, "optimizer": optimizer, "global_step": 0}
    cohort.load(str(tmp_path / "trainer.ckpt"), state)
    assert state["global_step"] == 2 == cohort.global_step
    for index, batch in enumerate(cohort.setup_dataloaders(DataLoader(_data(), batch_size=8))):
        if index < 2:
            continue
        if index == 5:
            break
        optimizer.zero_grad()
        cohort.backward(model.training_step(batch, index))
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(_weights(module), _weights(straight)))


def test_optimizers_made_after_setup_module_or_before_it_both_step_the_set_up_parameters():
    for made_before in (True, False):
        cohort = _cohort()
        module = Regressor()
        early = torch.optim.Adam(module.parameters(), lr=0.1)
        model = cohort.setup_module(module)
        optimizer = cohort.setup_optimizers(early if made_before else torch.optim.Adam(model.parameters(), lr=0.1))
        before = _weights(module)
        cohort.backward(model.training_step(next(iter(DataLoader(_data(), batch_size=8))), 0))
        optimizer.step()
        assert not any(torch.equal(a, b) for a, b in zip(_weights(module), before)), made_before


def test_launch_runs_the_function_with_the_cohort_in_this_process():
    cohort = _cohort()
    assert cohort.launch(lambda c, x: (c is cohort, x * 2), 21) == (True, 42)
    with pytest.raises(RuntimeError, match="already called"):
        cohort.launch(lambda c: None)


def test_collectives_ranks_print_and_init_module_on_one_process(capsys):
    cohort = _cohort()
    assert (cohort.global_rank, cohort.world_size, cohort.is_global_zero, cohort.device) == (
        0,
        1,
        True,
        torch.device("cpu"),
    )
    assert cohort.all_reduce(3) == torch.tensor(3) and torch.equal(cohort.all_gather(torch.ones(2)), torch.ones(2))
    assert cohort.broadcast({"a": 1}) == {"a": 1}
    cohort.barrier()
    cohort.print("only", "rank zero")
    assert capsys.readouterr().out == "only rank zero\n"
    with cohort.init_module(empty_init=True):
        layer = nn.Linear(2, 2)
    assert layer.weight.device == cohort.device
    with cohort.autocast(), cohort.no_backward_sync(cohort.setup(layer)):
        pass


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda c, m, o: c.setup("not a module"), TypeError, "torch.nn.Module"),
        (lambda c, m, o: c.setup(m, "sgd"), TypeError, r"optimizers\[0\] must be a torch.optim.Optimizer"),
        (
            lambda c, m, o: c.setup(m, torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=1)),
            ValueError,
            "not a parameter of the module",
        ),
        (lambda c, m, o: c.backward(torch.ones(())), RuntimeError, "call cohort.setup"),
        (lambda c, m, o: c.setup_optimizers(o), RuntimeError, "setup_module"),
        (lambda c, m, o: c.save(1, {}), TypeError, "path must be a str or os.PathLike"),
        (lambda c, m, o: c.launch(3), TypeError, "takes a callable"),
    ],
)
def test_bad_calls_before_setup(call, error, match):
    module = Regressor()
    with pytest.raises(error, match=match):
        call(_cohort(), module, torch.optim.SGD(module.parameters(), lr=0.1))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda c, m, o, p: c.setup(nn.Linear(1, 1)), RuntimeError, "one Cohort runs one module"),
        (lambda c, m, o, p: c.setup(m), ValueError, "already set up"),
        (lambda c, m, o, p: c.backward(1.0), TypeError, "takes a tensor"),
        (lambda c, m, o, p: c.clip_gradients(m, o), ValueError, "exactly one of max_norm"),
        (lambda c, m, o, p: c.clip_gradients(m, o, max_norm=1, clip_val=1), ValueError, "exactly one of max_norm"),
        (
            lambda c, m, o, p: c.clip_gradients(nn.Linear(1, 1), o, max_norm=1),
            ValueError,
            "module returned by cohort.setup",
        ),
        (lambda c, m, o, p: c.no_backward_sync(nn.Linear(1, 1)), ValueError, "module returned by cohort.setup"),
        (lambda c, m, o, p: c.save(p, {"optimizer": o}), ValueError, "holds no module"),
        (lambda c, m, o, p: c.save(p, {"model": m, "other": nn.Linear(1, 1)}), ValueError, "did not set up"),
        (
            lambda c, m, o, p: c.save(p, {"model": m, "optimizer": torch.optim.SGD(m.parameters(), lr=1)}),
            ValueError,
            "optimizer this Cohort did not set up",
        ),
        (lambda c, m, o, p: c.save(p, {"model": m, "thing": object()}), TypeError, "holds a builtins.object"),
        (lambda c, m, o, p: c.save(p, ["model"]), TypeError, "state must be a dict"),
        (lambda c, m, o, p: c.setup_dataloaders(), ValueError, "at least one dataloader"),
        (lambda c, m, o, p: c.setup_dataloaders(3), TypeError, "iterables of batches"),
    ],
)
def test_bad_calls_after_setup(tmp_path, call, error, match):
    cohort = _cohort()
    module = Regressor()
    model, optimizer = cohort.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    path = tmp_path / "x.ckpt"
    with pytest.raises(error, match=match):
        call(cohort, model, optimizer, path)
    assert not path.exists()  # nothing half-written


@pytest.mark.parametrize(
    ("content", "state", "match"),
    [
        ({"state_dict": {}, "cohort": {"objects": {}}}, {"note": None}, "has no entry 'note'"),
        ({"weights": 1}, {}, "has no 'state_dict' entry"),
        ([1, 2], {}, "not a checkpoint dictionary"),
    ],
)
def test_load_refuses_checkpoints_that_do_not_fit(tmp_path, content, state, match):
    cohort = _cohort()
    model = cohort.setup(Regressor())
    path = tmp_path / "bad.ckpt"
    torch.save(content, path)
    with pytest.raises(CheckpointError, match=match):
        cohort.load(path, {"model": model, **state})
    assert path.exists()


def test_load_refuses_optimizer_states_of_another_shape(tmp_path):
    cohort = _cohort()
    module = Regressor()
    model, optimizer = cohort.setup(module, torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9))
    other = _cohort()
    small = nn.Linear(4, 1)
    small_model, small_optimizer = other.setup(small, torch.optim.SGD(small.parameters(), lr=0.1))
    other.save(tmp_path / "small.ckpt", {"model": small_model, "optimizer": small_optimizer})
    with pytest.raises(CheckpointError, match="optimizer_states"):
        cohort.load(tmp_path / "small.ckpt", {"optimizer": optimizer})


class _OneEngineStrategy(phalanx.strategies.SingleDeviceStrategy):
    """A strategy that, like DeepSpeed, can only set up the module together with its optimizers."""

    def declare_traits(self) -> StrategyTraits:
        return dataclasses.replace(super().declare_traits(), wraps_module_with_optimizers=True)


def test_setup_module_alone_is_refused_where_the_strategy_needs_the_optimizers_too():
    cohort = phalanx.Cohort(accelerator="cpu", strategy=_OneEngineStrategy(device=torch.device("cpu")))
    with pytest.raises(
        RuntimeError, match=r"_OneEngineStrategy builds one engine .* call cohort.setup\(module, optimizer\)"
    ):
        cohort.setup_module(Regressor())
    module = Regressor()
    model, optimizer = cohort.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))  # together is fine
    assert isinstance(model, CohortModule) and optimizer.param_groups[0]["lr"] == 0.1


def test_deepspeed_declares_that_it_needs_the_optimizers_with_the_module():
    from phalanx.strategies import DDPStrategy, DeepSpeedStrategy

    assert DeepSpeedStrategy(stage=2).traits.wraps_module_with_optimizers is True
    assert DDPStrategy().traits.wraps_module_with_optimizers is False
