"""TensorBoardLogger as Lightning's: the options Lightning takes (``log_graph``, ``default_hp_metric``, SummaryWriter's
keywords) are accepted or refused at construction and work in ``fit``; the event files of the same project fitted under
Lightning and under phalanx hold the same scalars (names, steps, values), HPARAMS entry and graph."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from tracker_parity import (
    LIGHTNING_MISSING,
    fit,
    framework,
    lightning_available,
    project_class,
    tensorboard_graph_ops,
    tensorboard_hparams,
    tensorboard_scalars,
)

from phalanx.loggers import TensorBoardLogger
from phalanx.utilities.rank_zero import rank_zero_only

pytest.importorskip("tensorboard")

# (id, TensorBoardLogger keywords, Trainer's defaults left on)
CASES = [
    ("defaults", {}, True),
    ("log_graph", {"log_graph": True}, False),
    ("no_hp_metric", {"default_hp_metric": False}, False),
    ("prefix_and_writer_keywords", {"prefix": "run", "flush_secs": 5, "max_queue": 3, "filename_suffix": ".x"}, False),
]
DEFAULTS_ON = {"enable_progress_bar": True, "enable_model_summary": True, "enable_checkpointing": True}


def _record(name: str, root, options: dict, defaults: bool) -> dict:
    trainer, _ = fit(
        name,
        lambda loggers: loggers.TensorBoardLogger(save_dir=root, name="tb", **options),
        root,
        **(DEFAULTS_ON if defaults else {}),
    )
    folder = trainer.logger.log_dir
    return {
        "scalars": tensorboard_scalars(folder),
        "hparams": tensorboard_hparams(folder),
        "graph": tensorboard_graph_ops(folder),
        "files": sorted(
            path.name.endswith(options.get("filename_suffix", "")) for path in Path(folder).glob("events*")
        ),
    }


@pytest.mark.parametrize(("options", "defaults"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_event_files_match_lightnings(tmp_path, options, defaults):
    ours = _record("phalanx", tmp_path / "phalanx", options, defaults)
    prefix = f"{options['prefix']}-" if "prefix" in options else ""
    assert {f"{prefix}train_loss_step", f"{prefix}val_loss"} <= set(ours["scalars"])
    assert bool(ours["graph"]) == options.get("log_graph", False)
    assert (f"{prefix}hp_metric" in ours["scalars"]) == options.get("default_hp_metric", True)
    if not lightning_available():
        pytest.skip(LIGHTNING_MISSING)
    theirs = _record("lightning", tmp_path / "lightning", options, defaults)
    assert ours["scalars"].keys() == theirs["scalars"].keys()
    for tag, points in ours["scalars"].items():
        assert [step for step, _ in points] == [step for step, _ in theirs["scalars"][tag]], tag
        assert [value for _, value in points] == pytest.approx([value for _, value in theirs["scalars"][tag]]), tag
    assert ours["hparams"][0] == theirs["hparams"][0]
    # Lightning names the unprefixed metric in the HPARAMS entry, phalanx the scalar's own (prefixed) tag.
    assert ours["hparams"][1] == [f"{prefix}{name}" for name in theirs["hparams"][1]]
    assert ours["graph"] == theirs["graph"]
    assert ours["files"] == theirs["files"] == [True]  # one event file, named with SummaryWriter's filename_suffix


# (log_hyperparams arguments) -> the same HPARAMS entry and scalars as Lightning's logger given the same call
DIRECT_CALLS = [
    ({"params": {"lr": 0.1, "opt": {"name": "sgd", "momentum": 0.9}}, "metrics": {"acc": 0.5, "loss": 0.25}}, None),
    ({"params": {"lr": 0.1}, "metrics": 0.75}, None),
    ({"params": {"lr": 0.1, "dtype": torch.float16, "shape": torch.zeros(2, 2)}, "metrics": None}, None),
    ({"params": {"lr": 0.1}, "metrics": {"acc": 1.0}, "step": 3}, None),
]


@pytest.mark.parametrize(("call", "_"), DIRECT_CALLS, ids=["nested", "one value", "objects", "at a step"])
def test_log_hyperparams_with_metrics_matches_lightnings(tmp_path, monkeypatch, call, _):
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    recorded = {}
    for name in ("phalanx", "lightning"):
        if name == "lightning" and not lightning_available():
            pytest.skip(LIGHTNING_MISSING)
        logger = framework(name)[2].TensorBoardLogger(save_dir=tmp_path / name, name="tb")
        logger.log_hyperparams(**call)
        logger.finalize("success")
        recorded[name] = (tensorboard_scalars(logger.log_dir), tensorboard_hparams(logger.log_dir))
        expected_metrics = (
            call["metrics"] if isinstance(call["metrics"], dict) else {"hp_metric": call["metrics"] or -1}
        )
        assert sorted(recorded[name][1][1]) == sorted(expected_metrics)
    assert recorded["phalanx"] == recorded["lightning"]


def test_log_graph_traces_the_given_input_and_warns_without_one(tmp_path, monkeypatch):
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    model = project_class(framework("phalanx")[1])()
    del model.example_input_array
    logger = TensorBoardLogger(tmp_path, log_graph=True)
    with pytest.warns(UserWarning, match="adds no graph.*is not set"):
        logger.log_graph(model)
    with pytest.warns(UserWarning, match="adds no graph.*is a list"):
        logger.log_graph(model, [1, 2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logger.log_graph(model, torch.zeros(3, 4))
        TensorBoardLogger(tmp_path, version="off").log_graph(model, torch.zeros(3, 4))  # log_graph=False: nothing
    assert not [w for w in caught if "adds no graph" in str(w.message)]
    logger.finalize("success")
    assert "aten::linear" in tensorboard_graph_ops(logger.log_dir)
    assert not (tmp_path / "logs" / "off").exists()  # nothing written without log_graph=True


@pytest.mark.parametrize(
    ("keywords", "error", "match"),
    [
        ({"flush_sec": 5}, TypeError, r"unexpected keyword arguments \['flush_sec'\].*'flush_secs'"),
        ({"log_dir": "x"}, TypeError, r"log_dir=\.\.\.\) is not an option"),
        ({"log_graph": "yes"}, TypeError, r"log_graph='yes'\): pass True or False"),
        ({"default_hp_metric": None}, TypeError, r"default_hp_metric=None\): pass True or False"),
    ],
)
def test_options_summary_writer_would_refuse_are_refused_at_construction(tmp_path, keywords, error, match):
    with pytest.raises(error, match=match):
        TensorBoardLogger(tmp_path, **keywords)
    assert list(tmp_path.iterdir()) == []
