"""PhalanxCLI: a configurable command line for a TrainingModule, Lightning's LightningCLI for phalanx (see
:mod:`phalanx.command_line`)."""

from __future__ import annotations

import os
import sys
from functools import partial, update_wrapper
from pathlib import Path
from types import MethodType
from typing import Any, Callable, Union

import torch
from jsonargparse import ActionConfigFile, Namespace, class_from_function
from torch.optim import Optimizer

from phalanx import __version__
from phalanx.command_line.parser import (
    ArgsType,
    ClassGroup,
    LRSchedulerTypeTuple,
    LRSchedulerTypeUnion,
    PhalanxArgumentParser,
    ReduceLROnPlateau,
    SaveConfigCallback,
    instantiate_class,
    with_class_path,
)
from phalanx.datamodule import DataModule
from phalanx.module import TrainingModule
from phalanx.trainer.trainer import Trainer
from phalanx.utilities.exceptions import MisconfigurationError
from phalanx.utilities.rank_zero import rank_zero_warn
from phalanx.utilities.seed import seed_everything


class PhalanxCLI:
    """A command line for ``model_class`` (and ``datamodule_class``) with the Trainer's arguments, Lightning's
    ``LightningCLI`` for phalanx: the same arguments, subcommands, config files and hooks (``before_fit``,
    ``after_fit``, ``add_arguments_to_parser``, ``instantiate_classes``, ...).

    Args:
        model_class: A TrainingModule class or a function returning one; None: ``--model`` takes any subclass.
        datamodule_class: A DataModule class or a function returning one; None: ``--data`` takes any (optional).
        save_config_callback: The callback that writes the config beside the logs; None writes none.
        save_config_kwargs: Its keyword arguments (``{"overwrite": True}``, ...).
        trainer_class: The Trainer class (or a function returning a Trainer).
        trainer_defaults: Defaults of the Trainer's arguments; its ``callbacks`` are always added.
        seed_everything_default: The default of ``--seed_everything``: an int, True (a seed chosen as
            ``phalanx.seed_everything()`` chooses one, written into the saved config) or False (no seeding).
        parser_kwargs: Keyword arguments of the parsers, e.g. ``{"default_env": True}``, or per subcommand
            (``{"fit": {...}}``).
        parser_class: The parser class.
        subclass_mode_model: ``--model`` takes any subclass of ``model_class`` by class path.
        subclass_mode_data: ``--data`` takes any subclass of ``datamodule_class`` by class path.
        args: What to parse instead of ``sys.argv[1:]``: a list of command-line arguments or a dict of the config.
        run: Add the subcommands and run the chosen one; False only builds ``cli.model``, ``cli.datamodule`` and
            ``cli.trainer``.
        auto_configure_optimizers: Add the ``--optimizer`` and ``--lr_scheduler`` groups; given on the command line,
            they replace the module's ``configure_optimizers``.
        load_from_checkpoint_support: With ``--ckpt_path`` a file, read the module's hyperparameters from the
            checkpoint, so that the module is built as it was saved.
    """

    env_prefix = "PHALANX"

    def __init__(
        self,
        model_class: type[TrainingModule] | Callable[..., TrainingModule] | None = None,
        datamodule_class: type[DataModule] | Callable[..., DataModule] | None = None,
        save_config_callback: type[SaveConfigCallback] | None = SaveConfigCallback,
        save_config_kwargs: dict[str, Any] | None = None,
        trainer_class: type[Trainer] | Callable[..., Trainer] = Trainer,
        trainer_defaults: dict[str, Any] | None = None,
        seed_everything_default: bool | int = True,
        parser_kwargs: dict[str, Any] | None = None,
        parser_class: type[PhalanxArgumentParser] = PhalanxArgumentParser,
        subclass_mode_model: bool = False,
        subclass_mode_data: bool = False,
        args: ArgsType = None,
        run: bool = True,
        auto_configure_optimizers: bool = True,
        load_from_checkpoint_support: bool = True,
    ) -> None:
        self.save_config_callback = save_config_callback
        self.save_config_kwargs = save_config_kwargs or {}
        self.trainer_class = trainer_class
        self.trainer_defaults = trainer_defaults or {}
        self.seed_everything_default = seed_everything_default
        self.parser_kwargs = parser_kwargs or {}
        self.parser_class = parser_class
        self.auto_configure_optimizers = auto_configure_optimizers
        self.model_class = model_class
        self._model_class = model_class or TrainingModule
        self.subclass_mode_model = model_class is None or subclass_mode_model
        self.datamodule_class = datamodule_class
        self._datamodule_class = datamodule_class or DataModule
        self.subclass_mode_data = datamodule_class is None or subclass_mode_data

        main_kwargs = {k: v for k, v in self.parser_kwargs.items() if k not in self.subcommands()}
        subcommand_kwargs = {k: v for k, v in self.parser_kwargs.items() if k in self.subcommands()}
        self.setup_parser(run, main_kwargs, subcommand_kwargs)
        self.parse_arguments(self.parser, args)
        self.subcommand: str | None = self.config["subcommand"] if run else None
        if load_from_checkpoint_support:
            self._parse_ckpt_path()
        self._set_seed()
        self.before_instantiate_classes()
        self.instantiate_classes()
        self.after_instantiate_classes()
        if self.subcommand is not None:
            self._run_subcommand(self.subcommand)

    # ------------------------------------------------------------------ the parser
    def init_parser(self, **kwargs: Any) -> PhalanxArgumentParser:
        """Make a parser with ``-c/--config`` (jsonargparse adds ``--print_config`` with it)."""
        kwargs.setdefault("dump_header", [f"phalanx=={__version__}"])
        kwargs.setdefault("env_prefix", self.env_prefix)
        parser = self.parser_class(**kwargs)
        parser.add_argument(
            "-c", "--config", action=ActionConfigFile, help="Path to a configuration file in json or yaml format."
        )
        return parser

    def setup_parser(
        self, add_subcommands: bool, main_kwargs: dict[str, Any], subcommand_kwargs: dict[str, Any]
    ) -> None:
        """Make ``self.parser``, with a parser per subcommand when ``add_subcommands``."""
        self.parser = self.init_parser(**main_kwargs)
        if add_subcommands:
            self._subcommand_method_arguments: dict[str, list[str]] = {}
            self._add_subcommands(self.parser, **subcommand_kwargs)
        else:
            self._add_arguments(self.parser)

    def add_default_arguments_to_parser(self, parser: PhalanxArgumentParser) -> None:
        """Add ``--seed_everything``."""
        parser.add_argument(
            "--seed_everything",
            type=Union[bool, int],
            default=self.seed_everything_default,
            help="An int: seed_everything(seed) before the classes are made; True: a seed chosen for you; False: none.",
        )

    def add_core_arguments_to_parser(self, parser: PhalanxArgumentParser) -> None:
        """Add the ``trainer``, ``model`` and ``data`` groups."""
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        parser.set_defaults({f"trainer.{k}": v for k, v in self.trainer_defaults.items() if k != "callbacks"})
        parser.add_lightning_class_args(self._model_class, "model", subclass_mode=self.subclass_mode_model)
        parser.add_lightning_class_args(
            self._datamodule_class,
            "data",
            subclass_mode=self.subclass_mode_data,
            required=self.datamodule_class is not None,
        )

    def add_arguments_to_parser(self, parser: PhalanxArgumentParser) -> None:
        """Override to add arguments or links (``parser.link_arguments``)."""

    def _add_arguments(self, parser: PhalanxArgumentParser) -> None:
        self.add_default_arguments_to_parser(parser)
        self.add_core_arguments_to_parser(parser)
        self.add_arguments_to_parser(parser)
        if self.auto_configure_optimizers:
            if not parser._optimizers:
                parser.add_optimizer_args((Optimizer,))
            if not parser._lr_schedulers:
                parser.add_lr_scheduler_args(LRSchedulerTypeTuple)
        self.link_optimizers_and_lr_schedulers(parser)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """The subcommands and the arguments of their Trainer method that the command line does not offer."""
        return {
            "fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
            "validate": {"model", "dataloaders", "datamodule"},
            "test": {"model", "dataloaders", "datamodule"},
            "predict": {"model", "dataloaders", "datamodule"},
        }

    def _add_subcommands(self, parser: PhalanxArgumentParser, **kwargs: Any) -> None:
        self._subcommand_parsers: dict[str, PhalanxArgumentParser] = {}
        subcommands = parser.add_subcommands()
        trainer_class = (
            self.trainer_class if isinstance(self.trainer_class, type) else class_from_function(self.trainer_class)
        )
        for name in self.subcommands():
            method = getattr(trainer_class, name)
            description = (method.__doc__ or "").strip().split("\n")[0] or None
            options = dict(kwargs.get(name, {}))
            options.setdefault("description", description)
            subparser = self.init_parser(**options)
            self._add_arguments(subparser)
            added = subparser.add_method_arguments(trainer_class, name, skip=set(self.subcommands()[name]))
            self._subcommand_method_arguments[name] = added
            self._subcommand_parsers[name] = subparser
            subcommands.add_subcommand(name, subparser, help=description)

    @staticmethod
    def link_optimizers_and_lr_schedulers(parser: PhalanxArgumentParser) -> None:
        """Link each optimizer or scheduler group whose ``link_to`` is not "AUTOMATIC" to that key."""
        for key, (class_type, link_to) in {**parser._optimizers, **parser._lr_schedulers}.items():
            if link_to == "AUTOMATIC":
                continue
            if isinstance(class_type, tuple):
                parser.link_arguments(key, link_to)
            else:
                parser.link_arguments(key, link_to, compute_fn=partial(with_class_path, class_type))

    def parse_arguments(self, parser: PhalanxArgumentParser, args: ArgsType) -> None:
        """Parse ``args`` (``sys.argv[1:]`` when None) into ``self.config``."""
        if args is not None and len(sys.argv) > 1:
            rank_zero_warn(
                f"{type(self).__name__} got args= and command-line arguments ({sys.argv[1:]}); it parses args= only."
            )
        if isinstance(args, (dict, Namespace)):
            self.config = parser.parse_object(args)
        else:
            self.config = parser.parse_args(args)

    def _parse_ckpt_path(self) -> None:
        """With ``--ckpt_path`` a checkpoint file, its hyperparameters become the module's arguments."""
        if not self.subcommand:
            return
        ckpt_path = self.config[self.subcommand].get("ckpt_path")
        if not isinstance(ckpt_path, (str, os.PathLike)) or not Path(ckpt_path).is_file():
            return
        checkpoint = torch.load(ckpt_path, weights_only=True, map_location="cpu")
        hparams = dict(checkpoint.get("hyper_parameters") or {})
        if not hparams:
            return
        if self.subclass_mode_model:
            hparams = {"init_args": hparams}
        try:
            self.config = self.parser.parse_object({self.subcommand: {"model": hparams}}, self.config)
        except SystemExit:
            sys.stderr.write(f"The hyperparameters of {ckpt_path} do not fit the module's arguments.\n")
            raise

    # ------------------------------------------------------------------ making the objects
    def _set_seed(self) -> None:
        seed = self._get(self.config, "seed_everything")
        if seed is False:
            return
        seed = seed_everything(None if seed is True else seed, workers=True)
        # The seed used goes into the config (and the saved file), so that a run can be repeated exactly.
        if self.subcommand:
            self.config[self.subcommand]["seed_everything"] = seed
        else:
            self.config["seed_everything"] = seed

    def before_instantiate_classes(self) -> None:
        """Override to run code before the classes are made."""

    def instantiate_classes(self) -> None:
        """Make the module, the DataModule and the Trainer from the config."""
        self.config_init = self.parser.instantiate_classes(self.config)
        self.datamodule = self._get(self.config_init, "data")
        self.model = self._get(self.config_init, "model")
        self._add_configure_optimizers_method_to_model(self.subcommand)
        self.trainer = self.instantiate_trainer()

    def after_instantiate_classes(self) -> None:
        """Override to run code after the classes are made."""

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """Make the Trainer from the config, ``kwargs`` replacing its values; adds the callbacks of the callback
        groups, of ``trainer_defaults`` and the config-saving one."""
        extra = [self._get(self.config_init, key) for key in self._parser(self.subcommand).callback_keys]
        config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        callbacks = config.get("callbacks")
        callbacks = (
            [] if callbacks is None else list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        )
        callbacks += extra
        defaults = self.trainer_defaults.get("callbacks")
        if defaults is not None:
            callbacks += defaults if isinstance(defaults, list) else [defaults]
        if self.save_config_callback is not None and not config.get("fast_dev_run", False):
            subcommand_config = self.config.get(str(self.subcommand), self.config)
            parser = self._parser(self.subcommand)
            callbacks.append(self.save_config_callback(parser, subcommand_config, **self.save_config_kwargs))
        config["callbacks"] = callbacks
        return self.trainer_class(**config)

    def _parser(self, subcommand: str | None) -> PhalanxArgumentParser:
        return self.parser if subcommand is None else self._subcommand_parsers[subcommand]

    @staticmethod
    def configure_optimizers(
        lightning_module: TrainingModule, optimizer: Optimizer, lr_scheduler: LRSchedulerTypeUnion | None = None
    ) -> Any:
        """What the module's ``configure_optimizers`` returns when ``--optimizer`` is given; override to change it."""
        if lr_scheduler is None:
            return optimizer
        if isinstance(lr_scheduler, ReduceLROnPlateau):
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": lr_scheduler, "monitor": lr_scheduler.monitor},
            }
        return [optimizer], [lr_scheduler]

    def _add_configure_optimizers_method_to_model(self, subcommand: str | None) -> None:
        """With ``--optimizer`` (and ``--lr_scheduler``) given, make them the module's optimizer (and scheduler)."""
        if not self.auto_configure_optimizers or self.model is None:
            return
        parser = self._parser(subcommand)
        optimizers = _automatic(parser._optimizers, (Optimizer,))
        schedulers = _automatic(parser._lr_schedulers, LRSchedulerTypeTuple)
        if not optimizers:
            return
        if len(optimizers) > 1 or len(schedulers) > 1:
            raise MisconfigurationError(
                f"{type(self).__name__} makes configure_optimizers from at most one optimizer and one scheduler group"
                f" linked 'AUTOMATIC', but found {optimizers + schedulers}. Link the groups to the module's arguments"
                " (link_to=...) and write configure_optimizers yourself."
            )
        optimizer_init = self._init_of(parser._optimizers, optimizers[0])
        if not optimizer_init:
            return  # the group exists, but no optimizer was given
        scheduler_init = self._init_of(parser._lr_schedulers, schedulers[0]) if schedulers else None
        if type(self.model).configure_optimizers is not TrainingModule.configure_optimizers:
            rank_zero_warn(
                f"{type(self.model).__name__}.configure_optimizers is replaced by {type(self).__name__}'s, which"
                " returns the --optimizer (and --lr_scheduler) given."
            )
        optimizer = instantiate_class(self.model.parameters(), optimizer_init)
        scheduler = instantiate_class(optimizer, scheduler_init) if scheduler_init else None
        function = partial(self.configure_optimizers, optimizer=optimizer, lr_scheduler=scheduler)
        update_wrapper(function, self.configure_optimizers)
        self.model.configure_optimizers = MethodType(function, self.model)

    def _init_of(self, register: dict[str, tuple[ClassGroup, str]], key: str) -> dict[str, Any] | None:
        init = self._get(self.config_init, key)
        class_type = register[key][0]
        if not isinstance(class_type, tuple):
            init = with_class_path(class_type, init)
        return init or None

    def _get(self, config: Namespace, key: str, default: Any = None) -> Any:
        """``config[key]``, inside the subcommand's part of the config when there is one."""
        return config.get(str(self.subcommand), config).get(key, default)

    # ------------------------------------------------------------------ running
    def _run_subcommand(self, subcommand: str) -> None:
        before = getattr(self, f"before_{subcommand}", None)
        if callable(before):
            before()
        method = getattr(self, subcommand, getattr(self.trainer, subcommand))
        method(**self._prepare_subcommand_kwargs(subcommand))
        after = getattr(self, f"after_{subcommand}", None)
        if callable(after):
            after()

    def _prepare_subcommand_kwargs(self, subcommand: str) -> dict[str, Any]:
        allowed = self._subcommand_method_arguments[subcommand]
        kwargs = {key: value for key, value in self.config_init[subcommand].items() if key in allowed}
        kwargs["model"] = self.model
        if self.datamodule is not None:
            kwargs["datamodule"] = self.datamodule
        return kwargs


class LightningCLI(PhalanxCLI):
    """:class:`PhalanxCLI` under Lightning's name, for scripts ported from Lightning: the same, but environment
    variables keep Lightning's prefix (``PL_FIT__TRAINER__MAX_EPOCHS``, ``PL_CONFIG``)."""

    env_prefix = "PL"


def _automatic(register: dict[str, tuple[ClassGroup, str]], base: tuple[type, ...]) -> list[str]:
    """The keys of ``register`` linked "AUTOMATIC" whose classes derive from ``base``."""
    found = []
    for key, (class_type, link_to) in register.items():
        classes = class_type if isinstance(class_type, tuple) else (class_type,)
        if link_to == "AUTOMATIC" and any(issubclass(cls, base) for cls in classes):
            found.append(key)
    return found


__all__ = ["LightningCLI", "PhalanxCLI"]
