"""ModelCheckpoint: save the model periodically, keep the best ``k`` files by a monitored metric."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from phalanx.callbacks._checkpoint_checks import (
    check_arguments,
    check_flags,
    check_template,
    fill_template,
    local_parameters_finite,
    restored_entries,
)
from phalanx.callbacks._checkpoint_files import (
    FILE_EXTENSION,
    checkpoint_in_folder,
    claim,
    exists,
    is_url,
    release,
    removal_refusal,
    same_location,
)
from phalanx.callbacks.callback import Callback
from phalanx.utilities.exceptions import CheckpointError
from phalanx.utilities.rank_zero import rank_zero_info, rank_zero_warn

if TYPE_CHECKING:
    from phalanx.module import TrainingModule
    from phalanx.trainer.trainer import Trainer


def _stage_name(trainer: Any) -> str:
    """``trainer.state.fn`` as a plain string (it may be an enum whose value is the string)."""
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    return str(getattr(fn, "value", fn))


def _as_python_number(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.item() if value.numel() == 1 else value
    return value


def _as_score(value: Any) -> Tensor:
    """A monitored value as a detached 0-dim floating CPU tensor (what the bookkeeping stores)."""
    if isinstance(value, Tensor):
        score = value.detach().reshape(()).cpu().clone()
        return score if score.is_floating_point() else score.double()
    return torch.tensor(float(value), dtype=torch.float64)


class Checkpoint(Callback):
    """Base class of the callbacks that write checkpoints (the Trainer looks them up by this type)."""


class ModelCheckpoint(Checkpoint):
    """Save checkpoints during ``fit``: every ``n`` steps or epochs, keeping the ``save_top_k`` best by ``monitor``.

    Only ``*.ckpt`` files and checkpoint directories (with their ``.complete`` marker) directly inside ``dirpath`` are
    ever overwritten or removed, whatever a resumed checkpoint's callback state names. New file names are claimed
    with an exclusive create on global rank 0 (and broadcast), so two runs sharing ``dirpath`` never write one file.

    Args:
        dirpath: Folder of the checkpoints. Defaults to ``trainer.log_dir/checkpoints`` when the Trainer has a
            logger, else ``trainer.default_root_dir/checkpoints``.
        filename: Name template without extension, e.g. ``"{epoch}-{val_loss:.2f}"``; fields are filled from the
            logged metrics plus ``epoch`` and ``step``. Defaults to ``"{epoch}-{step}"``. Checked at construction:
            ValueError for unbalanced braces, a bad format spec or conversion, a path separator outside a field, a
            leading '.', or an empty template.
        monitor: Metric (a key of ``trainer.callback_metrics``) that ranks the checkpoints; None keeps the newest.
        verbose: Report each decision.
        save_last: Also write ``last.ckpt`` at every save point.
        save_top_k: How many checkpoints to keep: ``-1`` all, ``0`` none, ``k`` the best ``k``.
        save_weights_only: Write only the module weights.
        mode: "min" or "max": whether a lower or higher ``monitor`` value is better. A non-finite value always
            ranks worst and is never the best.
        auto_insert_metric_name: Write ``{epoch}`` as ``epoch=3`` rather than ``3``.
        every_n_train_steps: Save after every ``n`` optimizer steps (0 or None: not by steps).
        every_n_epochs: Save every ``n`` epochs (the default, 1, unless ``every_n_train_steps`` is set).
        save_on_train_epoch_end: Save at the end of the training epoch rather than after validation. By default the
            callback saves after validation when validation runs during ``fit``.
        enable_version_counter: Append ``-v1``, ``-v2``... rather than overwrite a file this run did not write.
        save_on_nonfinite: Save even when the module's parameters are not all finite. By default (False) such a
            save point writes nothing, so no NaN/inf checkpoint replaces or evicts a good one (best, top-k,
            ``last.ckpt``); a warning names the checkpoints kept. All processes take the same decision.
    """

    CHECKPOINT_JOIN_CHAR = "-"
    CHECKPOINT_EQUALS_CHAR = "="
    CHECKPOINT_NAME_LAST = "last"
    FILE_EXTENSION = FILE_EXTENSION
    STARTING_VERSION = 1

    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        verbose: bool = False,
        save_last: bool | None = None,
        save_top_k: int = 1,
        save_weights_only: bool = False,
        mode: str = "min",
        auto_insert_metric_name: bool = True,
        every_n_train_steps: int | None = None,
        every_n_epochs: int | None = None,
        save_on_train_epoch_end: bool | None = None,
        enable_version_counter: bool = True,
        save_on_nonfinite: bool = False,
    ) -> None:
        super().__init__()
        check_arguments(dirpath, filename, monitor, save_top_k, mode, every_n_train_steps, every_n_epochs)
        check_flags(
            verbose=verbose, save_weights_only=save_weights_only, auto_insert_metric_name=auto_insert_metric_name,
            enable_version_counter=enable_version_counter, save_on_nonfinite=save_on_nonfinite, save_last=save_last,
            save_on_train_epoch_end=save_on_train_epoch_end,
        )

        self.monitor = monitor
        self.verbose = verbose
        self.save_last = save_last
        self.save_top_k = save_top_k
        self.save_weights_only = save_weights_only
        self.mode = mode
        self.auto_insert_metric_name = auto_insert_metric_name
        self.enable_version_counter = enable_version_counter
        self.save_on_nonfinite = save_on_nonfinite
        self._save_on_train_epoch_end = save_on_train_epoch_end
        if every_n_train_steps is None and every_n_epochs is None:
            self._every_n_train_steps, self._every_n_epochs = 0, 1
        else:
            self._every_n_train_steps, self._every_n_epochs = every_n_train_steps or 0, every_n_epochs or 0

        self.dirpath: str | None = self._normalize_dir(dirpath) if dirpath is not None else None
        self.filename = filename

        self.best_model_path = ""
        self.best_model_score: Tensor | None = None
        self.best_k_models: dict[str, Tensor] = {}
        self.kth_best_model_path = ""
        self.kth_value: Tensor = self._worst_score()
        self.last_model_path = ""
        self.current_score: Tensor | None = None

        # No need to save before a single optimizer step was taken.
        self._last_global_step_saved = 0
        # Files this callback wrote during this run (only those may be overwritten without a version suffix).
        self._written: set[str] = set()
        # Placeholders claimed on rank 0 and not yet replaced by their checkpoint.
        self._claimed: set[str] = set()
        self._pending_state: dict[str, Any] | None = None
        # (global step, decision) of the last finiteness check, so that one save point checks once.
        self._finite_at: tuple[int, bool] | None = None

    # ------------------------------------------------------------------ properties
    @property
    def state_key(self) -> str:
        return self._generate_state_key(
            monitor=self.monitor,
            mode=self.mode,
            every_n_train_steps=self._every_n_train_steps,
            every_n_epochs=self._every_n_epochs,
            train_time_interval=None,
        )

    @property
    def every_n_train_steps(self) -> int:
        """Save every this many optimizer steps (0: not by steps)."""
        return self._every_n_train_steps

    @property
    def every_n_epochs(self) -> int:
        """Save every this many epochs (0: not by epochs)."""
        return self._every_n_epochs

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        dirpath = self._resolve_dirpath(trainer)
        dirpath = trainer.strategy.broadcast(dirpath)
        self.dirpath = dirpath
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)
        if stage == "fit" and trainer.is_global_zero:
            self._warn_if_dir_not_empty(dirpath)

    def on_train_batch_end(self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._should_skip_saving_checkpoint(trainer):
            return
        if self._every_n_train_steps < 1 or trainer.global_step % self._every_n_train_steps != 0:
            return
        self._save_at_this_point(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if self._should_skip_saving_checkpoint(trainer) or not self._should_save_on_train_epoch_end(trainer):
            return
        if self._is_epoch_to_save(trainer):
            self._save_at_this_point(trainer)

    def on_train_end(self, trainer: Trainer, module: TrainingModule) -> None:
        """With ``save_last``, training always ends with ``last.ckpt`` of its final state, as in Lightning."""
        if not self.save_last or self._should_skip_saving_checkpoint(trainer):
            return
        if not self._parameters_finite(trainer):
            self._warn_nonfinite(trainer)
            return
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if self._should_skip_saving_checkpoint(trainer) or self._should_save_on_train_epoch_end(trainer):
            return
        if self._is_epoch_to_save(trainer):
            self._save_at_this_point(trainer)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "monitor": self.monitor,
            "best_model_score": self.best_model_score,
            "best_model_path": self.best_model_path,
            "current_score": self.current_score,
            "dirpath": self.dirpath,
            "best_k_models": dict(self.best_k_models),
            "kth_best_model_path": self.kth_best_model_path,
            "kth_value": self.kth_value,
            "last_model_path": self.last_model_path,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the bookkeeping; paths that are not checkpoints inside ``dirpath`` are dropped with a warning."""
        if not isinstance(state_dict, dict):
            raise CheckpointError(f"The ModelCheckpoint state in this checkpoint is a {type(state_dict).__name__}, not a dict.")
        if self.dirpath is None and state_dict.get("dirpath") is not None:
            # The folder is resolved in ``setup``; compare once it is known.
            self._pending_state = dict(state_dict)
            return
        saved_dirpath = state_dict.get("dirpath", self.dirpath)
        if saved_dirpath == self.dirpath:
            self._restore_ranking(state_dict)
            return
        rank_zero_warn(
            f"The checkpoint folder changed from {saved_dirpath!r} to {self.dirpath!r}: only `best_model_path`"
            " is restored; the top-k bookkeeping starts afresh in the new folder."
        )
        # Kept for ckpt_path="best" only: a path outside ``dirpath`` is never overwritten nor removed.
        best = state_dict.get("best_model_path", "")
        self.best_model_path = best if isinstance(best, str) else ""

    def _restore_ranking(self, state: dict[str, Any]) -> None:
        best_k, entries, dropped = restored_entries(state, self.dirpath or "")
        self.best_k_models = {path: self._finite_or_worst(score) for path, score in best_k.items()}
        self.last_model_path = entries["last_model_path"]
        self.current_score = entries["current_score"]
        if self.best_k_models:
            # Recomputed from the entries kept rather than trusted: a dropped k-th entry would be looked up.
            self._update_ranking()
        else:
            best, score = entries["best_model_path"], entries["best_model_score"]
            self.best_model_path = best
            self.best_model_score = score if best and score is not None and bool(torch.isfinite(score)) else None
        if dropped:
            rank_zero_warn(
                f"ModelCheckpoint ignored paths in the resumed checkpoint's callback state that are not '*{FILE_EXTENSION}'"
                f" entries directly inside dirpath {self.dirpath!r}: {', '.join(dropped)}. The callback never overwrites"
                " or removes anything outside its folder."
            )

    # ------------------------------------------------------------------ file names
    def format_checkpoint_name(self, metrics: dict[str, Any], filename: str | None = None, ver: int | None = None) -> str:
        """Return the checkpoint path for ``metrics`` (joined with ``dirpath`` once it is known).

        >>> ModelCheckpoint(dirpath="ckpts", filename="{epoch}").format_checkpoint_name({"epoch": 3})
        'ckpts/epoch=3.ckpt'
        >>> ModelCheckpoint(dirpath="ckpts", filename="{val/loss:.2f}").format_checkpoint_name({"val/loss": 0.123})
        'ckpts/val_loss=0.12.ckpt'
        """
        if filename is not None:
            if not isinstance(filename, str):
                raise TypeError(f"`filename` must be a str template or None, got {type(filename).__name__}.")
            check_template(filename)
        template = filename if filename is not None else self.filename
        template = template or "{epoch}" + self.CHECKPOINT_JOIN_CHAR + "{step}"
        equals = self.CHECKPOINT_EQUALS_CHAR if self.auto_insert_metric_name else None
        name = fill_template(template, {key: _as_python_number(value) for key, value in metrics.items()}, equals)
        if ver is not None:
            name = self.CHECKPOINT_JOIN_CHAR.join((name, f"v{ver}"))
        name += self.FILE_EXTENSION
        return os.path.join(self.dirpath, name) if self.dirpath else name

    def file_exists(self, filepath: str, trainer: Trainer) -> bool:
        """Whether ``filepath`` exists, as seen by rank 0 (so every rank takes the same decision)."""
        found = exists(filepath) if trainer.is_global_zero else False
        return bool(trainer.strategy.broadcast(found))

    # ------------------------------------------------------------------ decisions
    def check_monitor_top_k(self, trainer: Trainer, current: Tensor | None = None) -> bool:
        """Whether a checkpoint with monitored value ``current`` belongs in the top ``k``."""
        if current is None or self.save_top_k == 0:
            return False
        if self.save_top_k == -1 or len(self.best_k_models) < self.save_top_k:
            return True
        current = self._finite_or_worst(_as_score(current))
        kth = self.best_k_models[self.kth_best_model_path]
        better = bool(current < kth) if self.mode == "min" else bool(current > kth)
        return bool(trainer.strategy.reduce_boolean_decision(better, all=True))

    def _should_skip_saving_checkpoint(self, trainer: Trainer) -> bool:
        return (
            bool(trainer.fast_dev_run)
            or _stage_name(trainer) != "fit"
            or bool(trainer.sanity_checking)
            or self._last_global_step_saved == trainer.global_step
        )

    def _should_save_on_train_epoch_end(self, trainer: Trainer) -> bool:
        if self._save_on_train_epoch_end is not None:
            return bool(self._save_on_train_epoch_end)
        return not bool(getattr(trainer, "validation_enabled", False))

    def _is_epoch_to_save(self, trainer: Trainer) -> bool:
        return self._every_n_epochs >= 1 and (trainer.current_epoch + 1) % self._every_n_epochs == 0

    def _parameters_finite(self, trainer: Trainer) -> bool:
        """Whether the module's parameters are all finite on every process (checked once per save point)."""
        if self.save_on_nonfinite:
            return True
        if self._finite_at is not None and self._finite_at[0] == trainer.global_step:
            return self._finite_at[1]
        module = getattr(trainer.strategy, "module", None)
        if module is None:
            return True
        finite = bool(trainer.strategy.reduce_boolean_decision(local_parameters_finite(module), all=True))
        self._finite_at = (trainer.global_step, finite)
        return finite

    def _warn_nonfinite(self, trainer: Trainer) -> None:
        kept = [path for path in dict.fromkeys([self.best_model_path, *self.best_k_models, self.last_model_path]) if path]
        rank_zero_warn(
            f"ModelCheckpoint: the module's parameters are not all finite at epoch {trainer.current_epoch}, global"
            f" step {trainer.global_step} (did the loss become NaN or inf?). Nothing is saved at this point and no"
            f" checkpoint is replaced or removed; kept: {', '.join(kept) if kept else 'none written yet'}. Pass"
            " ModelCheckpoint(save_on_nonfinite=True) to save such checkpoints anyway."
        )

    # ------------------------------------------------------------------ saving
    def _monitor_candidates(self, trainer: Trainer) -> dict[str, Any]:
        candidates = dict(trainer.callback_metrics)
        epoch = candidates.get("epoch")
        candidates["epoch"] = epoch.int() if isinstance(epoch, Tensor) else torch.tensor(trainer.current_epoch)
        step = candidates.get("step")
        candidates["step"] = step.int() if isinstance(step, Tensor) else torch.tensor(trainer.global_step)
        return candidates

    def _save_at_this_point(self, trainer: Trainer) -> None:
        if self.save_top_k == 0 and not self.save_last:
            return
        if not self._parameters_finite(trainer):
            self._warn_nonfinite(trainer)
            # Counted as handled, so that the other hooks of this step neither check nor warn again.
            self._last_global_step_saved = trainer.global_step
            return
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)

    def _save_topk_checkpoint(self, trainer: Trainer, candidates: dict[str, Any]) -> None:
        if self.save_top_k == 0:
            return
        if self.monitor is None:
            self._save_none_monitor_checkpoint(trainer, candidates)
            return
        if self.monitor not in candidates:
            available = sorted(trainer.callback_metrics)
            raise ValueError(
                f"`ModelCheckpoint(monitor={self.monitor!r})` could not find {self.monitor!r} in the logged metrics."
                f" Available keys: {available}. Log it with `self.log({self.monitor!r}, value)` in the"
                " TrainingModule (in validation_step when it is a validation metric), or change `monitor`."
            )
        current = _as_score(candidates[self.monitor])
        if self.check_monitor_top_k(trainer, current):
            self._update_best_and_save(current, trainer, candidates)
        elif self.verbose:
            rank_zero_info(
                f"Epoch {trainer.current_epoch}, global step {trainer.global_step}: {self.monitor!r} was not in"
                f" top {self.save_top_k}"
            )

    def _save_none_monitor_checkpoint(self, trainer: Trainer, candidates: dict[str, Any]) -> None:
        filepath = self._filepath_for(candidates, trainer, reusable=self.best_model_path)
        previous, self.best_model_path = self.best_model_path, filepath
        self._save_checkpoint(trainer, filepath)
        if self.save_top_k == 1 and previous and previous != filepath:
            self._remove_checkpoint(trainer, previous)

    def _update_best_and_save(self, current: Tensor, trainer: Trainer, candidates: dict[str, Any]) -> None:
        k = len(self.best_k_models) + 1 if self.save_top_k == -1 else self.save_top_k
        to_delete = None
        if len(self.best_k_models) == k and k > 0:
            to_delete = self.kth_best_model_path
            self.best_k_models.pop(to_delete)

        current = self._finite_or_worst(current)
        self.current_score = current
        filepath = self._filepath_for(candidates, trainer, reusable=to_delete)
        self.best_k_models[filepath] = current
        self._update_ranking(full=len(self.best_k_models) == k)

        if self.verbose:
            rank_zero_info(
                f"Epoch {trainer.current_epoch}, global step {trainer.global_step}: {self.monitor!r} reached"
                f" {current.item():.5f} (best {self._score_text(self.best_model_score)}), saving model to"
                f" {filepath!r} as top {k}"
            )
        self._save_checkpoint(trainer, filepath)
        if to_delete and to_delete != filepath:
            self._remove_checkpoint(trainer, to_delete)

    def _update_ranking(self, full: bool = True) -> None:
        """Recompute the k-th (worst kept) and the best entry of ``best_k_models``."""
        if full:
            worst = max if self.mode == "min" else min
            self.kth_best_model_path = worst(self.best_k_models, key=lambda p: self.best_k_models[p].item())
            self.kth_value = self.best_k_models[self.kth_best_model_path]
        if self.best_k_models:
            # Non-finite scores are stored as the worst value, so a finite one always wins; when every kept score
            # is non-finite the (equally worst) first one is the best there is, as in Lightning.
            best = min if self.mode == "min" else max
            self.best_model_path = best(self.best_k_models, key=lambda p: self.best_k_models[p].item())
            self.best_model_score = self.best_k_models[self.best_model_path]
        else:
            self.best_model_path, self.best_model_score = "", None

    def _save_last_checkpoint(self, trainer: Trainer, candidates: dict[str, Any]) -> None:
        if not self.save_last:
            return
        filepath = self._filepath_for(candidates, trainer, reusable=self.last_model_path, template=self.CHECKPOINT_NAME_LAST)
        previous, self.last_model_path = self.last_model_path, filepath
        self._save_checkpoint(trainer, filepath)
        if previous and previous != filepath and previous not in self.best_k_models and previous != self.best_model_path:
            self._remove_checkpoint(trainer, previous)

    def _filepath_for(self, candidates: dict[str, Any], trainer: Trainer, reusable: str | None, template: str | None = None) -> str:
        """The path for this save: rank 0 decides (claiming a new name exclusively) and every rank gets its answer."""
        filepath = self._claim_name(candidates, reusable, template) if trainer.is_global_zero else None
        return trainer.strategy.broadcast(filepath)

    def _claim_name(self, candidates: dict[str, Any], reusable: str | None, template: str | None) -> str:
        """The first of NAME, NAME-v1, NAME-v2... that this run owns or could create (rank 0 only)."""
        filepath = self.format_checkpoint_name(candidates, template)
        if not self.enable_version_counter:
            return filepath
        version = self.STARTING_VERSION
        # A placeholder made by an exclusive create reserves a new name: another run saving the same name at the
        # same moment gets the next version rather than overwriting this run's file (check-then-write would not).
        while filepath != reusable and not self._owns(filepath) and not claim(filepath):
            filepath = self.format_checkpoint_name(candidates, template, ver=version)
            version += 1
        if filepath != reusable and not self._owns(filepath):
            self._claimed.add(filepath)
        return filepath

    def _owns(self, filepath: str) -> bool:
        return filepath in self._written or filepath in self.best_k_models or filepath == self.last_model_path

    def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        try:
            trainer.save_checkpoint(filepath, weights_only=self.save_weights_only)
        except BaseException:
            if filepath in self._claimed:
                release(filepath)
            raise
        finally:
            self._claimed.discard(filepath)
        self._last_global_step_saved = trainer.global_step
        self._written.add(filepath)
        for logger in trainer.loggers or []:
            logger.after_save_checkpoint(self)

    def _remove_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        """Remove ``filepath`` if it is a checkpoint inside ``dirpath``; never anything else."""
        target = checkpoint_in_folder(filepath, self.dirpath) if self.dirpath else None
        # Rank 0 decides for all (one broadcast on every rank, whatever each rank's file system says).
        refusal = self._removal_refusal(trainer, filepath, target) if trainer.is_global_zero else None
        refusal = trainer.strategy.broadcast(refusal)
        if refusal is None:
            trainer.strategy.remove_checkpoint(target if target is not None else filepath)
        elif refusal:
            rank_zero_warn(
                f"ModelCheckpoint: not removing {filepath!r}: {refusal}. Only '*{FILE_EXTENSION}' files and checkpoint"
                " directories written by phalanx directly inside dirpath are ever removed."
            )
        self._written.discard(filepath)

    def _removal_refusal(self, trainer: Trainer, filepath: str, target: str | None) -> str | None:
        """Why rank 0 keeps ``filepath``: None to remove it, "" to keep it silently, else the reason."""
        if target is None:
            return f"it is not a '*{FILE_EXTENSION}' entry directly inside dirpath {self.dirpath!r}"
        if same_location(getattr(trainer, "ckpt_path", None), target):
            return ""  # never delete the checkpoint this run resumed from
        return removal_refusal(target, may_be_pending=filepath in self._written)

    # ------------------------------------------------------------------ helpers
    def _worst_score(self, dtype: torch.dtype | None = None) -> Tensor:
        return torch.tensor(math.inf if self.mode == "min" else -math.inf, dtype=dtype)

    def _finite_or_worst(self, score: Tensor) -> Tensor:
        """``score`` when finite, else the worst value for ``mode``: NaN and inf never rank above a finite score."""
        return score if torch.isfinite(score) else self._worst_score(score.dtype)

    @staticmethod
    def _score_text(score: Tensor | None) -> str:
        return "none" if score is None else f"{score.item():.5f}"

    @staticmethod
    def _normalize_dir(dirpath: str | os.PathLike) -> str:
        path = os.fspath(dirpath)
        if is_url(path):
            return path.rstrip("/")
        return os.path.realpath(os.path.expanduser(path))

    def _resolve_dirpath(self, trainer: Trainer) -> str:
        if self.dirpath is not None:
            return self.dirpath
        base = None
        if trainer.loggers:
            base = trainer.log_dir
        if base is None:
            base = trainer.default_root_dir
        return self._normalize_dir(os.path.join(os.fspath(base), "checkpoints"))

    def _warn_if_dir_not_empty(self, dirpath: str) -> None:
        if self.save_top_k == 0 or is_url(dirpath):
            return
        if os.path.isdir(dirpath) and any(name.endswith(self.FILE_EXTENSION) for name in os.listdir(dirpath)):
            rank_zero_warn(f"Checkpoint directory {dirpath} exists and is not empty.")

    def to_yaml(self, filepath: str | os.PathLike | None = None) -> None:
        """Write ``best_k_models`` (path: score) as YAML, to ``dirpath/best_k_models.yaml`` by default."""
        lines = [f"{path!s}: {score.item()!r}" for path, score in self.best_k_models.items()]
        if filepath is None:
            assert self.dirpath is not None, "dirpath is known after setup"
            filepath = os.path.join(self.dirpath, "best_k_models.yaml")
        with open(filepath, "w") as handle:
            handle.write("\n".join(lines) + ("\n" if lines else ""))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(dirpath={self.dirpath!r}, filename={self.filename!r}, monitor={self.monitor!r},"
            f" mode={self.mode!r}, save_top_k={self.save_top_k}, save_last={self.save_last})"
        )
