"""A logger that writes TensorBoard event files (needs the optional ``tensorboard`` package)."""

from __future__ import annotations

import argparse
import importlib.util
import os
from typing import Any

from phalanx.loggers.csv import HPARAMS_FILE, save_hparams_to_yaml
from phalanx.loggers.logger import _DirectoryLogger, _to_dict, _to_scalar
from phalanx.utilities.rank_zero import rank_zero_only

_MISSING_MESSAGE = (
    "TensorBoardLogger needs the optional `tensorboard` package: pip install 'phalanx[tensorboard]' "
    "(or use the default CSVLogger)"
)


def _tensorboard_available() -> bool:
    """Whether the ``tensorboard`` package can be found, without importing it."""
    try:
        return importlib.util.find_spec("tensorboard") is not None
    except ValueError:  # present in sys.modules without a spec: it is importable
        return True


class _NoOpExperiment:
    """Stands in for the SummaryWriter on ranks other than 0: every method call does nothing."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


class TensorBoardLogger(_DirectoryLogger):
    """Log to TensorBoard event files in ``save_dir/name/version_N[/sub_dir]``.

    Extra keyword arguments go to :class:`torch.utils.tensorboard.SummaryWriter`, which is created
    on first use. Hyperparameters are written to the event file and to ``hparams.yaml``. Only global
    rank 0 writes.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike,
        name: str | None = "logs",
        version: int | str | None = None,
        prefix: str = "",
        sub_dir: str | os.PathLike | None = None,
        **summary_writer_kwargs: Any,
    ) -> None:
        if not _tensorboard_available():
            raise ModuleNotFoundError(_MISSING_MESSAGE)
        super().__init__(save_dir, name=name, version=version, prefix=prefix)
        if sub_dir is not None and not isinstance(sub_dir, (str, os.PathLike)):
            raise TypeError(f"`sub_dir` must be a str, os.PathLike or None, got {type(sub_dir).__name__}.")
        self._sub_dir = os.fspath(sub_dir) if sub_dir is not None else None
        self._writer_kwargs = summary_writer_kwargs
        self._experiment: Any = None

    @property
    def log_dir(self) -> str:
        """``root_dir/version_N``, plus ``sub_dir`` when one was given."""
        log_dir = super().log_dir
        return os.path.join(log_dir, self._sub_dir) if self._sub_dir else log_dir

    @property
    def sub_dir(self) -> str | None:
        """The optional folder under the version folder."""
        return self._sub_dir

    @property
    def experiment(self) -> Any:
        """The ``SummaryWriter``, created on first access (a do-nothing stand-in on ranks other than 0)."""
        if self._experiment is not None:
            return self._experiment
        if rank_zero_only.rank != 0:  # type: ignore[attr-defined]
            return _NoOpExperiment()
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise ModuleNotFoundError(_MISSING_MESSAGE) from error
        self._experiment = SummaryWriter(log_dir=self.log_dir, **self._writer_kwargs)
        return self._experiment

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Add one scalar per metric (tensors are converted with ``.item()``)."""
        writer = self.experiment
        for key, value in metrics.items():
            name = self._prefixed(str(key))
            writer.add_scalar(name, _to_scalar(name, value), global_step=step)

    def log_hyperparams(self, params: dict[str, Any] | argparse.Namespace) -> None:
        """Merge ``params`` into :attr:`hparams`, add them to the event file and write ``hparams.yaml``."""
        params = _to_dict(params)
        self.hparams.update(params)
        self._write_hparams(params)

    @rank_zero_only
    def _write_hparams(self, params: dict[str, Any]) -> None:
        """Write ``params`` to the event file and all hyperparameters so far to ``hparams.yaml``."""
        save_hparams_to_yaml(os.path.join(self.log_dir, HPARAMS_FILE), self.hparams)
        if not params:
            return
        from torch.utils.tensorboard.summary import hparams

        writer = self.experiment.file_writer
        for summary in hparams(_flatten_for_tensorboard(params), {}):
            writer.add_summary(summary)

    @rank_zero_only
    def save(self) -> None:
        """Flush the event file."""
        if self._experiment is not None:
            self._experiment.flush()

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """Flush and close the event file."""
        if self._experiment is not None:
            self._experiment.flush()
            self._experiment.close()
            self._experiment = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_experiment"] = None  # a SummaryWriter cannot be pickled; it is re-created on use
        return state


def _flatten_for_tensorboard(params: dict[str, Any], parent: str = "") -> dict[str, Any]:
    """Flatten nested dicts into ``a/b`` keys and turn values TensorBoard cannot store into strings."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{parent}/{key}" if parent else str(key)
        if isinstance(value, dict) and value:
            flat.update(_flatten_for_tensorboard(value, name))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat
