"""PhalanxCLI / LightningCLI: a table of LightningCLI command lines (subcommands, config files, groups, ``+=``, class
paths, seeds, environment defaults) replayed under Lightning 2.6's LightningCLI and phalanx's, each compared on what it
built: the subcommand and its arguments, the module's and DataModule's arguments, the Trainer's settings and callbacks,
the optimizer and scheduler ``configure_optimizers`` returns, and the seed. Then ``--print_config`` and the config saved
beside the logs (refused when one is there already)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import lightning_cli_oracle
import pytest
import torch
import yaml
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx.cli import LightningCLI, PhalanxCLI, SaveConfigCallback

pytest.importorskip("jsonargparse", reason="the command line is built with jsonargparse")


class Body:
    """The user's module, framework-free (as tests/callback_project.py's)."""

    def __init__(self, hidden: int = 8, dropout: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.Dropout(dropout), nn.Linear(hidden, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class DataBody:
    def __init__(self, batch_size: int = 4, samples: int = 16) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.samples = samples

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(self.samples, 4), torch.randn(self.samples, 1)), self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return self.train_dataloader()


def _classes(framework: str) -> dict[str, type]:
    """The module, a subclass of it, the DataModule and a recording Trainer of ``framework``, defined in this module
    (``--model`` and ``--data`` name them by class path)."""
    key = f"_{framework}_classes"
    if key not in globals():
        if framework == "lightning":
            import pytorch_lightning as pl

            module_base, data_base, trainer_base = pl.LightningModule, pl.LightningDataModule, pl.Trainer
        else:
            module_base, data_base, trainer_base = phalanx.TrainingModule, phalanx.DataModule, phalanx.Trainer
        prefix = framework.capitalize()
        model = type(f"{prefix}Model", (Body, module_base), {"__module__": __name__})
        wider = type(f"{prefix}WiderModel", (model,), {"__module__": __name__})
        data = type(f"{prefix}Data", (DataBody, data_base), {"__module__": __name__})
        methods = _recording_methods(trainer_base)
        trainer = type(f"{prefix}Recording", (trainer_base,), {"__module__": __name__, **methods})
        globals().update({cls.__name__: cls for cls in (model, wider, data, trainer)})
        globals()[key] = {"model": model, "wider": wider, "data": data, "trainer": trainer}
    return globals()[key]


def _recording_methods(trainer_base: type) -> dict[str, Any]:
    """fit, validate, test and predict that record their arguments instead of running (with the real signatures,
    which the command line reads)."""

    def make(name: str) -> Any:
        @functools.wraps(getattr(trainer_base, name))
        def record(self: Any, *args: Any, **kwargs: Any) -> None:
            # Lightning's methods take weights_only too; phalanx's checkpoints always load with weights_only=True.
            ignored = ("model", "datamodule", "weights_only")
            self.called = (name, {k: v for k, v in kwargs.items() if k not in ignored})

        return record

    return {name: make(name) for name in ("fit", "validate", "test", "predict")}


# (row id, CLI keyword arguments besides the classes, argv, environment)
ROWS: list[tuple[str, dict[str, Any], list[str], dict[str, str]]] = [
    ("fit, trainer and model", {}, ["fit", "--trainer.max_epochs=3", "--model.hidden=16", "--seed_everything=7"], {}),
    ("validate with ckpt_path", {}, ["validate", "--ckpt_path=last", "--verbose=false", "--seed_everything=1"], {}),
    ("test and predict", {}, ["predict", "--return_predictions=false", "--seed_everything=false"], {}),
    ("data options", {}, ["fit", "--data.batch_size=8", "--trainer.limit_val_batches=0.5", "--seed_everything=3"], {}),
    (
        "callbacks +=",
        {},
        [
            "fit", "--trainer.callbacks+=EarlyStopping", "--trainer.callbacks.monitor=val_loss",
            "--trainer.callbacks.patience=2", "--trainer.callbacks+=LearningRateMonitor", "--seed_everything=0",
        ],
        {},
    ),
    ("optimizer by name", {}, ["fit", "--optimizer=Adam", "--optimizer.lr=0.01", "--seed_everything=0"], {}),
    (
        "optimizer and scheduler by class path",
        {},
        [
            "fit", "--optimizer=torch.optim.SGD", "--optimizer.lr=0.2", "--optimizer.momentum=0.9",
            "--lr_scheduler=StepLR", "--lr_scheduler.step_size=3", "--seed_everything=0",
        ],
        {},
    ),
    (
        "ReduceLROnPlateau with its monitor",
        {},
        ["fit", "--optimizer=Adam", "--lr_scheduler=ReduceLROnPlateau", "--lr_scheduler.monitor=val_loss",
         "--seed_everything=0"],
        {},
    ),
    ("subclass mode", {"subclass_mode_model": True}, ["fit", "--model=WiderModel", "--model.hidden=32"], {}),
    ("trainer defaults", {"trainer_defaults": {"max_epochs": 5, "accumulate_grad_batches": 2}}, ["fit"], {}),
    (
        "environment defaults",
        {"parser_kwargs": {"default_env": True}},
        ["fit", "--seed_everything=0"],
        {"PL_FIT__TRAINER__MAX_EPOCHS": "9", "PL_FIT__MODEL__HIDDEN": "5"},
    ),
    ("no subcommand: run=False", {"run": False}, ["--trainer.max_steps=4", "--seed_everything=2"], {}),
]  # fmt: skip


def _build(framework: str, cli_class: type, kwargs: dict[str, Any], argv: list[str]) -> Any:
    classes = _classes(framework)
    subclass = kwargs.get("subclass_mode_model")
    model = classes["model"]
    argv = [arg.replace("=WiderModel", f"={classes['wider'].__name__}") for arg in argv]
    cli = cli_class(
        model, classes["data"], trainer_class=classes["trainer"], save_config_callback=None, args=argv,
        **{"subclass_mode_model": bool(subclass), **kwargs},
    )  # fmt: skip
    return cli


def _callbacks(trainer: Any) -> list[tuple[str, dict[str, Any]]]:
    shown = []
    for callback in trainer.callbacks:
        name = type(callback).__name__
        if name in ("EarlyStopping", "LearningRateMonitor"):
            settings = {k: getattr(callback, k, None) for k in ("monitor", "patience", "logging_interval")}
            shown.append((name, settings))
    return shown


def _optimization(model: Any) -> Any:
    configured = model.configure_optimizers()
    optimizer = configured[0][0] if isinstance(configured, tuple) else configured
    scheduler = None
    if isinstance(configured, dict):
        optimizer, scheduler = configured["optimizer"], configured["lr_scheduler"]
        scheduler = (type(scheduler["scheduler"]).__name__, scheduler["monitor"])
    elif isinstance(configured, tuple):
        scheduler = (type(configured[1][0]).__name__, configured[1][0].step_size)
    return type(optimizer).__name__, optimizer.defaults["lr"], optimizer.defaults.get("momentum"), scheduler


def _hparams(model: Any) -> dict[str, Any]:
    return {key: value for key, value in model.hparams.items() if key not in ("_instantiator", "_class_path")}


def _max_epochs(trainer: Any) -> int:
    # Lightning keeps None and its loop reads it as 1000 (or -1 with max_steps); phalanx resolves it at construction.
    if trainer.max_epochs is None:
        return 1000 if trainer.max_steps == -1 else -1
    return trainer.max_epochs


def _built(cli: Any) -> dict[str, Any]:
    trainer = cli.trainer
    return {
        "subcommand": cli.subcommand,
        "called": getattr(trainer, "called", None),
        # Lightning's load_from_checkpoint support adds "_instantiator" (and "_class_path") to the hyperparameters.
        "model": (type(cli.model).__name__.removeprefix("Lightning").removeprefix("Phalanx"), _hparams(cli.model)),
        "data": (cli.datamodule.batch_size, cli.datamodule.samples) if cli.datamodule is not None else None,
        "trainer": (
            _max_epochs(trainer),
            trainer.max_steps,
            trainer.accumulate_grad_batches,
            trainer.limit_val_batches,
        ),
        "callbacks": _callbacks(trainer),
        "optimization": _optimization(cli.model),
        "seed": cli._get(cli.config, "seed_everything"),
    }


@pytest.fixture
def oracle(monkeypatch):
    yield from lightning_cli_oracle.lightning_cli(monkeypatch)


@pytest.mark.parametrize(("row", "kwargs", "argv", "env"), ROWS, ids=[row[0] for row in ROWS])
def test_each_command_line_builds_what_lightnings_builds(oracle, monkeypatch, row, kwargs, argv, env):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["train.py"])
    theirs = _built(_build("lightning", oracle.LightningCLI, kwargs, argv))
    ours = _built(_build("phalanx", LightningCLI, kwargs, argv))
    assert ours == theirs


def test_the_table_checks_something():
    """A few rows' values, so that the comparison above cannot pass on two empty results."""
    built = _built(_build("phalanx", PhalanxCLI, {}, ROWS[0][2]))
    assert built["called"] == ("fit", {"ckpt_path": None}) and built["trainer"][0] == 3
    assert built["model"] == ("Model", {"hidden": 16, "dropout": 0.0}) and built["seed"] == 7
    built = _built(_build("phalanx", PhalanxCLI, {}, ROWS[7][2]))
    assert built["optimization"] == ("Adam", 0.001, None, ("ReduceLROnPlateau", "val_loss"))


def _write(path: Path, config: dict[str, Any]) -> str:
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_several_config_files_are_merged_in_order_and_the_command_line_wins(tmp_path, oracle, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py"])
    first = _write(tmp_path / "a.yaml", {"trainer": {"max_epochs": 2}, "model": {"hidden": 3}, "seed_everything": 0})
    second = _write(tmp_path / "b.yaml", {"model": {"hidden": 4, "dropout": 0.5}, "optimizer": {"class_path": "Adam"}})
    argv = ["fit", f"--config={first}", f"--config={second}", "--trainer.max_epochs=6"]
    theirs = _built(_build("lightning", oracle.LightningCLI, {}, argv))
    ours = _built(_build("phalanx", LightningCLI, {}, argv))
    assert ours == theirs
    assert ours["model"][1] == {"hidden": 4, "dropout": 0.5} and ours["trainer"][0] == 6


def test_print_config_prints_what_lightnings_prints(oracle, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["train.py"])
    printed = {}
    for framework, cli_class in (("lightning", oracle.LightningCLI), ("phalanx", LightningCLI)):
        with pytest.raises(SystemExit) as exited:
            _build(framework, cli_class, {}, ["fit", "--model.hidden=12", "--optimizer=Adam", "--print_config"])
        assert exited.value.code == 0
        printed[framework] = yaml.safe_load(capsys.readouterr().out)
    ours, theirs = printed["phalanx"], printed["lightning"]
    assert ours["model"] == theirs["model"] == {"hidden": 12, "dropout": 0.0}
    assert ours["data"] == theirs["data"] and ours["optimizer"] == theirs["optimizer"]
    assert ours["ckpt_path"] is None and ours["seed_everything"] is True
    # The Trainers' arguments of the same name, but precision, whose default phalanx writes out ("32-true").
    shared = set(ours["trainer"]) & set(theirs["trainer"]) - {"precision"}
    assert {key: ours["trainer"][key] for key in shared} == {key: theirs["trainer"][key] for key in shared}
    assert "max_epochs" in shared and "nonfinite_loss" in ours["trainer"]


def test_the_phalanx_spelling_reads_phalanx_environment_variables(monkeypatch):
    monkeypatch.setenv("PHALANX_FIT__TRAINER__MAX_EPOCHS", "4")
    monkeypatch.setenv("PL_FIT__TRAINER__MAX_EPOCHS", "8")
    built = _built(_build("phalanx", PhalanxCLI, {"parser_kwargs": {"default_env": True}}, ["fit"]))
    assert built["trainer"][0] == 4
    assert _built(_build("phalanx", LightningCLI, {"parser_kwargs": {"default_env": True}}, ["fit"]))["trainer"][0] == 8


def test_a_checkpoints_hyperparameters_build_the_module(tmp_path):
    model = _classes("phalanx")["model"](hidden=24)
    trainer = phalanx.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                              enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(model, _classes("phalanx")["data"]())
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    built = _built(_build("phalanx", PhalanxCLI, {}, ["validate", f"--ckpt_path={tmp_path / 'model.ckpt'}"]))
    assert built["model"][1]["hidden"] == 24 and built["called"][1]["ckpt_path"] == str(tmp_path / "model.ckpt")


def test_with_the_defaults_the_config_is_saved_beside_the_logs_and_never_replaced(tmp_path, monkeypatch):
    classes = _classes("phalanx")
    argv = ["fit", "--trainer.max_epochs=1", f"--trainer.default_root_dir={tmp_path}", "--model.hidden=6"]
    monkeypatch.setattr(sys, "argv", ["train.py"])
    cli = PhalanxCLI(classes["model"], classes["data"], args=argv)
    saved = Path(cli.trainer.log_dir) / "config.yaml"
    config = yaml.safe_load(saved.read_text())
    assert config["model"] == {"hidden": 6, "dropout": 0.0} and isinstance(config["seed_everything"], int)
    assert saved.read_text().startswith("# phalanx==")
    # The same log folder again (a logger with a fixed version): refused before training.
    again = [*argv, "--trainer.logger=CSVLogger", f"--trainer.logger.save_dir={tmp_path}", "--trainer.logger.version=0"]
    with pytest.raises(RuntimeError, match="SaveConfigCallback expected .*config.yaml to NOT exist"):
        PhalanxCLI(classes["model"], classes["data"], args=again)
    PhalanxCLI(classes["model"], classes["data"], args=again, save_config_kwargs={"overwrite": True})
    with pytest.raises(ValueError, match="writes nothing unless a subclass overrides save_config"):
        SaveConfigCallback(cli.parser, cli.config, save_to_log_dir=False)


def test_a_bad_command_line_exits_with_a_usage_error(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["train.py"])
    with pytest.raises(SystemExit) as exited:
        _build("phalanx", PhalanxCLI, {}, ["fit", "--trainer.max_epochs=many"])
    assert exited.value.code == 2 and "max_epochs" in capsys.readouterr().err
