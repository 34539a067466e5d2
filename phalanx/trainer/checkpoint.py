"""Building a checkpoint from the Trainer's state, and restoring the Trainer from one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from phalanx import __version__
from phalanx.optimization import load_scheduler_states
from phalanx.plugins.io.checkpoint_files import path_inside
from phalanx.plugins.io.checks import (
    check_checkpoint,
    check_loadable,
    check_optimizer_states,
    check_scheduler_states,
    check_weights,
    check_weights_fit,
    plain_hyperparameters,
)
from phalanx.plugins.io.directory import COMPLETE_MARKER
from phalanx.plugins.io.serialization import is_url
from phalanx.strategies.strategy import Strategy
from phalanx.trainer.resume import (
    Choice,
    choose_checkpoint,
    differing_hparams,
    experiment_folders,
    is_complete_checkpoint,
    module_hparams,
    newest_complete_checkpoint,
)
from phalanx.utilities.exceptions import CheckpointError
from phalanx.utilities.rank_zero import rank_zero_print, rank_zero_warn
from phalanx.utilities.seed import collect_rng_states

if TYPE_CHECKING:
    from phalanx.callbacks.callback import Callback
    from phalanx.trainer.trainer import Trainer

#: Loads one entry of a state: called with the entry's name (for errors), the owner's ``load_state_dict`` and the state.
EntryLoader = Callable[[str, Callable[[Any], None], Any], None]


def callback_states(callbacks: Sequence[Callback]) -> dict[str, Any]:
    """The "callbacks" entry of a checkpoint: each callback's non-empty ``state_dict()`` under its ``state_key``."""
    # One state_dict() call per callback, as in Lightning: a callback may count or log its saves there.
    states = ((callback.state_key, callback.state_dict()) for callback in callbacks)
    return {key: state for key, state in states if state}


def load_callback_states(callbacks: Sequence[Callback], states: Mapping[str, Any], load: EntryLoader) -> None:
    """Give each callback its state from a "callbacks" entry (``callback_states``); a callback without one keeps its
    own, and a state no callback claims is ignored."""
    for callback in callbacks:
        if callback.state_key in states:
            load(f"['callbacks'][{callback.state_key!r}]", callback.load_state_dict, states[callback.state_key])


def trainer_callback_states(trainer: Trainer) -> dict[str, Any]:
    """``callback_states`` of ``trainer``'s callbacks (what a fault-tolerant replica group sends one that rejoins)."""
    return callback_states(trainer.callbacks)


def load_peer_callback_states(trainer: Trainer, states: Mapping[str, Any]) -> None:
    """Load ``trainer_callback_states`` of a peer replica group into ``trainer``'s callbacks."""
    load_callback_states(trainer.callbacks, states, _load_peer_entry)


def _load_peer_entry(entry: str, load: Callable[[Any], None], state: Any) -> None:
    try:
        load(state)
    except Exception as error:
        raise ValueError(
            f"The state{entry} that a peer replica group sent could not be loaded into its callback"
            f" ({type(error).__name__}: {error})."
            " Every replica group must run the same callbacks, made with the same arguments."
        ) from error


def _refuse_link_outside(path: Path) -> None:
    """Refuse a ``last`` link that leads outside its folder (phalanx's ``save_last="link"`` names a sibling)."""
    if not is_url(path) and path.is_symlink():
        path_inside(path, root=path.parent, what=f"the link {path.name}")


def _listed(folders: list[Path]) -> str:
    shown = ", ".join(str(folder) for folder in folders[:3])
    return shown + (f" and {len(folders) - 3} more folder(s)" if len(folders) > 3 else "")


class CheckpointConnector:
    """Dumps the Trainer's state into a checkpoint dictionary and restores it."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self._source = "checkpoint"  # the path of the checkpoint being restored, for error messages

    def dump(self, weights_only: bool = False) -> dict[str, Any]:
        """Return the checkpoint dictionary of the current state (every rank calls this: RNG states are gathered)."""
        trainer = self.trainer
        strategy = trainer.strategy
        module = strategy.module
        assert module is not None
        trainer.fit_loop.nonfinite.report()  # a save reads values on the host anyway: a good moment for 'warn'
        checkpoint: dict[str, Any] = {
            "phalanx_version": __version__,
            "pytorch_version": str(torch.__version__),
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
            "state_dict": strategy.module_state_dict(),
            "loops": {"fit_loop": trainer.fit_loop.state_dict()},
        }
        if module.hparams:
            checkpoint["hyper_parameters"] = plain_hyperparameters(dict(module.hparams), type(module).__name__)
        datamodule = trainer.datamodule
        if datamodule is not None and datamodule.hparams:
            checkpoint["datamodule_hyper_parameters"] = plain_hyperparameters(
                dict(datamodule.hparams), type(datamodule).__name__
            )
        if not weights_only:
            checkpoint["optimizer_states"] = [strategy.optimizer_state(optimizer) for optimizer in strategy.optimizers]
            checkpoint["lr_schedulers"] = [config.scheduler.state_dict() for config in strategy.lr_scheduler_configs]
            precision_state = strategy.precision_plugin.state_dict()
            if precision_state:
                checkpoint["precision_plugin"] = precision_state
            checkpoint["callbacks"] = callback_states(trainer.callbacks)
            checkpoint["rng_states"] = strategy.all_gather_object(collect_rng_states())
            if datamodule is not None:
                state = datamodule.state_dict()
                if state:
                    checkpoint["datamodule"] = state
            for callback in trainer.callbacks:
                callback.on_save_checkpoint(trainer, module, checkpoint)
            if datamodule is not None:
                datamodule.on_save_checkpoint(checkpoint)
        module.on_save_checkpoint(checkpoint)
        check_loadable(checkpoint)
        return checkpoint

    # ------------------------------------------------------------------ restoring
    def resolve_path(self, ckpt_path: Any) -> str | None:
        """Turn 'last', 'best' or a path into a path, with clear errors."""
        if ckpt_path is None:
            return None
        trainer = self.trainer
        if ckpt_path == "auto":
            return self._resolve_auto()
        if ckpt_path in ("best", "last"):
            callback = trainer.checkpoint_callback
            if callback is None:
                raise ValueError(
                    f"ckpt_path={ckpt_path!r} needs a ModelCheckpoint callback; none is configured"
                    " (enable_checkpointing=False?)."
                )
            if ckpt_path == "best":
                path = getattr(callback, "best_model_path", "")
                if not path:
                    raise ValueError(
                        "ckpt_path='best': the ModelCheckpoint callback has no best checkpoint yet (nothing was saved"
                        " or it has no monitor)."
                    )
                return str(path)
            path = getattr(callback, "last_model_path", "")
            if not path or ("://" not in str(path) and not Path(path).exists()):
                # A last.ckpt recorded by this process whose background write failed was never made: look on disk.
                path = self._find_last(callback)
            if not path:
                raise ValueError(
                    f"ckpt_path='last': no complete last checkpoint (last*.ckpt) in {self._last_directory(callback)}."
                    " Save one with ModelCheckpoint(save_last=True), pass a checkpoint's path,"
                    " or pass ckpt_path='auto' to resume from this run's newest complete checkpoint or start afresh."
                )
            _refuse_link_outside(Path(path))
            return str(path)
        if not isinstance(ckpt_path, (str, Path)):
            raise TypeError(f"ckpt_path must be 'auto', 'last', 'best' or a path, got {type(ckpt_path).__name__}.")
        return str(ckpt_path)

    def _resolve_auto(self) -> str | None:
        choice = self.auto_choice()
        # One line on rank 0, shown without any logging set-up: which file the run goes on from and why, or that none
        # was found and where the run looked.
        searched = _listed(self.search_directories())
        skipped = f" ({choice.passed_over})" if choice.passed_over else ""
        if choice.path is None or choice.progress is None:
            rank_zero_print(f"ckpt_path='auto': no complete checkpoint in {searched}{skipped}; starting from scratch")
            return None
        progress = choice.progress
        rank_zero_print(
            f"ckpt_path='auto': resuming from {choice.path} (global step {progress.global_step}, epoch"
            f" {progress.epoch}): {choice.reason} in {searched}{skipped}"
        )
        return choice.path

    def search_directories(self) -> list[Path]:
        """Where ``ckpt_path="auto"`` looks: this run's checkpoint folders (every ModelCheckpoint's, the preemption
        folder), then those of the experiment's other ``version_N`` runs (see ``phalanx.trainer.resume``)."""
        own, experiment = self._folders()
        return own + experiment

    def _folders(self) -> tuple[list[Path], list[Path]]:
        trainer = self.trainer
        named = [cb.dirpath for cb in trainer.checkpoint_callbacks if getattr(cb, "dirpath", None)]
        own: dict[str, Path] = {}
        for folder in [*named, trainer.checkpoint_dir]:
            if not is_url(folder):
                own.setdefault(os.path.realpath(folder), Path(folder))
        experiment: dict[str, Path] = {}
        for folder in own.values():
            for sibling in experiment_folders(Path(os.path.realpath(folder))):
                if os.path.realpath(sibling) not in own:
                    experiment.setdefault(os.path.realpath(sibling), sibling)
        return list(own.values()), list(experiment.values())

    def auto_choice(self) -> Choice:
        """The checkpoint ``ckpt_path="auto"`` resumes from: rank 0 decides, every rank gets the answer (or the error
        that stops the resume: a complete checkpoint whose progress cannot be read)."""
        trainer = self.trainer
        outcome: tuple[Choice | None, Exception | None] = (None, None)
        # The rank that broadcasts decides: rank 0 of the strategy's processes. It is the global zero, except in a
        # fault-tolerant replica group other than group 0, which has none and searches its own folders.
        if trainer.strategy.global_rank == 0:
            own, experiment = self._folders()
            hparams = module_hparams(trainer.strategy.module)
            try:
                choice = choose_checkpoint(
                    own + experiment,
                    experiment=frozenset(os.path.realpath(folder) for folder in experiment),
                    hparams=hparams,
                )
                outcome = (choice, None)
            except CheckpointError as error:
                hint = "ckpt_path='auto' reads how far each checkpoint of this run got, and cannot read this one."
                advice = "Move it away, or pass the checkpoint to resume from as ckpt_path."
                outcome = (None, type(error)(f"{error} {hint} {advice}"))
            differing = differing_hparams(outcome[0].progress, hparams) if outcome[0] and outcome[0].progress else []
            if differing:
                rank_zero_warn(
                    f"ckpt_path='auto' resumes from {outcome[0].path}, saved with other values of the"
                    f" hyper-parameters {differing} than {type(trainer.strategy.module).__name__} has now."
                )
        choice, error = trainer.strategy.broadcast(outcome)
        if error is not None:
            raise error
        return choice

    def find_newest_complete(self) -> str | None:
        """The path of ``auto_choice`` (every rank gets it), or None when this run has no complete checkpoint."""
        return self.auto_choice().path

    def _last_directory(self, callback: Any) -> Path:
        dirpath = getattr(callback, "dirpath", None)
        return Path(dirpath) if dirpath is not None else Path(self.trainer.default_root_dir) / "checkpoints"

    def _find_last(self, callback: Any) -> str:
        # Only complete ones: an empty file (a name an earlier phalanx reserved) or one cut short is passed over.
        directory = self._last_directory(callback)
        return newest_complete_checkpoint([directory], name_prefix="last") or ""

    def load(self, path: str, *, fitting: bool = False) -> dict[str, Any]:
        """Read a checkpoint through the strategy and check its entries (with ``fitting``, the training state too)."""
        checkpoint = self.trainer.strategy.load_checkpoint(path)
        check_checkpoint(checkpoint, str(path), fitting=fitting)
        self._source = str(path)
        return checkpoint

    def check_model_state(self, checkpoint: dict[str, Any]) -> None:
        """Let the module read its entries (``on_load_checkpoint``), then check the weights against it, loading nothing.

        Only for strategies that load the weights into the plain module (``restore_checkpoint_after_setup`` False).
        """
        module = self.trainer.strategy.module
        assert module is not None
        module.on_load_checkpoint(checkpoint)
        check_weights(self._source, checkpoint.get("state_dict"))
        check_weights_fit(
            self._source, checkpoint["state_dict"], module.state_dict(), strict=True, owner=type(module).__name__
        )

    def check_training_state(self, checkpoint: dict[str, Any]) -> None:
        """Check the optimizer and scheduler states against the live optimizers and schedulers, loading nothing."""
        strategy = self.trainer.strategy
        if strategy.traits.restores_optimizer:
            return  # the strategy restored them itself while reading the checkpoint
        if type(strategy).load_optimizer_state_dict is Strategy.load_optimizer_state_dict:
            check_optimizer_states(self._source, checkpoint["optimizer_states"], strategy.optimizers)
        check_scheduler_states(self._source, checkpoint.get("lr_schedulers", []), strategy.lr_scheduler_configs)

    def restore_model(self, checkpoint: dict[str, Any], *, hook_called: bool = False) -> None:
        """Load the module weights (and let the module read its own entries, unless ``check_model_state`` did)."""
        strategy = self.trainer.strategy
        assert strategy.module is not None
        if not hook_called:
            strategy.module.on_load_checkpoint(checkpoint)
            if not strategy.traits.restore_checkpoint_after_setup:
                check_weights_fit(
                    self._source,
                    checkpoint["state_dict"],
                    strategy.module.state_dict(),
                    strict=True,
                    owner=type(strategy.module).__name__,
                )
        strategy.load_model_state_dict(checkpoint)

    def restore_callbacks_and_datamodule(self, checkpoint: dict[str, Any]) -> None:
        """Restore the datamodule's state, then the callbacks': every ``on_load_checkpoint``, then every
        ``load_state_dict`` (Lightning's order). Before ``on_fit_start``, which may rely on it (a finetuning callback
        restores its parameter groups there)."""
        trainer = self.trainer
        module, datamodule = trainer.strategy.module, trainer.datamodule
        if datamodule is not None:
            datamodule.on_load_checkpoint(checkpoint)
            if "datamodule" in checkpoint:
                self._apply("['datamodule']", datamodule.load_state_dict, checkpoint["datamodule"])
        for callback in trainer.callbacks:
            callback.on_load_checkpoint(trainer, module, checkpoint)
        load_callback_states(trainer.callbacks, checkpoint.get("callbacks", {}), self._apply)

    def restore_training_state(self, checkpoint: dict[str, Any]) -> None:
        """Restore precision, optimizers, schedulers and loop progress, after ``on_fit_start`` as in Lightning.

        The optimizer states are checked against the optimizers as ``on_fit_start`` left them (a callback may have
        added parameter groups there) before anything of them is applied.
        """
        trainer = self.trainer
        strategy = trainer.strategy
        self.check_training_state(checkpoint)
        if "precision_plugin" in checkpoint:
            self._apply(
                "['precision_plugin']", strategy.precision_plugin.load_state_dict, checkpoint["precision_plugin"]
            )
        if not strategy.traits.restores_optimizer:
            strategy.load_optimizer_state_dict(checkpoint)
            load_scheduler_states(
                strategy.lr_scheduler_configs, checkpoint.get("lr_schedulers", []), f"The checkpoint {self._source}"
            )
        if checkpoint.get("global_step", 0) > 0:
            # These optimizers have stepped before the checkpoint; without this flag torch warns that a scheduler
            # steps "before optimizer.step()" when a resumed run's first action is an epoch-end scheduler step.
            for optimizer in strategy.optimizers:
                optimizer._opt_called = True  # type: ignore[attr-defined]
        rng_states = checkpoint["rng_states"]
        rank = strategy.global_rank
        own_rng = rng_states[rank] if rank < len(rng_states) else None
        trainer.fit_loop.load_state_dict(checkpoint["loops"]["fit_loop"], rng_states=own_rng)

    def _apply(self, entry: str, load: Any, state: Any) -> None:
        # The owners of these entries (callbacks, plugins, the datamodule) check their own state: name the entry.
        try:
            load(state)
        except Exception as error:
            raise CheckpointError(
                f"{self._source}: checkpoint{entry} could not be restored ({type(error).__name__}: {error})."
            ) from error


# COMPLETE_MARKER and the two helpers are named here as well: code and tests that check checkpoints import them here.
__all__ = ["COMPLETE_MARKER", "CheckpointConnector", "is_complete_checkpoint", "newest_complete_checkpoint"]
