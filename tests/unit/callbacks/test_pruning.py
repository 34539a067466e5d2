"""ModelPruning: layer by layer it prunes as Lightning's does (same weights, same checkpoints); its checkpoints hold the
pruned weights under the module's names (``weights_only=True`` loadable) and the masks in its state, so that a fit
resumed after any epoch ends exactly as the uninterrupted one; the lottery ticket resets the kept weights to their
initial values at every pruning; strategies that shard the parameters are refused when fit starts."""

from __future__ import annotations

import logging
from dataclasses import replace

import callback_project as project
import pytest
import torch
import torch.nn.utils.prune as torch_prune
from phalanx_testing import Regressor, loaders, quiet_trainer

import phalanx
from phalanx.callbacks import ModelPruning
from phalanx.utilities.exceptions import MisconfigurationError


def _weights(summary: dict) -> dict[str, torch.Tensor]:
    return {name: torch.tensor(value) for name, value in summary["weights"].items()}


def _same_weights(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert torch.allclose(ours[name], theirs[name]), name


def test_layer_by_layer_it_prunes_as_lightning_does(tmp_path):
    pytest.importorskip("pytorch_lightning", reason="pytorch-lightning is the oracle of this row")
    theirs = project.run("lightning", "pruning_local", tmp_path / "lightning")
    ours = project.run("phalanx", "pruning_local", tmp_path / "phalanx")
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-6)
    _same_weights(_weights(ours), _weights(theirs))
    assert ours["files"] == theirs["files"]
    for epoch in range(project.EPOCHS):
        mine = torch.load(tmp_path / "phalanx" / "ckpt" / f"epoch={epoch}.ckpt", weights_only=True)["state_dict"]
        their = torch.load(tmp_path / "lightning" / "ckpt" / f"epoch={epoch}.ckpt", weights_only=False)["state_dict"]
        _same_weights(mine, their)
    # 30% of each weight per epoch, of what is left: 1 - 0.7**3 of it is zero in the end.
    weight = _weights(ours)["net.0.weight"]
    assert (weight == 0).sum() == 32 - 11


@pytest.mark.parametrize("case", ["pruning", "pruning_local"])
@pytest.mark.parametrize("epoch", [0, 1])
def test_a_fit_resumed_after_any_epoch_ends_exactly_as_the_whole_one(tmp_path, case, epoch):
    whole = project.run("phalanx", case, tmp_path / "whole")
    checkpoint = tmp_path / "whole" / "ckpt" / f"epoch={epoch}.ckpt"
    state = torch.load(checkpoint, weights_only=True)
    assert all(not key.endswith(("_orig", "_mask")) for key in state["state_dict"])  # the module's own names
    assert set(state["callbacks"]["ModelPruning"]["masks"]) == {"net.0.weight", "net.2.weight"} | (
        {"net.0.bias", "net.2.bias"} if case == "pruning" else set()
    )
    resumed = project.run("phalanx", case, tmp_path / "resumed", ckpt_path=str(checkpoint))
    assert resumed["losses"] == pytest.approx(whole["losses"][10 * (epoch + 1) :], rel=1e-6)
    _same_weights(_weights(resumed), _weights(whole))


def test_the_lottery_ticket_resets_the_kept_weights_to_their_initial_values_at_every_pruning():
    torch.manual_seed(0)
    model = Regressor()
    initial = model.net[0].weight.detach().clone()
    pruning = ModelPruning("l1_unstructured", parameters_to_prune=[(model.net[0], "weight")], amount=0.25)
    trainer = quiet_trainer(max_epochs=2, callbacks=[pruning, _Probe()])
    trainer.fit(model, *loaders())
    for mask, kept in _Probe.seen:  # after each epoch's pruning: kept weights are the initial ones
        assert torch.equal(kept[mask == 1], initial[mask == 1])
    assert len(_Probe.seen) == 2 and int((_Probe.seen[1][0] == 0).sum()) > int((_Probe.seen[0][0] == 0).sum())


class _Probe(phalanx.Callback):
    seen: list = []

    def on_train_epoch_end(self, trainer, module):
        layer = module.net[0]
        type(self).seen.append((layer.weight_mask.clone(), layer.weight_orig.detach().clone()))


def test_with_the_defaults_the_checkpoints_load_into_the_plain_module(tmp_path):
    trainer = phalanx.Trainer(
        accelerator="cpu",
        max_epochs=2,
        default_root_dir=tmp_path,
        callbacks=[ModelPruning("l1_unstructured", amount=0.5)],
    )
    model = Regressor()
    trainer.fit(model, *loaders())
    assert not any(key.endswith(("_orig", "_mask")) for key in model.state_dict())  # made permanent at the end
    plain = Regressor.load_from_checkpoint(trainer.checkpoint_callback.best_model_path)
    _same_weights(plain.state_dict(), model.state_dict())
    assert (plain.net[0].weight == 0).float().mean() >= 0.5


def test_without_make_pruning_permanent_the_checkpoint_keeps_lightnings_names(tmp_path):
    model = Regressor()
    pruning = ModelPruning("random_unstructured", amount=2, make_pruning_permanent=False, parameter_names=["weight"])
    trainer = quiet_trainer(max_epochs=1, callbacks=[pruning])
    trainer.fit(model, *loaders())
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    keys = set(torch.load(tmp_path / "model.ckpt", weights_only=True)["state_dict"])
    assert {"net.0.weight_orig", "net.0.weight_mask", "net.0.bias"} <= keys and "net.0.weight" not in keys
    assert int((model.net[0].weight_mask == 0).sum()) == 2


def test_verbose_logs_the_sparsity(caplog):
    trainer = quiet_trainer(max_epochs=1, callbacks=[ModelPruning("l1_unstructured", amount=0.5, verbose=2)])
    with caplog.at_level(logging.INFO, logger="phalanx.callbacks.pruning"):
        trainer.fit(Regressor(), *loaders())
    assert "Applied `L1Unstructured`. Pruned: 0/97 (0.00%) -> 48/97 (49.48%)" in caplog.text
    assert "to `Linear(in_features=4, out_features=16, bias=True).weight` with amount=0.5" in caplog.text


def test_a_strategy_whose_engine_owns_the_parameters_is_refused_when_fit_starts(monkeypatch):
    trainer = quiet_trainer(max_epochs=1, callbacks=[ModelPruning("l1_unstructured")])
    traits = replace(trainer.strategy.traits, wraps_module_with_optimizers=True)
    monkeypatch.setattr(type(trainer.strategy), "traits", property(lambda self: traits))
    with pytest.raises(MisconfigurationError, match="ModelPruning cannot prune under SingleDeviceStrategy: .* engine"):
        trainer.fit(Regressor(), *loaders())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"pruning_fn": "l3_unstructured"}, "is not one of torch's pruning functions"),
        ({"pruning_fn": "ln_structured", "use_global_unstructured": False}, "pass pruning_dim"),
        ({"pruning_fn": "ln_structured", "pruning_dim": 0, "use_global_unstructured": False}, "needs pruning_norm"),
        ({"pruning_fn": "random_structured", "pruning_dim": 0}, "needs an unstructured method"),
        ({"pruning_fn": torch_prune.L1Unstructured, "use_global_unstructured": False}, "needs use_global_unstructured"),
        ({"pruning_fn": torch_prune.L1Unstructured(0.1)}, "the class, not an instance"),
        ({"pruning_fn": "l1_unstructured", "parameter_names": ["kernel"]}, r"choose among \['weight', 'bias'\]"),
        ({"pruning_fn": "l1_unstructured", "amount": "half"}, "amount='half' is not valid"),
        ({"pruning_fn": "l1_unstructured", "verbose": 3}, "verbose=3 is not valid; choose 0, 1 or 2"),
    ],
)
def test_bad_arguments_are_refused_naming_the_valid_ones(kwargs, match):
    with pytest.raises(MisconfigurationError, match=match):
        ModelPruning(**kwargs)


def test_parameters_outside_the_model_are_refused_at_set_up():
    other = torch.nn.Linear(2, 2)
    trainer = quiet_trainer(
        max_epochs=1, callbacks=[ModelPruning("l1_unstructured", parameters_to_prune=[(other, "weight")])]
    )
    with pytest.raises(MisconfigurationError, match=r"not in the model: missing modules \['Linear'\]"):
        trainer.fit(Regressor(), *loaders())
