"""``save_last=True`` always leaves ``last.ckpt`` holding the final state, whichever save points the run had."""

from __future__ import annotations

import os

import pytest
import torch
from phalanx_testing import Regressor, loaders, quiet_trainer

from phalanx.callbacks import ModelCheckpoint

CASES = [
    ("max_steps stops mid-epoch", dict(), dict(max_steps=5)),
    ("every_n_epochs beyond the run", dict(every_n_epochs=10), dict(max_epochs=2)),
    ("save_top_k=0", dict(save_top_k=0), dict(max_epochs=2)),
    ("no validation, no save at train epoch end", dict(save_on_train_epoch_end=False), dict(max_epochs=2)),
    ("every_n_train_steps that misses the end", dict(every_n_train_steps=3), dict(max_steps=10)),
]


@pytest.mark.parametrize(
    ("checkpoint_options", "trainer_options"), [case[1:] for case in CASES], ids=[case[0] for case in CASES]
)
def test_last_checkpoint_holds_the_final_state(tmp_path, checkpoint_options, trainer_options):
    callback = ModelCheckpoint(dirpath=tmp_path, save_last=True, **checkpoint_options)
    trainer = quiet_trainer(callbacks=[callback], enable_checkpointing=True, **trainer_options)
    model = Regressor()
    trainer.fit(model, loaders()[0])
    assert "last.ckpt" in os.listdir(tmp_path)
    last = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert last["global_step"] == trainer.global_step
    assert all(torch.equal(last["state_dict"][name], value) for name, value in model.state_dict().items())
