"""ModelCheckpoint: save the model periodically, keep the best ``k`` files by a monitored metric."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from phalanx.callbacks._checkpoint_checks import (
    check_arguments,
    check_flags,
    check_template,
    check_time_interval,
    fill_template,
    local_parameters_finite,
)
from phalanx.callbacks._checkpoint_files import FILE_EXTENSION, is_url, reclaim_abandoned
from phalanx.callbacks._checkpoint_ranking import CheckpointRanking
from phalanx.callbacks._checkpoint_saves import CheckpointSaves, stage_name
from phalanx.callbacks.callback import Callback
from phalanx.utilities.rank_zero import rank_zero_info, rank_zero_warn

if TYPE_CHECKING:
    from phalanx.module import TrainingModule
    from phalanx.trainer.trainer import Trainer


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


class ModelCheckpoint(CheckpointSaves, CheckpointRanking, Checkpoint):
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
        save_last: Also write ``last.ckpt`` (the current state) at every save point. True: when a checkpoint of
            this state was just written at this save point, ``last.ckpt`` is a copy of it made by the strategy's
            ``CheckpointIO.copy_checkpoint`` (atomic; no second dump, no second FSDP gather), else its own save.
            ``"link"``: when a checkpoint of
            the current step was just written, ``last.ckpt`` is a relative symbolic link to it instead of a second
            copy (else a regular file, as with True); the link is switched, in one rename, before any older checkpoint
            is removed, so it never dangles. Where links cannot be made (some file systems, Windows without the
            privilege) regular files are written, with a warning. Local folders only (ValueError at ``setup`` for an
            fsspec URL).
        save_top_k: How many checkpoints to keep: ``-1`` all, ``0`` none, ``k`` the best ``k``.
        save_on_exception: When ``fit`` fails with an exception (KeyboardInterrupt included) after an optimizer step
            that no checkpoint holds yet, save one more checkpoint, named like the others by ``filename`` but under a
            new name (``-vN``) if that name is taken, so it never replaces a kept checkpoint; ``last.ckpt`` follows
            it when ``save_last`` is set. Not during the sanity check or ``fast_dev_run``, nor with non-finite
            parameters (unless ``save_on_nonfinite``). A save that fails itself only warns: the original exception
            is what ``fit`` raises. Single-process runs only: with several processes one rank cannot know whether
            the others failed too, and a save needs them all, so it would hang; there the setting is ignored with a
            warning at ``setup``.
        save_weights_only: Write only the module weights.
        mode: "min" or "max": whether a lower or higher ``monitor`` value is better. A non-finite value always
            ranks worst and is never the best.
        auto_insert_metric_name: Write ``{epoch}`` as ``epoch=3`` rather than ``3``.
        every_n_train_steps: Save after every ``n`` optimizer steps (0 or None: not by steps).
        train_time_interval: Save at the end of the first training batch after at least this much wall time (a
            ``datetime.timedelta``) has passed since training started or since the last save by time. Global rank 0's
            clock decides and every rank gets its decision (one broadcast per batch with several processes).
        every_n_epochs: Save every ``n`` epochs (the default, 1, unless ``every_n_train_steps`` or
            ``train_time_interval`` is set). The three triggers are mutually exclusive.
        save_on_train_epoch_end: Save at the end of the training epoch rather than after validation. By default, as
            in Lightning, the callback saves at the end of the training epoch (after that epoch's validation, and
            also when ``max_steps`` or a stop ends ``fit`` inside an epoch) unless validation runs several times per
            epoch (``val_check_interval`` other than 1.0) or not every epoch (``check_val_every_n_epoch`` other than
            1): then it saves after validation.
        enable_version_counter: When a name is taken (by a file this run did not write, or by a checkpoint this run
            still keeps, e.g. a second top-k save within an epoch named ``{epoch}``), append ``-v1``, ``-v2``... rather
            than overwrite it. False: overwrite.
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
        save_last: bool | str | None = None,
        save_top_k: int = 1,
        save_on_exception: bool = False,
        save_weights_only: bool = False,
        mode: str = "min",
        auto_insert_metric_name: bool = True,
        every_n_train_steps: int | None = None,
        train_time_interval: timedelta | None = None,
        every_n_epochs: int | None = None,
        save_on_train_epoch_end: bool | None = None,
        enable_version_counter: bool = True,
        save_on_nonfinite: bool = False,
    ) -> None:
        super().__init__()
        check_arguments(dirpath, filename, monitor, save_top_k, mode, every_n_train_steps, every_n_epochs)
        check_time_interval(train_time_interval, every_n_train_steps, every_n_epochs)
        check_flags(
            verbose=verbose,
            save_weights_only=save_weights_only,
            auto_insert_metric_name=auto_insert_metric_name,
            enable_version_counter=enable_version_counter,
            save_on_nonfinite=save_on_nonfinite,
            save_last=save_last,
            save_on_train_epoch_end=save_on_train_epoch_end,
            save_on_exception=save_on_exception,
        )

        self.monitor = monitor
        self.verbose = verbose
        self.save_last = save_last
        self.save_top_k = save_top_k
        self.save_on_exception = save_on_exception
        self.save_weights_only = save_weights_only
        self.mode = mode
        self.auto_insert_metric_name = auto_insert_metric_name
        self.enable_version_counter = enable_version_counter
        self.save_on_nonfinite = save_on_nonfinite
        self._save_on_train_epoch_end = save_on_train_epoch_end
        self._train_time_interval = train_time_interval
        if every_n_train_steps is None and every_n_epochs is None and train_time_interval is None:
            self._every_n_train_steps, self._every_n_epochs = 0, 1
        else:
            self._every_n_train_steps, self._every_n_epochs = every_n_train_steps or 0, every_n_epochs or 0

        self.dirpath: str | None = self._normalize_dir(dirpath) if dirpath is not None else None
        self.filename = filename

        self._init_ranking()

        # No need to save before a single optimizer step was taken.
        self._last_global_step_saved = 0
        # Files this callback wrote during this run (only those may be overwritten without a version suffix).
        self._written: set[str] = set()
        # Names claimed on rank 0 (hidden markers) whose checkpoint is not written yet.
        self._claimed: dict[str, Any] = {}
        self._pending_state: dict[str, Any] | None = None
        # (global step, decision) of the last finiteness check, so that one save point checks once.
        self._finite_at: tuple[int, bool] | None = None
        # The newest checkpoint written other than last.ckpt, and its global step: what ``save_last="link"`` points to.
        self._last_checkpoint_saved = ""
        self._last_checkpoint_step = -1
        # Symbolic links this callback made (``save_last="link"``): the only links it ever removes.
        self._links: set[str] = set()
        # Set when the file system refused a link once: save_last="link" writes files from then on.
        self._links_unsupported = False
        self._last_time_checked: float | None = None  # monotonic clock at the start of training / the last save by time
        self._sanity_checking = False

    # ------------------------------------------------------------------ properties
    @property
    def state_key(self) -> str:
        return self._generate_state_key(
            monitor=self.monitor,
            mode=self.mode,
            every_n_train_steps=self._every_n_train_steps,
            every_n_epochs=self._every_n_epochs,
            train_time_interval=self._train_time_interval,
        )

    @property
    def every_n_train_steps(self) -> int:
        """Save every this many optimizer steps (0: not by steps)."""
        return self._every_n_train_steps

    @property
    def every_n_epochs(self) -> int:
        """Save every this many epochs (0: not by epochs)."""
        return self._every_n_epochs

    @property
    def train_time_interval(self) -> timedelta | None:
        """Save after at least this much wall time (None: not by time)."""
        return self._train_time_interval

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        dirpath = self._resolve_dirpath(trainer)
        dirpath = trainer.strategy.broadcast(dirpath)
        self.dirpath = dirpath
        self._sanity_checking = False
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)
        if self.save_last == "link" and is_url(dirpath):
            raise ValueError(
                "ModelCheckpoint(save_last='link') makes a symbolic link, which needs a local folder;"
                f" dirpath={dirpath!r} is a URL. Use save_last=True there."
            )
        if stage == "fit" and self.save_on_exception and trainer.world_size > 1:
            rank_zero_warn(
                f"ModelCheckpoint(save_on_exception=True) is ignored with {trainer.world_size} processes: a rank that"
                " fails cannot know whether the others failed too, and a checkpoint needs every rank (it would hang)."
                " Save periodically instead (every_n_train_steps=, train_time_interval=)."
            )
        if stage == "fit" and trainer.is_global_zero:
            reclaim_abandoned(dirpath)  # what saves killed mid-way left: their hidden claims and temporaries
            self._warn_if_dir_not_empty(dirpath)

    def on_train_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._last_time_checked = time.monotonic()
        self._note_resumed_from(trainer)

    def on_sanity_check_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._sanity_checking = True

    def on_sanity_check_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._sanity_checking = False

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._should_skip_saving_checkpoint(trainer):
            return
        by_steps = self._every_n_train_steps >= 1 and trainer.global_step % self._every_n_train_steps == 0
        if not (self._time_to_save(trainer) or by_steps):
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

    # ------------------------------------------------------------------ file names
    def format_checkpoint_name(
        self, metrics: dict[str, Any], filename: str | None = None, ver: int | None = None
    ) -> str:
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
            or stage_name(trainer) != "fit"
            or bool(trainer.sanity_checking)
            or self._last_global_step_saved == trainer.global_step
        )

    def _should_save_on_train_epoch_end(self, trainer: Trainer) -> bool:
        if self._save_on_train_epoch_end is not None:
            return bool(self._save_on_train_epoch_end)
        if not getattr(trainer, "validation_enabled", False):
            return True  # Lightning checks check_val_every_n_epoch first and would never save here
        return trainer.check_val_every_n_epoch == 1 and trainer.val_check_interval == 1.0

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
        with trainer.strategy.host_reads():
            local = local_parameters_finite(module)
        finite = bool(trainer.strategy.reduce_boolean_decision(local, all=True))
        self._finite_at = (trainer.global_step, finite)
        return finite

    def _warn_nonfinite(self, trainer: Trainer) -> None:
        kept = [
            path for path in dict.fromkeys([self.best_model_path, *self.best_k_models, self.last_model_path]) if path
        ]
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
        # last.ckpt is named first, so that the top-k checkpoint written next (whose callback state names it) can
        # become last.ckpt by a link or a copy: one dump, and one gather of a sharded model, per save point.
        previous = self._claim_last(trainer, candidates) if self.save_last else None
        try:
            self._save_topk_checkpoint(trainer, candidates)
        except BaseException:
            if previous is not None:
                self._unclaim_last(previous)
            raise
        self._save_last_checkpoint(trainer, candidates, previous)

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
        self._relink_before_removal(trainer, candidates)
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
        self._relink_before_removal(trainer, candidates)
        if to_delete and to_delete != filepath:
            self._remove_checkpoint(trainer, to_delete)

    # ------------------------------------------------------------------ helpers
    def to_yaml(self, filepath: str | os.PathLike | None = None) -> None:
        """Write ``best_k_models`` (path: score) as YAML, to ``dirpath/best_k_models.yaml`` by default.

        ``yaml.safe_load`` reads it back as the same dict (``{}`` when nothing was saved; ``.inf`` for infinite scores).
        """
        # Lazy for import time: `import phalanx.callbacks` loads no logger module.
        from phalanx.loggers.csv import hparams_to_yaml  # the dependency-free YAML writer of hparams.yaml

        text = hparams_to_yaml({str(path): score.item() for path, score in self.best_k_models.items()})
        if filepath is None:
            assert self.dirpath is not None, "dirpath is known after setup"
            filepath = os.path.join(self.dirpath, "best_k_models.yaml")
        with open(filepath, "w", encoding="utf-8") as handle:
            handle.write(text)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(dirpath={self.dirpath!r}, filename={self.filename!r}, monitor={self.monitor!r},"
            f" mode={self.mode!r}, save_top_k={self.save_top_k}, save_last={self.save_last})"
        )
