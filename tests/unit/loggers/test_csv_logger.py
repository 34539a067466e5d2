import argparse
import csv
import os
import pickle

import pytest
import torch

from phalanx.loggers import CSVLogger, Logger
from phalanx.loggers.csv import hparams_to_yaml
from phalanx.utilities.rank_zero import rank_zero_only


@pytest.fixture(autouse=True)
def _rank_zero(monkeypatch):
    monkeypatch.setattr(rank_zero_only, "rank", 0)


def read_rows(path):
    with open(path, newline="") as file:
        return list(csv.reader(file))


def test_is_a_logger_and_base_is_abstract():
    assert issubclass(CSVLogger, Logger)
    with pytest.raises(TypeError):
        Logger()


def test_version_numbering(tmp_path):
    first = CSVLogger(tmp_path)
    assert first.version == 0
    assert first.root_dir == os.path.join(tmp_path, "logs")
    assert first.log_dir == os.path.join(tmp_path, "logs", "version_0")
    first.log_metrics({"a": 1.0}, step=0)
    first.finalize("success")
    assert os.path.isdir(first.log_dir)

    second = CSVLogger(tmp_path)
    assert second.version == 1
    # a stray file or a non-version folder does not count
    (tmp_path / "logs" / "version_7").write_text("not a dir")
    (tmp_path / "logs" / "other").mkdir()
    os.makedirs(tmp_path / "logs" / "version_4")
    assert CSVLogger(tmp_path).version == 5


def test_version_is_fixed_after_first_access(tmp_path):
    logger = CSVLogger(tmp_path)
    assert logger.version == 0
    # The first access claimed the folder by creating it; a later run takes the next one.
    assert os.path.isdir(tmp_path / "logs" / "version_0")
    os.makedirs(tmp_path / "logs" / "version_1")
    assert logger.version == 0
    assert logger.log_dir.endswith("version_0")


def test_explicit_versions_and_no_name(tmp_path):
    assert CSVLogger(tmp_path, version=3).log_dir == os.path.join(tmp_path, "logs", "version_3")
    assert CSVLogger(tmp_path, version="run-a").log_dir == os.path.join(tmp_path, "logs", "run-a")
    for expected, name in enumerate((None, "")):
        logger = CSVLogger(tmp_path, name=name)
        assert logger.name == ""
        assert logger.root_dir == os.fspath(tmp_path)
        # Each logger claims its own folder: the second one does not reuse the first one's.
        assert logger.log_dir == os.path.join(tmp_path, f"version_{expected}")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"save_dir": 3}, TypeError, "save_dir"),
        ({"name": 5}, TypeError, "name"),
        ({"version": 1.5}, TypeError, "version"),
        ({"version": -1}, ValueError, "version"),
        ({"prefix": None}, TypeError, "prefix"),
        ({"flush_logs_every_n_steps": 0}, ValueError, "flush_logs_every_n_steps"),
        ({"flush_logs_every_n_steps": "10"}, TypeError, "flush_logs_every_n_steps"),
    ],
)
def test_argument_validation(tmp_path, kwargs, error, match):
    kwargs = {"save_dir": tmp_path, **kwargs}
    with pytest.raises(error, match=match):
        CSVLogger(**kwargs)


def test_rows_tensors_and_widened_header(tmp_path):
    logger = CSVLogger(tmp_path, flush_logs_every_n_steps=1)
    logger.log_metrics({"loss": torch.tensor(0.5)}, step=0)
    assert read_rows(logger.metrics_file_path) == [["step", "loss"], ["0", "0.5"]]
    logger.log_metrics({"loss": torch.tensor(0.25), "acc": 1}, step=1)
    logger.log_metrics({"acc": 0.75}, step=2)
    assert read_rows(logger.metrics_file_path) == [
        ["step", "loss", "acc"],
        ["0", "0.5", ""],
        ["1", "0.25", "1"],
        ["2", "", "0.75"],
    ]


def test_step_defaults_to_call_index(tmp_path):
    logger = CSVLogger(tmp_path)
    logger.log_metrics({"x": 1})
    logger.log_metrics({"x": 2})
    logger.save()
    assert [row[0] for row in read_rows(logger.metrics_file_path)] == ["step", "0", "1"]


def test_non_scalar_metrics_rejected(tmp_path):
    logger = CSVLogger(tmp_path)
    with pytest.raises(ValueError, match="'v'"):
        logger.log_metrics({"v": torch.ones(3)})
    with pytest.raises(TypeError, match="'s'"):
        logger.log_metrics({"s": "text"})


def test_prefix(tmp_path):
    logger = CSVLogger(tmp_path, prefix="train")
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.save()
    assert read_rows(logger.metrics_file_path)[0] == ["step", "train-loss"]


def test_flush_every_n_calls(tmp_path):
    logger = CSVLogger(tmp_path, flush_logs_every_n_steps=3)
    path = os.path.join(logger.log_dir, "metrics.csv")
    logger.log_metrics({"x": 0}, step=0)
    logger.log_metrics({"x": 1}, step=1)
    assert not os.path.exists(path)
    logger.log_metrics({"x": 2}, step=2)
    assert len(read_rows(path)) == 4
    logger.log_metrics({"x": 3}, step=3)
    assert len(read_rows(path)) == 4
    logger.finalize("success")
    assert read_rows(path)[-1] == ["3", "3"]
    logger.save()  # nothing buffered: the file is unchanged
    assert len(read_rows(path)) == 5


def test_appends_to_existing_metrics_file(tmp_path):
    first = CSVLogger(tmp_path, version="run")
    first.log_metrics({"a": 1}, step=0)
    first.save()
    second = CSVLogger(tmp_path, version="run")
    second.log_metrics({"b": 2}, step=1)
    with pytest.warns(UserWarning, match="already exists"):
        second.save()
    assert read_rows(second.metrics_file_path) == [["step", "a", "b"], ["0", "1", ""], ["1", "", "2"]]


def test_hparams_yaml_text(tmp_path):
    logger = CSVLogger(tmp_path)
    params = {
        "lr": 0.001,
        "tiny": 1e-05,
        "epochs": 3,
        "name": "resnet",
        "note": "two words: yes",
        "flag": True,
        "numeric_str": "123",
        "word_yes": "yes",
        "missing": None,
        "nan": float("nan"),
        "model": {"depth": 2, "sizes": [4, 8], "empty": {}},
        "layers": [{"k": 1}, [1, 2]],
        "dtype": torch.float32,
    }
    logger.log_hyperparams(params)
    assert logger.hparams == params
    text = (tmp_path / "logs" / "version_0" / "hparams.yaml").read_text()
    assert text == (
        "lr: 0.001\n"
        "tiny: 1.0e-05\n"
        "epochs: 3\n"
        "name: resnet\n"
        'note: "two words: yes"\n'
        "flag: true\n"
        'numeric_str: "123"\n'
        'word_yes: "yes"\n'
        "missing: null\n"
        "nan: .nan\n"
        "model:\n"
        "  depth: 2\n"
        "  sizes:\n"
        "    - 4\n"
        "    - 8\n"
        "  empty: {}\n"
        "layers:\n"
        "  - k: 1\n"
        "  - - 1\n"
        "    - 2\n"
        'dtype: "torch.float32"\n'
    )


def test_hparams_namespace_merge(tmp_path):
    logger = CSVLogger(tmp_path)
    logger.log_hyperparams(argparse.Namespace(a=1, inner=argparse.Namespace(b="x")))
    logger.log_hyperparams({"c": [1.5]})
    assert logger.hparams == {"a": 1, "inner": {"b": "x"}, "c": [1.5]}
    assert (tmp_path / "logs" / "version_0" / "hparams.yaml").read_text() == "a: 1\ninner:\n  b: x\nc:\n  - 1.5\n"
    assert hparams_to_yaml({}) == "{}\n"


def test_hparams_yaml_round_trips():
    yaml = pytest.importorskip("yaml")
    params = {
        "lr": 0.001,
        "big": 1e20,
        "tiny": 1e-05,
        "neg": -2,
        "ok": False,
        "none": None,
        "strs": ["on", "null", "1e3", "a b", "", 'quote"s', "multi\nline", "path/to.file"],
        "nested": {"x": [[1, 2], {"y": "z"}], "e": []},
        "inf": float("inf"),
    }
    assert yaml.safe_load(hparams_to_yaml(params)) == params


def test_other_ranks_write_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    logger = CSVLogger(tmp_path, flush_logs_every_n_steps=1)
    logger.log_metrics({"x": 1.0}, step=0)
    logger.log_hyperparams({"a": 1})
    logger.save()
    logger.finalize("success")
    assert list(tmp_path.iterdir()) == []
    assert logger.hparams == {"a": 1}


def test_picklable(tmp_path):
    logger = CSVLogger(tmp_path, prefix="p")
    logger.log_metrics({"x": 1}, step=0)
    clone = pickle.loads(pickle.dumps(logger))
    clone.save()
    assert read_rows(clone.metrics_file_path) == [["step", "p-x"], ["0", "1"]]
