"""A logger list names each logger once: the same logger twice, or two loggers of one class writing to the same
folder, would write every row twice, and is refused wherever a list of loggers is given (``Trainer(logger=...)``,
``Cohort(loggers=...)``, ``trainer.loggers = ...``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import pytest

import phalanx
from phalanx.loggers import CSVLogger, TensorBoardLogger
from phalanx.loggers.tensorboard import _tensorboard_available


def _trainer(loggers: Any) -> Any:
    return phalanx.Trainer(accelerator="cpu", logger=loggers)


def _cohort(loggers: Any) -> Any:
    return phalanx.Cohort(accelerator="cpu", strategy="single_device", devices=1, loggers=loggers)


def _assigned(loggers: Any) -> Any:
    trainer = phalanx.Trainer(accelerator="cpu", logger=False)
    trainer.loggers = loggers
    return trainer


DRIVERS: dict[str, tuple[Callable[[Any], Any], str]] = {
    "Trainer(logger=...)": (_trainer, "logger"),
    "Cohort(loggers=...)": (_cohort, "Cohort(loggers"),
    "trainer.loggers = ...": (_assigned, "trainer.loggers"),
}


def _csv(root: Path, **kwargs: Any) -> CSVLogger:
    return CSVLogger(root, **kwargs)


#: Lists that name one logger twice: (the list, the indices of the pair, what the message says).
DUPLICATES: dict[str, tuple[Callable[[Path], list[Any]], tuple[int, int], str]] = {
    "the same object twice": (lambda root: [_csv(root)] * 2, (0, 1), "are the same CSVLogger"),
    "the same object as a tuple": (lambda root: tuple([_csv(root)] * 2), (0, 1), "are the same CSVLogger"),
    "the same object apart": (
        lambda root: (lambda same: [same, _csv(root, name="other"), same])(_csv(root)),
        (0, 2),
        "are the same CSVLogger",
    ),
    "one folder, one version": (
        lambda root: [_csv(root, version=3), _csv(root, version=3)],
        (0, 1),
        "are two CSVLoggers writing to the same folder",
    ),
    "one folder, a str version": (
        lambda root: [_csv(root, name="run", version="a"), _csv(str(root) + "/", name="run", version="a")],
        (0, 1),
        "are two CSVLoggers writing to the same folder",
    ),
}


@pytest.mark.parametrize("case", list(DUPLICATES))
@pytest.mark.parametrize("driver", list(DRIVERS))
def test_a_logger_given_twice_is_refused(tmp_path: Path, driver: str, case: str) -> None:
    build, argument = DRIVERS[driver]
    loggers, (first, second), what = DUPLICATES[case]
    name = re.escape(argument)
    with pytest.raises(ValueError, match=rf"{name}\[{first}\] and {name}\[{second}\] {what}"):
        build(loggers(tmp_path))


#: Lists whose loggers look alike but write to different places: accepted.
DISTINCT: dict[str, Callable[[Path], list[Any]]] = {
    "automatic versions": lambda root: [_csv(root), _csv(root)],  # each claims its own version_N
    "other versions": lambda root: [_csv(root, version=1), _csv(root, version=2)],
    "other names": lambda root: [_csv(root, name="a", version=1), _csv(root, name="b", version=1)],
    "other folders": lambda root: [_csv(root / "x", version=1), _csv(root / "y", version=1)],
    "other classes": lambda root: [_csv(root, version=1), TensorBoardLogger(root, version=1)],
}


@pytest.mark.parametrize("case", list(DISTINCT))
@pytest.mark.parametrize("driver", list(DRIVERS))
def test_distinct_loggers_are_accepted(tmp_path: Path, driver: str, case: str) -> None:
    if case == "other classes" and not _tensorboard_available():
        pytest.skip("tensorboard is not installed")
    loggers = DISTINCT[case](tmp_path)
    driven = DRIVERS[driver][0](loggers)
    assert driven.loggers == list(loggers)
