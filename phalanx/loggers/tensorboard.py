"""A logger that writes TensorBoard event files (needs the optional ``tensorboard`` package)."""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
from typing import TYPE_CHECKING, Any

from phalanx.loggers.csv import HPARAMS_FILE, save_hparams_to_yaml
from phalanx.loggers.logger import _DirectoryLogger, rank_zero_experiment
from phalanx.loggers.utilities import add_prefix, convert_params, flatten_dict, to_scalar
from phalanx.utilities.rank_zero import rank_zero_only, rank_zero_warn

if TYPE_CHECKING:
    from torch import nn

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


def _summary_writer() -> type:
    """torch's ``SummaryWriter`` class (imports tensorboard)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise ModuleNotFoundError(_MISSING_MESSAGE) from error
    return SummaryWriter


def _check_writer_arguments(arguments: dict[str, Any]) -> None:
    """Refuse, at construction, keywords that ``SummaryWriter`` would refuse at the first write."""
    if "log_dir" in arguments:
        raise TypeError(
            "TensorBoardLogger(log_dir=...) is not an option: the folder is save_dir/name/version[/sub_dir]."
        )
    if not arguments:
        return  # nothing to check: tensorboard is imported at the first write, not here
    accepted = [name for name in inspect.signature(_summary_writer().__init__).parameters if name not in ("self",)]
    accepted.remove("log_dir")
    unknown = sorted(set(arguments) - set(accepted))
    if unknown:
        raise TypeError(
            f"TensorBoardLogger got unexpected keyword arguments {unknown}: besides its own, it takes the keywords of"
            f" torch.utils.tensorboard.SummaryWriter: {accepted}."
        )


class TensorBoardLogger(_DirectoryLogger):
    """Log to TensorBoard event files in ``save_dir/name/version_N[/sub_dir]``.

    Args:
        save_dir: The top folder.
        name: The experiment's folder under ``save_dir`` (None or "": none).
        version: ``version_N`` for an int, the folder name for a str; the next free ``version_N`` when None.
        log_graph: Add the model's graph to the event file at the start of fit (from ``model.example_input_array``);
            not where a sharded model's forward pass runs collectives on several processes (fsdp, model_parallel,
            DeepSpeed ZeRO-3), where tracing on rank 0 alone would wait for the other ranks forever.
        default_hp_metric: Log ``hp_metric = -1`` with the hyperparameters when no metric is given, so that
            TensorBoard's HPARAMS tab shows the run (as Lightning); False writes hyperparameters only to
            ``hparams.yaml`` unless ``log_hyperparams(params, metrics=...)`` names metrics.
        prefix: Put before every metric name, with ``-``.
        sub_dir: A folder under the version folder.
        **kwargs: Keywords of :class:`torch.utils.tensorboard.SummaryWriter` (``flush_secs``, ``max_queue``, ...),
            checked here; the writer is created on the first write. Only global rank 0 writes.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike,
        name: str | None = "logs",
        version: int | str | None = None,
        log_graph: bool = False,
        default_hp_metric: bool = True,
        prefix: str = "",
        sub_dir: str | os.PathLike | None = None,
        **kwargs: Any,
    ) -> None:
        if not _tensorboard_available():
            raise ModuleNotFoundError(_MISSING_MESSAGE)
        super().__init__(save_dir, name=name, version=version, prefix=prefix)
        if sub_dir is not None and not isinstance(sub_dir, (str, os.PathLike)):
            raise TypeError(f"`sub_dir` must be a str, os.PathLike or None, got {type(sub_dir).__name__}.")
        for flag, value in (("log_graph", log_graph), ("default_hp_metric", default_hp_metric)):
            if not isinstance(value, bool):
                raise TypeError(f"TensorBoardLogger({flag}={value!r}): pass True or False.")
        _check_writer_arguments(kwargs)
        self._sub_dir = os.fspath(sub_dir) if sub_dir is not None else None
        self._log_graph = log_graph
        self._default_hp_metric = default_hp_metric
        self._writer_kwargs = kwargs
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
    @rank_zero_experiment
    def experiment(self) -> Any:
        """The ``SummaryWriter``, created on first access (a do-nothing stand-in on ranks other than 0)."""
        if self._experiment is None:
            self._experiment = _summary_writer()(log_dir=self.log_dir, **self._writer_kwargs)
        return self._experiment

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Add one scalar per metric (tensors are converted with ``.item()``)."""
        writer = self.experiment
        for key, value in metrics.items():
            name = self._prefixed(str(key))
            writer.add_scalar(name, to_scalar(name, value), global_step=step)

    def log_hyperparams(
        self,
        params: dict[str, Any] | argparse.Namespace,
        metrics: dict[str, Any] | float | None = None,
        step: int | None = None,
    ) -> None:
        """Merge ``params`` into :attr:`hparams`, write ``hparams.yaml`` and, with ``metrics`` (a dict, or one value
        named ``hp_metric``; ``hp_metric = -1`` by default, see ``default_hp_metric``), the HPARAMS entry."""
        params = convert_params(params)
        self.hparams.update(params)
        if metrics is None:
            metrics = {"hp_metric": -1} if self._default_hp_metric else {}
        elif not isinstance(metrics, dict):
            metrics = {"hp_metric": metrics}
        self._write_hparams(params, metrics, step)

    @rank_zero_only
    def _write_hparams(self, params: dict[str, Any], metrics: dict[str, Any], step: int | None) -> None:
        save_hparams_to_yaml(os.path.join(self.log_dir, HPARAMS_FILE), self.hparams)
        if not metrics:
            return
        self.log_metrics(metrics, step)
        from torch.utils.tensorboard.summary import hparams  # optional dependency, present once the writer exists

        metrics = {key: to_scalar(key, value) for key, value in add_prefix(metrics, self._prefix).items()}
        writer = self.experiment.file_writer
        for summary in hparams(_tensorboard_values(flatten_dict(params)), metrics):
            writer.add_summary(summary, step)

    @rank_zero_only
    def log_graph(self, model: nn.Module, input_array: Any = None) -> None:
        """With ``log_graph=True``: trace ``model`` on ``input_array`` (default ``model.example_input_array``, moved to
        the model's device) and add the graph to the event file; warns when there is no input to trace."""
        if not self._log_graph:
            return
        if input_array is None:
            input_array = getattr(model, "example_input_array", None)
        if input_array is None or not isinstance(input_array, (tuple, _tensor_type())):
            what = "is not set" if input_array is None else f"is a {type(input_array).__name__}"
            rank_zero_warn(
                f"TensorBoardLogger(log_graph=True) adds no graph: the input to trace (input_array, or"
                f" model.example_input_array) {what}; give a tensor or a tuple of forward()'s positional arguments."
            )
            return
        self.experiment.add_graph(_traceable(model), _to_model_device(model, input_array))

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


def _tensor_type() -> type:
    import torch  # import time: `import phalanx.loggers` does not load torch

    return torch.Tensor


def _traceable(model: nn.Module) -> nn.Module:
    """A module with ``model``'s forward, children, parameters and buffers, and nothing else, named as ``model``.

    Tracing asks a module for every attribute it lists, and a TrainingModule's ``trainer`` (and what reads it) raises
    outside a stage: this stand-in traces into the same graph without being asked.
    """
    import torch  # import time: `import phalanx.loggers` does not load torch

    def forward(self: nn.Module, *args: Any) -> Any:
        return type(model).forward(model, *args)

    stand_in = type(type(model).__name__, (torch.nn.Module,), {"forward": forward})()
    stand_in._modules.update(model._modules)
    stand_in._parameters.update(model._parameters)
    stand_in._buffers.update(model._buffers)
    return stand_in


def _to_model_device(model: nn.Module, data: Any) -> Any:
    """``data`` moved to the device of ``model``'s first parameter or buffer (as it is when there is none)."""
    # Import time: `import phalanx.loggers` does not load torch.
    from phalanx.utilities.apply import move_to_device

    tensor = next(iter(model.parameters()), None)
    if tensor is None:
        tensor = next(iter(model.buffers()), None)
    return data if tensor is None else move_to_device(data, tensor.device)


def _tensorboard_values(params: dict[str, Any]) -> dict[str, Any]:
    """Values TensorBoard's HPARAMS stores (bool, int, float, str; one-element tensors as numbers); others as str."""
    values: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, (bool, int, float, str)):
            values[key] = value
        elif getattr(value, "numel", None) is not None and value.numel() == 1:
            values[key] = value.item()
        else:
            values[key] = str(value)
    return values
