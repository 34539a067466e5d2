"""BaseFinetuning and BackboneFinetuning: Lightning 2.6's weights, learning rates and parameter groups for a table of
settings (defaults on for one), its static helpers on the same modules, the refusals, and runs resumed after the
unfreezing (between epochs and inside one) that end as an uninterrupted one, Adam's state of the added group included.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
import torch
from phalanx_testing import quiet_trainer, regression_data
from torch import nn
from torch.utils.data import DataLoader

import phalanx
from phalanx.callbacks import BackboneFinetuning, BaseFinetuning
from phalanx.strategies import SingleDeviceStrategy
from phalanx.strategies.traits import StrategyTraits
from phalanx.utilities.exceptions import MisconfigurationError

EPOCHS = 4


def _loader(shuffle: bool = False) -> DataLoader:
    return DataLoader(regression_data(24), batch_size=4, shuffle=shuffle)  # 6 batches an epoch


def _layers() -> tuple[nn.Module, nn.Module]:
    backbone = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8))
    return backbone, nn.Linear(8, 1)


def _configure(module: Any, optimizer: str) -> Any:
    if optimizer == "adam_head":
        return torch.optim.Adam(module.head.parameters(), lr=0.01)
    if optimizer == "adam":
        return torch.optim.Adam(filter(lambda p: p.requires_grad, module.parameters()), lr=0.01)
    optimizer = torch.optim.SGD(filter(lambda p: p.requires_grad, module.parameters()), lr=0.05, momentum=0.9)
    return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)}


class Model(phalanx.TrainingModule):
    def __init__(self, optimizer: str = "adam") -> None:
        super().__init__()
        self.backbone, self.head = _layers()
        self.optimizer = optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.backbone(x)), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.head(self.backbone(x)), y))

    def configure_optimizers(self) -> Any:
        return _configure(self, self.optimizer)


def _lightning_twin(pl: Any, model: Model) -> Any:
    class Twin(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.backbone, self.head = copy.deepcopy(model.backbone), copy.deepcopy(model.head)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.head(self.backbone(x)), y)

        def configure_optimizers(self) -> Any:
            return _configure(self, model.optimizer)

    return Twin()


def _group_lrs(trainer: Any) -> list[float]:
    return [group["lr"] for group in trainer.optimizers[0].param_groups]


def _recorder(base: type) -> Any:
    class Record(base):  # type: ignore[misc, valid-type]
        """Each epoch's learning rates by parameter group, read in its first batch."""

        def __init__(self) -> None:
            self.lrs: list[list[float]] = []

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0:
                self.lrs.append(_group_lrs(trainer))

    return Record()


SETTINGS = [
    ({"unfreeze_backbone_at_epoch": 1}, "adam_head"),
    ({"unfreeze_backbone_at_epoch": 0, "backbone_initial_lr": 0.001, "should_align": False}, "adam"),
    ({"unfreeze_backbone_at_epoch": 2, "lambda_func": lambda epoch: 1.5, "train_bn": False}, "sgd"),
    ({"unfreeze_backbone_at_epoch": 1, "backbone_initial_ratio_lr": 0.5, "lambda_func": lambda e: 3.0}, "sgd"),
]


@pytest.mark.parametrize(("options", "optimizer"), SETTINGS, ids=["at 1", "at 0, no align", "train_bn=False", "align"])
def test_backbone_finetuning_trains_as_lightnings(tmp_path, options, optimizer):
    pl = pytest.importorskip("pytorch_lightning", reason="Lightning 2.6 is the oracle of this test")
    phalanx.seed_everything(0)
    model = Model(optimizer)
    twin = _lightning_twin(pl, model)
    ours, theirs = _recorder(phalanx.Callback), _recorder(pl.Callback)
    trainer = quiet_trainer(max_epochs=EPOCHS, callbacks=[BackboneFinetuning(**options), ours])
    trainer.fit(model, _loader())
    lightning = pl.Trainer(
        accelerator="cpu", max_epochs=EPOCHS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
        callbacks=[pl.callbacks.BackboneFinetuning(**options), theirs],
    )  # fmt: skip
    lightning.fit(twin, _loader())
    assert [len(lrs) for lrs in ours.lrs] == [len(lrs) for lrs in theirs.lrs] and len(ours.lrs[-1]) == 2
    assert sum(ours.lrs, []) == pytest.approx(sum(theirs.lrs, []), rel=1e-9)
    assert trainer.global_step == lightning.global_step
    pairs = zip(model.state_dict().values(), twin.state_dict().values())
    assert all(torch.allclose(a.float(), b.float(), atol=1e-6) for a, b in pairs)
    assert [p.requires_grad for p in model.parameters()] == [p.requires_grad for p in twin.parameters()]


def _nested() -> nn.Module:
    return nn.ModuleDict(
        {"a": nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)), "b": nn.ModuleList([nn.Linear(3, 3), nn.ReLU()])}
    )


@pytest.mark.parametrize("train_bn", [True, False])
@pytest.mark.parametrize("requires_grad", [True, False])
def test_the_static_helpers_select_and_freeze_as_lightnings(train_bn, requires_grad):
    pl = pytest.importorskip("pytorch_lightning", reason="Lightning 2.6 is the oracle of this test")
    theirs_helpers = pl.callbacks.BaseFinetuning
    ours, theirs = _nested(), _nested()
    assert len(BaseFinetuning.flatten_modules(ours)) == len(theirs_helpers.flatten_modules(theirs)) == 4
    BaseFinetuning.freeze([ours["a"], [ours["b"]]], train_bn=train_bn)
    theirs_helpers.freeze([theirs["a"], [theirs["b"]]], train_bn=train_bn)
    assert [p.requires_grad for p in ours.parameters()] == [p.requires_grad for p in theirs.parameters()]
    assert ours["a"][1].track_running_stats == theirs["a"][1].track_running_stats == train_bn
    names = {id(p): n for n, p in ours.named_parameters()}
    their_names = {id(p): n for n, p in theirs.named_parameters()}
    selected = [names[id(p)] for p in BaseFinetuning.filter_params(ours, train_bn, requires_grad)]
    assert selected == [their_names[id(p)] for p in theirs_helpers.filter_params(theirs, train_bn, requires_grad)]
    BaseFinetuning.make_trainable(ours)
    assert all(p.requires_grad for p in ours.parameters()) and ours["a"][1].track_running_stats


class TwoStages(BaseFinetuning):
    """Unfreezes the backbone's last layer at epoch 1 and its first at epoch 2, each in a group of its own."""

    def freeze_before_training(self, module: Any) -> None:
        self.freeze(module.backbone, train_bn=False)

    def finetune_function(self, module: Any, epoch: int, optimizer: Any) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(module.backbone[3], optimizer, lr=0.002)
        elif epoch == 2:
            self.unfreeze_and_add_param_group(module.backbone[:2], optimizer, train_bn=True)


def test_a_subclass_adds_groups_as_it_unfreezes_and_keeps_them_in_the_checkpoint(tmp_path):
    model = Model()
    trainer = phalanx.Trainer(accelerator="cpu", max_epochs=3, default_root_dir=tmp_path, callbacks=[TwoStages()])
    trainer.fit(model, _loader(), DataLoader(regression_data(8), batch_size=4))
    assert _group_lrs(trainer) == pytest.approx([0.01, 0.002, 0.001])  # the first group's lr / initial_denom_lr
    (path,) = tmp_path.rglob("*.ckpt")
    state = next(v for k, v in torch.load(path, weights_only=True)["callbacks"].items() if "TwoStages" in k)
    groups = state["internal_optimizer_metadata"][0]
    assert [group["params"] for group in groups] == [
        ["head.weight", "head.bias"],
        ["backbone.3.weight", "backbone.3.bias"],
        ["backbone.0.weight", "backbone.0.bias", "backbone.1.weight", "backbone.1.bias"],
    ]
    assert state["frozen"] == {"parameters": [], "batch_norms": []}


def test_unfreezing_what_the_optimizer_holds_skips_it_with_a_warning():
    layer = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match=r"2 parameter\(s\) to unfreeze are already in a parameter group"):
        BaseFinetuning.unfreeze_and_add_param_group(layer, optimizer)
    assert len(optimizer.param_groups) == 1


class AccumulatesInEngine(SingleDeviceStrategy):
    """A strategy that keeps the optimizer inside its engine (as DeepSpeed does)."""

    def declare_traits(self) -> StrategyTraits:
        return replace(super().declare_traits(), wraps_module_with_optimizers=True)


class NoBackbone(Model):
    def __init__(self) -> None:
        super().__init__()
        self.features = self.__dict__["_modules"].pop("backbone")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.features(x)), y)


@pytest.mark.parametrize(
    ("model", "options", "error", "message"),
    [
        (NoBackbone, {}, MisconfigurationError, "BackboneFinetuning needs NoBackbone.backbone, an nn.Module"),
        (Model, {"strategy": AccumulatesInEngine()}, NotImplementedError, "which AccumulatesInEngine keeps inside"),
    ],
    ids=["no backbone", "an engine that holds the optimizer"],
)
def test_a_run_it_cannot_finetune_is_refused_at_setup(model, options, error, message):
    trainer = quiet_trainer(max_epochs=1, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=0)], **options)
    with pytest.raises(error, match=message):
        trainer.fit(model(), _loader())
    assert trainer.global_step == 0


class Interrupt(phalanx.Callback):
    """Saves a checkpoint after batch ``at_batch`` (counted over the fit) and stops the run."""

    def __init__(self, at_batch: int, path: str) -> None:
        self.at_batch, self.path, self.seen = at_batch, path, 0

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen += 1
        if self.seen == self.at_batch:
            trainer.save_checkpoint(self.path)
            raise KeyboardInterrupt


def _finetuned(optimizer: str, ckpt_path: str | None = None, callbacks: tuple = (), seed: int = 5) -> tuple:
    phalanx.seed_everything(seed)
    model = Model(optimizer)
    trainer = quiet_trainer(max_epochs=EPOCHS, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1), *callbacks])
    trainer.fit(model, _loader(shuffle=True), ckpt_path=ckpt_path)
    return [t.detach().clone() for t in model.state_dict().values()], trainer


# "adam_head" leaves the backbone's batch-norm layer (which freeze() leaves trainable) outside the optimizer until the
# unfreezing: the gradients it gathers until then are no checkpoint's, and must not reach the first step after.
# After batch 6: the end of epoch 0 (unfreezing next); 9: inside epoch 1, the first with the backbone's group; 20:
# inside epoch 3, after two learning-rate increases
@pytest.mark.parametrize("optimizer", ["adam_head", "sgd"])
@pytest.mark.parametrize("at_batch", [6, 9, 20])
def test_a_resume_after_the_unfreezing_ends_as_the_uninterrupted_run(tmp_path, optimizer, at_batch):
    reference, finished = _finetuned(optimizer)
    path = str(tmp_path / "interrupted.ckpt")
    with pytest.raises(KeyboardInterrupt):
        _finetuned(optimizer, callbacks=(Interrupt(at_batch, path),))
    resumed, trainer = _finetuned(optimizer, ckpt_path=path, seed=123)
    assert trainer.global_step == finished.global_step == EPOCHS * 6
    assert _group_lrs(trainer) == _group_lrs(finished)
    assert all(torch.equal(a, b) for a, b in zip(resumed, reference))
