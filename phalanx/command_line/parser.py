"""The parser of phalanx's command line (jsonargparse's, with the training groups), the callback that saves its config
beside the logs, and the ReduceLROnPlateau whose ``monitor`` the command line can set."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

try:
    from jsonargparse import ArgumentParser, Namespace, class_from_function
except ImportError as error:  # optional: the command line only
    raise ModuleNotFoundError(
        "phalanx's command line (PhalanxCLI, LightningCLI) needs jsonargparse, which is not installed: pip install"
        " 'phalanx[cli]' (or pip install 'jsonargparse[signatures]')."
    ) from error

from phalanx.callbacks.callback import Callback
from phalanx.datamodule import DataModule
from phalanx.module import TrainingModule
from phalanx.plugins.io.serialization import is_url
from phalanx.trainer.trainer import Trainer
from phalanx.utilities.exceptions import MisconfigurationError


class ReduceLROnPlateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
    """torch's ReduceLROnPlateau with the ``monitor`` it steps on, so that ``--lr_scheduler ReduceLROnPlateau
    --lr_scheduler.monitor val_loss`` configures it fully from the command line."""

    def __init__(self, optimizer: Optimizer, monitor: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(optimizer, *args, **kwargs)
        self.monitor = monitor


LRSchedulerTypeTuple = (LRScheduler, ReduceLROnPlateau)
LRSchedulerTypeUnion = Union[LRScheduler, ReduceLROnPlateau]
LRSchedulerType = Union[type[LRScheduler], type[ReduceLROnPlateau]]
ArgsType = Optional[Union[list[str], dict[str, Any], Namespace]]
OptimizerCallable = Callable[[Iterable], Optimizer]
LRSchedulerCallable = Callable[[Optimizer], LRSchedulerTypeUnion]
ClassGroup = Union[type, tuple[type, ...]]


class PhalanxArgumentParser(ArgumentParser):
    """jsonargparse's ArgumentParser with the groups of a training command line (Lightning's
    ``LightningArgumentParser``).

    Args:
        description: What ``--help`` says first.
        env_prefix: The prefix of the environment variables read with ``default_env=True``
            (``{PREFIX}_FIT__TRAINER__MAX_EPOCHS``).
        default_env: Read defaults from environment variables.
    """

    def __init__(
        self,
        *args: Any,
        description: str = "phalanx Trainer command line tool",
        env_prefix: str = "PHALANX",
        default_env: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, description=description, env_prefix=env_prefix, default_env=default_env, **kwargs)
        self.callback_keys: list[str] = []
        self._optimizers: dict[str, tuple[ClassGroup, str]] = {}
        self._lr_schedulers: dict[str, tuple[ClassGroup, str]] = {}

    def add_lightning_class_args(
        self, lightning_class: Any, nested_key: str, subclass_mode: bool = False, required: bool = True
    ) -> list[str]:
        """Add the arguments of a Trainer, TrainingModule, DataModule or Callback class (or of a function returning
        one) under ``nested_key``; ``subclass_mode``: any subclass, given by class path."""
        if callable(lightning_class) and not isinstance(lightning_class, type):
            lightning_class = class_from_function(lightning_class)
        if not (
            isinstance(lightning_class, type)
            and issubclass(lightning_class, (Trainer, TrainingModule, DataModule, Callback))
        ):
            raise MisconfigurationError(
                f"Cannot add arguments from {lightning_class}: pass a function or a subclass of Trainer,"
                " TrainingModule, DataModule or Callback."
            )
        if issubclass(lightning_class, Callback):
            self.callback_keys.append(nested_key)
        if subclass_mode:
            return self.add_subclass_arguments(lightning_class, nested_key, fail_untyped=False, required=required)
        return self.add_class_arguments(
            lightning_class,
            nested_key,
            fail_untyped=False,
            instantiate=not issubclass(lightning_class, Trainer),
            sub_configs=True,
        )

    def add_optimizer_args(
        self, optimizer_class: ClassGroup = (Optimizer,), nested_key: str = "optimizer", link_to: str = "AUTOMATIC"
    ) -> None:
        """Add an optimizer group: one class, or a tuple of base classes for any subclass by class path or name."""
        self._add_group(optimizer_class, Optimizer, nested_key, skip={"params"})
        self._optimizers[nested_key] = (optimizer_class, link_to)

    def add_lr_scheduler_args(
        self,
        lr_scheduler_class: ClassGroup = LRSchedulerTypeTuple,
        nested_key: str = "lr_scheduler",
        link_to: str = "AUTOMATIC",
    ) -> None:
        """Add a learning-rate scheduler group (one class, or a tuple of base classes)."""
        self._add_group(lr_scheduler_class, LRSchedulerTypeTuple, nested_key, skip={"optimizer"})
        self._lr_schedulers[nested_key] = (lr_scheduler_class, link_to)

    def _add_group(self, given: ClassGroup, base: ClassGroup, nested_key: str, skip: set[str]) -> None:
        classes = given if isinstance(given, tuple) else (given,)
        if not all(isinstance(cls, type) and issubclass(cls, base) for cls in classes):
            raise MisconfigurationError(f"--{nested_key} takes subclasses of {base}, got {given}.")
        kwargs: dict[str, Any] = {"instantiate": False, "fail_untyped": False, "skip": skip}
        if isinstance(given, tuple):
            self.add_subclass_arguments(given, nested_key, **kwargs)
        else:
            self.add_class_arguments(given, nested_key, sub_configs=True, **kwargs)


class SaveConfigCallback(Callback):
    """Write the command line's whole config to ``trainer.log_dir/config_filename`` when a stage starts (global rank
    0, once per CLI run), so that a run can be repeated with ``--config``.

    Refuses (RuntimeError, before anything is trained) to replace a config file already there, which would belong to
    an earlier run, unless ``overwrite=True``.

    Args:
        parser: The parser the config came from.
        config: The parsed config.
        config_filename: The file's name.
        overwrite: Replace an existing file.
        multifile: Keep the structure of several config files given.
        save_to_log_dir: Write the file (False: only ``save_config``, which a subclass overrides, runs).
    """

    def __init__(
        self,
        parser: PhalanxArgumentParser,
        config: Namespace,
        config_filename: str = "config.yaml",
        overwrite: bool = False,
        multifile: bool = False,
        save_to_log_dir: bool = True,
    ) -> None:
        self.parser = parser
        self.config = config
        self.config_filename = config_filename
        self.overwrite = overwrite
        self.multifile = multifile
        self.save_to_log_dir = save_to_log_dir
        self.already_saved = False
        if not save_to_log_dir and type(self).save_config is SaveConfigCallback.save_config:
            raise ValueError(
                "SaveConfigCallback(save_to_log_dir=False) writes nothing unless a subclass overrides save_config."
            )

    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        if self.already_saved:
            return
        if self.save_to_log_dir:
            self._write(trainer)
        if trainer.is_global_zero:
            self.save_config(trainer, module, stage)
            self.already_saved = True
        self.already_saved = bool(trainer.strategy.broadcast(self.already_saved))

    def _write(self, trainer: Trainer) -> None:
        log_dir = trainer.log_dir
        config_path = os.path.join(log_dir, self.config_filename)
        if not self.overwrite:
            exists = _file_exists(config_path) if trainer.is_global_zero else False
            if trainer.strategy.broadcast(exists):
                raise RuntimeError(
                    f"{type(self).__name__} expected {config_path} to NOT exist: it would replace the config of an"
                    " earlier run. Delete it, choose another log folder, set save_config_callback=None to write no"
                    ' config, or set save_config_kwargs={"overwrite": True} to replace it.'
                )
        if trainer.is_global_zero:
            if not is_url(log_dir):
                Path(log_dir).mkdir(parents=True, exist_ok=True)
            self.parser.save(
                self.config, config_path, skip_none=False, overwrite=self.overwrite, multifile=self.multifile
            )

    def save_config(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        """Override to save the config somewhere else too (e.g. as a logger's hyperparameters); runs on global rank 0
        only, so it must not call collectives."""


def _file_exists(path: str) -> bool:
    if is_url(path):
        # Lazy for import time: fsspec is needed only for a remote log folder.
        import fsspec

        filesystem, _, paths = fsspec.get_fs_token_paths(path)
        return bool(filesystem.isfile(paths[0]))
    return os.path.isfile(path)


#: Lightning's name of :class:`PhalanxArgumentParser`.
LightningArgumentParser = PhalanxArgumentParser


def with_class_path(class_type: type, init_args: Namespace | dict[str, Any] | None = None) -> dict[str, Any]:
    if isinstance(init_args, Namespace):
        init_args = init_args.as_dict()
    return {"class_path": f"{class_type.__module__}.{class_type.__name__}", "init_args": init_args or {}}


def instantiate_class(args: Any, init: dict[str, Any]) -> Any:
    """Make ``init["class_path"]`` with ``args`` (a value or a tuple of them) and ``init["init_args"]``."""
    module_name, class_name = init["class_path"].rsplit(".", 1)
    module = __import__(module_name, fromlist=[class_name])
    positional = args if isinstance(args, tuple) else (args,)
    return getattr(module, class_name)(*positional, **init.get("init_args", {}))


__all__ = [
    "ArgsType",
    "ClassGroup",
    "LRSchedulerCallable",
    "LRSchedulerType",
    "LRSchedulerTypeTuple",
    "LRSchedulerTypeUnion",
    "LightningArgumentParser",
    "OptimizerCallable",
    "PhalanxArgumentParser",
    "ReduceLROnPlateau",
    "SaveConfigCallback",
    "instantiate_class",
    "with_class_path",
]
