"""A real checkpoint with one entry damaged is refused with one CheckpointError naming the file and the entry,
before anything of the live model, optimizer or loops changes (fit) or any module is returned (load_from_checkpoint)."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from phalanx_testing import Regressor, loaders, parameters_of, quiet_trainer, same_parameters

from phalanx.callbacks import EarlyStopping
from phalanx.utilities.exceptions import CheckpointError

EARLY_STOPPING_KEY = "EarlyStopping{'monitor': 'train_loss', 'mode': 'min'}"


class Resumable(Regressor):
    """SGD with momentum (per-parameter state) and a StepLR: every kind of entry a checkpoint holds."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)}


def make_trainer(max_epochs: int = 2) -> Any:
    return quiet_trainer(max_epochs=max_epochs, callbacks=[EarlyStopping(monitor="train_loss", patience=5)])


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    trainer = make_trainer(max_epochs=1)
    trainer.fit(Resumable(), loaders(n=32)[0])
    path = tmp_path_factory.mktemp("good") / "good.ckpt"
    trainer.save_checkpoint(path)
    return torch.load(path, weights_only=True)


def _adam_state() -> dict[str, Any]:
    model = Regressor()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return optimizer.state_dict()


def _cosine_state() -> dict[str, Any]:
    optimizer = torch.optim.SGD(Regressor().parameters(), lr=0.1)
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=3).state_dict()


def _set(*keys: Any, value: Any) -> Callable[[dict], None]:
    def change(checkpoint: dict) -> None:
        target = checkpoint
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return change


def _drop(*keys: Any) -> Callable[[dict], None]:
    def change(checkpoint: dict) -> None:
        target = checkpoint
        for key in keys[:-1]:
            target = target[key]
        del target[keys[-1]]

    return change


def _apply(function: Callable[[dict], Any]) -> Callable[[dict], None]:
    return function


GROUP = ("optimizer_states", 0, "param_groups", 0)
LOOP = ("loops", "fit_loop")
RNG = ("rng_states", 0)
# (name, change, fragment of the message after the file name, refused before the weights are loaded)
DAMAGE = [
    (
        "global_step a string",
        _set("global_step", value="5"),
        "checkpoint['global_step'] holds str '5'; expected an int >= 0",
    ),
    ("negative epoch", _set("epoch", value=-1), "checkpoint['epoch'] holds int -1"),
    (
        "top-level step disagrees with the loop",
        _set("global_step", value=999),
        "checkpoint['global_step'] is 999, but checkpoint['loops']['fit_loop']['global_step'] is",
    ),
    ("loops missing", _drop("loops"), "checkpoint['loops'] holds None; expected a dict"),
    ("fit_loop missing", _set("loops", value={}), "checkpoint['loops']['fit_loop'] holds None"),
    ("loop epoch missing", _drop(*LOOP, "epoch"), "checkpoint['loops']['fit_loop']['epoch'] is missing"),
    ("loop global_step a float", _set(*LOOP, "global_step", value=2.5), "['fit_loop']['global_step'] holds float 2.5"),
    ("loop batches_done negative", _set(*LOOP, "batches_done", value=-3), "['batches_done'] holds int -3"),
    ("loop batches_stepped a string", _set(*LOOP, "batches_stepped", value="7"), "['batches_stepped'] holds str '7'"),
    (
        "loop step_pending not a bool",
        _set(*LOOP, "step_pending", value="yes"),
        "['step_pending'] holds str 'yes'; expected True or False",
    ),
    (
        "loop epoch_open not a bool",
        _set(*LOOP, "epoch_open", value=1),
        "['epoch_open'] holds int 1; expected True or False",
    ),
    (
        "loop phase unknown",
        _set(*LOOP, "phase", value="middle"),
        "['phase'] holds str 'middle'; expected one of ['batches'",
    ),
    (
        "loop epoch_start_rng garbage",
        _set(*LOOP, "epoch_start_rng", value={"torch": 1}),
        "['epoch_start_rng']['python'] is missing",
    ),
    (
        "loop callback_metrics a list",
        _set(*LOOP, "callback_metrics", value=[1, 2]),
        "['callback_metrics'] holds list; expected a dict",
    ),
    ("rng_states missing", _drop("rng_states"), "checkpoint['rng_states'] is missing"),
    (
        "rng_states a string",
        _set("rng_states", value="garbage"),
        "checkpoint['rng_states'] holds str 'garbage'; expected a list",
    ),
    ("rng_states empty", _set("rng_states", value=[]), "checkpoint['rng_states'] is an empty list"),
    (
        "torch generator state too short",
        _set(*RNG, "torch", value=torch.zeros(10, dtype=torch.uint8)),
        "['rng_states'][0]['torch'] is not a torch generator state",
    ),
    (
        "torch generator state not a tensor",
        _set(*RNG, "torch", value="abc"),
        "['torch'] holds str 'abc'; expected a uint8 tensor",
    ),
    (
        "python generator state garbage",
        _set(*RNG, "python", value=[3, [1, 2], None]),
        "['rng_states'][0]['python'] is not a state of Python's random module",
    ),
    ("python generator state missing", _drop(*RNG, "python"), "['rng_states'][0]['python'] is missing"),
    (
        "numpy generator state garbage",
        _set(*RNG, "numpy", value=["MT19937", [1], 0, 0, 0.0]),
        "['rng_states'][0]['numpy'] is not a state of numpy's random generator",
    ),
    ("cuda generator states garbage", _set(*RNG, "torch.cuda", value=[3]), "['torch.cuda'][0] holds int 3"),
    ("xla generator state a string", _set(*RNG, "xla", value="seed"), "['rng_states'][0]['xla'] holds str 'seed'"),
    ("xla generator state negative", _set(*RNG, "xla", value=-1), "['rng_states'][0]['xla'] holds int -1"),
    ("xla generator state too big", _set(*RNG, "xla", value=2**64), "expected the XLA generator's seed"),
    ("xla generator state a tensor", _set(*RNG, "xla", value=torch.ones(2)), "['rng_states'][0]['xla'] holds"),
    (
        "optimizer_states a string",
        _set("optimizer_states", value="x"),
        "checkpoint['optimizer_states'] holds str 'x'; expected a list",
    ),
    (
        "no optimizer state",
        _set("optimizer_states", value=[]),
        "holds 0 optimizer state(s), but configure_optimizers created 1",
    ),
    (
        "another optimizer class",
        _set("optimizer_states", 0, value=_adam_state()),
        "is the state of another optimizer class than SGD",
    ),
    (
        "two parameter groups",
        _apply(
            lambda c: c["optimizer_states"][0]["param_groups"].append(dict(c["optimizer_states"][0]["param_groups"][0]))
        ),
        "holds 2 parameter group(s), but the SGD has 1",
    ),
    (
        "a parameter too few",
        _apply(lambda c: c["optimizer_states"][0]["param_groups"][0]["params"].pop()),
        "lists 3 parameter(s), but that group of the SGD has 4",
    ),
    (
        "lr a string",
        _set(*GROUP, "lr", value="fast"),
        "['param_groups'][0]['lr'] holds str 'fast', but the SGD has float",
    ),
    ("lr NaN", _set(*GROUP, "lr", value=math.nan), "['lr'] holds float nan"),
    (
        "momentum buffer of another shape",
        _set("optimizer_states", 0, "state", 0, "momentum_buffer", value=torch.zeros(3, 3)),
        "['state'][0]['momentum_buffer'] has shape [3, 3], but its parameter has [16, 4]",
    ),
    (
        "state of an unknown parameter",
        _set("optimizer_states", 0, "state", 99, value={"momentum_buffer": torch.zeros(1)}),
        "['state'][99] belongs to no parameter",
    ),
    (
        "optimizer state without 'state'",
        _drop("optimizer_states", 0, "state"),
        "['optimizer_states'][0]['state'] holds None; expected a dict",
    ),
    (
        "no scheduler state",
        _set("lr_schedulers", value=[]),
        "holds 0 LR scheduler state(s), but configure_optimizers created 1",
    ),
    (
        "another scheduler class",
        _set("lr_schedulers", 0, value=_cosine_state()),
        "is the state of another scheduler than StepLR",
    ),
    (
        "scheduler last_epoch a string",
        _set("lr_schedulers", 0, "last_epoch", value="1"),
        "['lr_schedulers'][0]['last_epoch'] holds str '1'; expected an int",
    ),
    (
        "scheduler _last_lr of more groups than the optimizer has",
        _set("lr_schedulers", 0, "_last_lr", value=[0.1, 0.1, 0.1]),
        "['lr_schedulers'][0]['_last_lr'] holds list; expected 1 number(s), one per parameter group",
    ),
    (
        "lr_schedulers a dict",
        _set("lr_schedulers", value={"a": 1}),
        "checkpoint['lr_schedulers'] holds dict; expected a list",
    ),
    (
        "weights lack a key",
        _drop("state_dict", "net.0.weight"),
        "checkpoint['state_dict'] lacks 1 key(s): 'net.0.weight' (strict loading into Resumable)",
    ),
    (
        "weights have an extra key",
        _set("state_dict", "extra", value=torch.ones(1)),
        "has 1 key(s): 'extra', which Resumable does not have",
    ),
    (
        "weights of another shape",
        _set("state_dict", "net.0.weight", value=torch.zeros(16, 5)),
        "['state_dict']['net.0.weight'] has shape [16, 5], but Resumable has [16, 4] there",
    ),
    (
        "a weight not a tensor",
        _set("state_dict", "net.0.bias", value="zeros"),
        "['state_dict']['net.0.bias'] holds str 'zeros'; expected a tensor",
    ),
    ("state_dict a list", _set("state_dict", value=[1, 2]), "checkpoint['state_dict'] holds list; expected a dict"),
    ("state_dict missing", _drop("state_dict"), "has no 'state_dict' entry"),
    ("callbacks a list", _set("callbacks", value=[]), "checkpoint['callbacks'] holds list; expected a dict"),
    ("a callback state a string", _set("callbacks", EARLY_STOPPING_KEY, value="x"), "holds str 'x'; expected a dict"),
    (
        "precision_plugin a string",
        _set("precision_plugin", value="x"),
        "checkpoint['precision_plugin'] holds str 'x'; expected a dict",
    ),
    ("datamodule state an int", _set("datamodule", value=5), "checkpoint['datamodule'] holds int 5; expected a dict"),
    (
        "hyper_parameters a list",
        _set("hyper_parameters", value=[1]),
        "checkpoint['hyper_parameters'] holds list; expected a dict",
    ),
    (
        "no optimizer states at all",
        _drop("optimizer_states"),
        "was saved with weights_only=True and holds no optimizer or loop state",
    ),
    (
        "no optimizer states, and why",
        lambda checkpoint: (
            checkpoint.pop("optimizer_states"),
            checkpoint.update(optimizer_states_omitted="the optimizer state of X could not be mapped"),
        ),
        "holds no optimizer state: the optimizer state of X could not be mapped, so training cannot resume",
    ),
]


def _write(checkpoint: dict, change: Callable[[dict], None], path: Path) -> Path:
    damaged = copy.deepcopy(checkpoint)
    change(damaged)
    torch.save(damaged, path)
    return path


def test_the_undamaged_checkpoint_resumes(saved, tmp_path):
    trainer = make_trainer()
    trainer.fit(Resumable(), loaders(n=32)[0], ckpt_path=_write(saved, lambda c: None, tmp_path / "good.ckpt"))
    assert trainer.global_step == 8 and trainer.current_epoch == 2


@pytest.mark.parametrize(("change", "fragment"), [row[1:] for row in DAMAGE], ids=[row[0] for row in DAMAGE])
def test_fit_refuses_a_damaged_checkpoint_before_changing_anything(saved, tmp_path, change, fragment):
    path = _write(saved, change, tmp_path / "damaged.ckpt")
    model = Resumable()
    before = parameters_of(model)
    trainer = make_trainer()
    with pytest.raises(CheckpointError) as raised:
        trainer.fit(model, loaders(n=32)[0], ckpt_path=path)
    message = str(raised.value)
    assert message.startswith(str(path)) and fragment in message
    assert "\n" not in message
    assert same_parameters(before, parameters_of(model))
    assert trainer.global_step == 0 and trainer.current_epoch == 0
    assert all(not optimizer.state for optimizer in trainer.optimizers)
    assert all(config.scheduler.last_epoch == 0 for config in trainer.lr_scheduler_configs)
    assert trainer.early_stopping_callback.wait_count == 0


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (
            _set("callbacks", EARLY_STOPPING_KEY, "wait_count", value=-1),
            f"checkpoint['callbacks'][\"{EARLY_STOPPING_KEY}\"] could not be restored",
        ),
        (_drop("callbacks", EARLY_STOPPING_KEY, "best_score"), "the EarlyStopping state lacks ['best_score']"),
    ],
)
def test_a_damaged_callback_state_names_its_entry(saved, tmp_path, change, fragment):
    # Callbacks check their own state when it is applied, after the weights: the loops are still untouched.
    path = _write(saved, change, tmp_path / "damaged.ckpt")
    trainer = make_trainer()
    with pytest.raises(CheckpointError) as raised:
        trainer.fit(Resumable(), loaders(n=32)[0], ckpt_path=path)
    assert str(raised.value).startswith(str(path)) and fragment in str(raised.value)
    assert trainer.global_step == 0 and trainer.current_epoch == 0


def test_a_checkpoint_taken_further_into_an_epoch_than_the_data_reaches_is_refused(saved, tmp_path):
    path = _write(saved, _set(*LOOP, "batches_done", value=50), tmp_path / "far.ckpt")
    with pytest.raises(
        CheckpointError, match="resumes after batch 50 of epoch 1, but the training data has only 4 batches"
    ):
        make_trainer().fit(Resumable(), loaders(n=32)[0], ckpt_path=path)


def test_a_checkpoint_holding_a_list_is_refused(tmp_path):
    path = tmp_path / "list.ckpt"
    torch.save([1, 2, 3], path)
    with pytest.raises(CheckpointError, match="holds a list, not a checkpoint dictionary"):
        make_trainer().fit(Resumable(), loaders(n=32)[0], ckpt_path=path)
    with pytest.raises(CheckpointError, match="holds a list, not a checkpoint dictionary"):
        Resumable.load_from_checkpoint(path)


LOAD_NAMES = (
    "global_step a string",
    "negative epoch",
    "hyper_parameters a list",
    "state_dict a list",
    "state_dict missing",
    "a weight not a tensor",
    "weights lack a key",
    "weights have an extra key",
    "weights of another shape",
)
LOAD_DAMAGE = [row for row in DAMAGE if row[0] in LOAD_NAMES]


@pytest.mark.parametrize(("change", "fragment"), [row[1:] for row in LOAD_DAMAGE], ids=[row[0] for row in LOAD_DAMAGE])
def test_load_from_checkpoint_refuses_damaged_weights_and_fields(saved, tmp_path, change, fragment):
    path = _write(saved, change, tmp_path / "damaged.ckpt")
    with pytest.raises(CheckpointError) as raised:
        Resumable.load_from_checkpoint(path)
    assert str(raised.value).startswith(str(path)) and fragment in str(raised.value)


@pytest.mark.parametrize("value", ["sixteen", -4])
def test_load_from_checkpoint_names_unusable_hyper_parameters(saved, tmp_path, value):
    path = _write(saved, _set("hyper_parameters", "hidden", value=value), tmp_path / "hparams.ckpt")
    with pytest.raises(CheckpointError, match=r"Resumable\(\*\*checkpoint\['hyper_parameters'\]\) failed") as raised:
        Resumable.load_from_checkpoint(path)
    assert "pass corrected values as keyword arguments" in str(raised.value)
    assert Resumable.load_from_checkpoint(path, hidden=16).net[0].weight.shape == (16, 4)


def test_load_from_checkpoint_without_strict_accepts_missing_keys_but_not_wrong_shapes(saved, tmp_path):
    path = _write(saved, _drop("state_dict", "net.3.bias"), tmp_path / "partial.ckpt")
    model = Resumable.load_from_checkpoint(path, strict=False)
    assert torch.equal(model.net[0].weight, saved["state_dict"]["net.0.weight"])
    path = _write(saved, _set("state_dict", "net.0.weight", value=torch.zeros(2, 2)), tmp_path / "shape.ckpt")
    with pytest.raises(CheckpointError, match="has shape \\[2, 2\\], but Resumable has \\[16, 4\\]"):
        Resumable.load_from_checkpoint(path, strict=False)
