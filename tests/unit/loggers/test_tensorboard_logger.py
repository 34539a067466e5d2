import importlib.util
import os
import pickle
import sys

import pytest
import torch

from phalanx.loggers import Logger, TensorBoardLogger
from phalanx.utilities.rank_zero import rank_zero_only


@pytest.fixture(autouse=True)
def _rank_zero(monkeypatch):
    monkeypatch.setattr(rank_zero_only, "rank", 0)


def _event_files(folder):
    return [name for name in os.listdir(folder) if name.startswith("events.out.tfevents")]


def _scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(os.fspath(folder))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


@pytest.fixture
def no_tensorboard(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "tensorboard" or name.startswith("tensorboard."):
            return None
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_missing_package_error_at_construction(tmp_path, no_tensorboard):
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'phalanx\[tensorboard\]'.*CSVLogger"):
        TensorBoardLogger(tmp_path)
    assert not os.listdir(tmp_path)


def test_missing_package_error_via_sys_modules(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ModuleNotFoundError, match="optional `tensorboard` package"):
        TensorBoardLogger(tmp_path)


def test_import_failure_at_first_use_is_explained(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    logger = TensorBoardLogger(tmp_path)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ModuleNotFoundError, match="optional `tensorboard` package"):
        logger.log_metrics({"x": 1.0}, step=0)


def test_directory_layout(tmp_path):
    pytest.importorskip("tensorboard")
    logger = TensorBoardLogger(tmp_path, name="exp")
    assert isinstance(logger, Logger)
    assert logger.log_dir == os.path.join(tmp_path, "exp", "version_0")
    logger.log_metrics({"x": 1.0}, step=0)
    logger.finalize("success")
    assert TensorBoardLogger(tmp_path, name="exp").version == 1
    nested = TensorBoardLogger(tmp_path, name=None, version="v", sub_dir="train")
    assert nested.log_dir == os.path.join(tmp_path, "v", "train")
    with pytest.raises(TypeError, match="sub_dir"):
        TensorBoardLogger(tmp_path, sub_dir=3)


def test_event_file_with_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    logger = TensorBoardLogger(tmp_path, prefix="train", flush_secs=1)
    logger.log_metrics({"loss": torch.tensor(0.5), "acc": 1}, step=3)
    logger.log_metrics({"loss": 0.25}, step=4)
    logger.finalize("success")
    assert logger._experiment is None
    assert len(_event_files(logger.log_dir)) == 1
    assert _scalars(logger.log_dir) == {"train-loss": [(3, 0.5), (4, 0.25)], "train-acc": [(3, 1.0)]}


def test_hparams(tmp_path):
    pytest.importorskip("tensorboard")
    logger = TensorBoardLogger(tmp_path)
    logger.log_hyperparams({"lr": 0.1, "model": {"depth": 2}, "dtype": torch.float16, "opt": None})
    logger.finalize("success")
    assert logger.hparams["model"] == {"depth": 2}
    text = open(os.path.join(logger.log_dir, "hparams.yaml")).read()
    assert text == 'lr: 0.1\nmodel:\n  depth: 2\ndtype: "torch.float16"\nopt: null\n'
    assert _event_files(logger.log_dir)


def test_other_ranks_write_nothing(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    logger = TensorBoardLogger(tmp_path)
    logger.log_metrics({"x": 1.0}, step=0)
    logger.log_hyperparams({"a": 1})
    logger.experiment.add_scalar("y", 1.0)
    logger.save()
    logger.finalize("success")
    assert list(tmp_path.iterdir()) == []


def test_picklable_after_use(tmp_path):
    pytest.importorskip("tensorboard")
    logger = TensorBoardLogger(tmp_path)
    logger.log_metrics({"x": 1.0}, step=0)
    clone = pickle.loads(pickle.dumps(logger))
    assert clone._experiment is None and clone.log_dir == logger.log_dir
    logger.finalize("success")
