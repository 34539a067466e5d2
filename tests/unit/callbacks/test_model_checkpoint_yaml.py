"""ModelCheckpoint.to_yaml writes YAML that loads back (yaml.safe_load) to best_k_models' paths and scores."""

from __future__ import annotations

import math

import pytest
import torch
from phalanx_testing import Regressor, loaders, quiet_trainer

from phalanx.callbacks import ModelCheckpoint

yaml = pytest.importorskip("yaml")

SCORES = [
    {},
    {"/ckpts/epoch=0-step=4.ckpt": 0.5},
    {"/ckpts/a.ckpt": math.inf, "/ckpts/b.ckpt": -math.inf},
    {"/ckpts/a.ckpt": 1e-05, "/ckpts/b.ckpt": 1e20, "/ckpts/c.ckpt": -2.0},
    {"/ckpts/odd: name #1 'quoted' \"double\" ü.ckpt": 3.25, "relative/true.ckpt": 0.0},
    {"/ckpts/a.ckpt": 3},  # an integer-valued monitor
]


@pytest.mark.parametrize("scores", SCORES)
def test_to_yaml_loads_back_to_the_same_values(tmp_path, scores):
    callback = ModelCheckpoint(dirpath=tmp_path)
    # float64 scores, so that each value is exactly the Python number of the table
    callback.best_k_models = {
        path: torch.tensor(score, dtype=torch.float64 if isinstance(score, float) else None)
        for path, score in scores.items()
    }
    callback.to_yaml()
    loaded = yaml.safe_load((tmp_path / "best_k_models.yaml").read_text(encoding="utf-8"))
    assert loaded == scores
    assert all(type(loaded[path]) is type(score) for path, score in scores.items())


def test_to_yaml_of_a_nan_score_loads_back_as_nan(tmp_path):
    callback = ModelCheckpoint(dirpath=tmp_path)
    callback.best_k_models = {"/ckpts/a.ckpt": torch.tensor(math.nan)}
    callback.to_yaml(tmp_path / "scores.yaml")
    assert math.isnan(yaml.safe_load((tmp_path / "scores.yaml").read_text())["/ckpts/a.ckpt"])


def test_to_yaml_after_fit_names_the_saved_checkpoints(tmp_path):
    callback = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=2)
    train, val = loaders(32)
    quiet_trainer(default_root_dir=tmp_path, max_epochs=3, callbacks=[callback], enable_checkpointing=True).fit(
        Regressor(), train, val
    )
    callback.to_yaml()
    loaded = yaml.safe_load((tmp_path / "best_k_models.yaml").read_text())
    assert loaded == {path: pytest.approx(score.item()) for path, score in callback.best_k_models.items()}
    assert len(loaded) == 2
