"""ModelCheckpoint's file operations: claiming names, writing, ``last.ckpt`` (a copy or a link), removing, and the
saves on a timer and on an exception.

A part of :class:`~phalanx.callbacks.model_checkpoint.ModelCheckpoint`, kept in its own module for size: the mixin
uses the attributes ``ModelCheckpoint.__init__`` sets. Every file-system decision is taken on global rank 0 and
broadcast, so that all ranks take the same path (and the collective calls stay paired).
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from phalanx.callbacks._checkpoint_files import (
    FILE_EXTENSION,
    Claim,
    can_link,
    checkpoint_in_folder,
    claim,
    exists,
    is_link,
    is_url,
    points_to,
    publish_link,
    removal_refusal,
    remove_link,
    resumed_locations,
    same_location,
)
from phalanx.utilities.exceptions import CheckpointError
from phalanx.utilities.rank_zero import rank_zero_info, rank_zero_warn

if TYPE_CHECKING:
    from phalanx.module import TrainingModule
    from phalanx.trainer.trainer import Trainer


def stage_name(trainer: Any) -> str:
    """``trainer.state.fn`` as a plain string (it may be an enum whose value is the string)."""
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    return str(getattr(fn, "value", fn))


class CheckpointSaves:
    """Naming, writing, linking and removing checkpoint files, for ModelCheckpoint (see the module docstring)."""

    FILE_EXTENSION = FILE_EXTENSION
    dirpath: str | None
    save_last: bool | str | None
    last_model_path: str
    best_model_path: str
    _written: set[str]  # files this run wrote
    _claimed: dict[str, Claim]  # names reserved on rank 0 whose checkpoint is not written yet
    _links: set[str]  # symbolic links this run made (save_last="link"): the only links ever removed
    _resumed_from: tuple[str, ...] = ()  # the checkpoint this run resumed from, as given and resolved at resume

    # ------------------------------------------------------------------ the checkpoint resumed from
    def _note_resumed_from(self, trainer: Trainer) -> None:
        """Remember the checkpoint this run resumed from, and what it resolves to now (it may be a link that
        ``save_last="link"`` later switches to a newer file): neither is ever removed."""
        self._resumed_from = resumed_locations(getattr(trainer, "ckpt_path", None))

    # ------------------------------------------------------------------ timer and exception
    def _time_to_save(self, trainer: Trainer) -> bool:
        """Whether ``train_time_interval`` has passed (rank 0's clock, so that every rank agrees)."""
        interval = self._train_time_interval
        if interval is None or self._last_time_checked is None:
            return False
        now = time.monotonic()
        due = bool(trainer.strategy.broadcast(now - self._last_time_checked >= interval.total_seconds()))
        if due:
            self._last_time_checked = now
        return due

    def on_exception(self, trainer: Trainer, module: TrainingModule, exception: BaseException) -> None:
        """With ``save_on_exception``, keep the state a failed ``fit`` reached (see the class docstring)."""
        if not self._should_save_on_exception(trainer):
            return
        try:
            self._save_exception_checkpoint(trainer, exception)
        except Exception as error:  # the original exception is the one to report: never replace it with this one
            rank_zero_warn(
                f"ModelCheckpoint(save_on_exception=True) could not save after {type(exception).__name__}:"
                f" {type(error).__name__}: {error}"
            )

    def _should_save_on_exception(self, trainer: Trainer) -> bool:
        return (
            self.save_on_exception
            and stage_name(trainer) == "fit"
            and not trainer.fast_dev_run
            and not self._sanity_checking
            and self.dirpath is not None
            and trainer.world_size == 1
            and getattr(trainer.strategy, "module", None) is not None
            and self._last_global_step_saved != trainer.global_step
        )

    def _save_exception_checkpoint(self, trainer: Trainer, exception: BaseException) -> None:
        if not self._parameters_finite(trainer):
            self._warn_nonfinite(trainer)
            return
        candidates = self._monitor_candidates(trainer)
        previous = self._claim_last(trainer, candidates) if self.save_last else None
        # Always a name nobody holds: the state at a failure must not replace a checkpoint kept for its score.
        filepath = self._filepath_for(candidates, trainer, reusable=None, force_version=True)
        try:
            self._save_checkpoint(trainer, filepath)
        except BaseException:
            if previous is not None:
                self._unclaim_last(previous)
            raise
        self._save_last_checkpoint(trainer, candidates, previous)
        rank_zero_info(f"ModelCheckpoint: {type(exception).__name__} during fit; saved {filepath}")

    # ------------------------------------------------------------------ last.ckpt
    def _claim_last(self, trainer: Trainer, candidates: dict[str, Any]) -> str:
        """Name ``last.ckpt`` for this save point (rank 0 claims it, all ranks agree); returns the previous name.

        Named before the save point's top-k write, so that the callback state inside that write already names it:
        ``last.ckpt`` can then be a copy of that file, and a run resumed from either continues alike.
        """
        filepath = self._filepath_for(
            candidates, trainer, reusable=self.last_model_path, template=self.CHECKPOINT_NAME_LAST
        )
        previous, self.last_model_path = self.last_model_path, filepath
        return previous

    def _unclaim_last(self, previous: str) -> None:
        """Undo :meth:`_claim_last` when the save point failed before ``last.ckpt`` was written."""
        held = self._claimed.pop(self.last_model_path, None)
        if held is not None:
            held.release()
            self.last_model_path = previous

    def _save_last_checkpoint(self, trainer: Trainer, candidates: dict[str, Any], previous: str | None = None) -> None:
        """Write ``last.ckpt``: a link or a copy of the checkpoint just written at this step, else its own save.

        ``previous``: the name :meth:`_claim_last` replaced, when it was already called at this save point.
        """
        if not self.save_last:
            return
        if previous is None:
            previous = self._claim_last(trainer, candidates)
        filepath = self.last_model_path
        if not (self._links_last(trainer) and self._link(trainer, self._last_checkpoint_saved, filepath)):
            if not (self._copies_last(trainer) and self._copy(trainer, self._last_checkpoint_saved, filepath)):
                self._save_checkpoint(trainer, filepath)
        if (
            previous
            and previous != filepath
            and previous not in self.best_k_models
            and previous != self.best_model_path
        ):
            self._remove_checkpoint(trainer, previous)

    def _copies_last(self, trainer: Trainer) -> bool:
        """Whether last.ckpt can be a copy: a checkpoint other than last, of this same state, was just written."""
        return (
            bool(self._last_checkpoint_saved)
            and self._last_checkpoint_step == trainer.global_step
            and self._last_checkpoint_saved != self.last_model_path
        )

    def _copy(self, trainer: Trainer, source: str, filepath: str) -> bool:
        """Copy ``source`` to ``filepath`` through the strategy's CheckpointIO on rank 0; False: the IO cannot copy."""
        outcome: str | None = None
        checkpoint_io = getattr(trainer.strategy, "checkpoint_io", None)
        if checkpoint_io is None:
            return False  # a strategy without a CheckpointIO: nothing to copy through (every rank sees the same)
        if trainer.is_global_zero:
            try:
                checkpoint_io.copy_checkpoint(source, filepath)
                outcome = "copied"
            except NotImplementedError:
                outcome = "unsupported"
            except Exception as error:  # reported on every rank below, rather than leaving them waiting
                outcome = f"{type(error).__name__}: {error}"
        outcome = trainer.strategy.broadcast(outcome)
        if outcome == "unsupported":  # the name stays claimed for the regular save that follows
            return False
        self._settle_last(
            trainer,
            filepath,
            failure=None if outcome == "copied" else f"could not copy {source} to {filepath}: {outcome}",
            is_link=False,
        )
        self._tell_loggers_when_written(trainer, filepath)
        return True

    def _links_last(self, trainer: Trainer) -> bool:
        """Whether last.ckpt can be a link now: a checkpoint other than last holds the current step."""
        return (
            self.save_last == "link"
            and not self._links_unsupported
            and bool(self._last_checkpoint_saved)
            and self._last_checkpoint_step == trainer.global_step
        )

    def _relink_before_removal(self, trainer: Trainer, candidates: dict[str, Any]) -> None:
        # save_last="link": last.ckpt moves to the file just written before an older checkpoint it may name is removed.
        if self.last_model_path and self._links_last(trainer):
            self._save_last_checkpoint(trainer, candidates, previous=self.last_model_path)

    def _link(self, trainer: Trainer, target: str, filepath: str) -> bool:
        """Make ``filepath`` (last.ckpt) a link to ``target`` on rank 0; False (all ranks) where links cannot be."""
        outcome: str | None = None
        if trainer.is_global_zero:
            try:
                outcome = (
                    "linked" if points_to(filepath, target) else self._link_when_written(trainer, target, filepath)
                )
            except Exception as error:  # reported on every rank below, rather than leaving them waiting
                outcome = f"{type(error).__name__}: {error}"
        outcome = trainer.strategy.broadcast(outcome)
        if outcome == "unsupported":  # the name stays claimed for the regular save that follows
            self._links_unsupported = True
            rank_zero_warn(
                f"ModelCheckpoint(save_last='link'): this file system cannot make symbolic links; writing {filepath}"
                " as a regular checkpoint instead."
            )
            return False
        self._settle_last(
            trainer,
            filepath,
            failure=None if outcome == "linked" else f"could not point {filepath} at {target}: {outcome}",
            is_link=True,
        )
        return True

    def _link_when_written(self, trainer: Trainer, target: str, filepath: str) -> str:
        """Rank 0: have ``filepath`` point at ``target`` once ``target`` is written ("linked"), or "unsupported"."""
        if not can_link(os.path.dirname(filepath)):
            return "unsupported"
        # Until then (a background write in flight, failed, or killed) last.ckpt keeps naming the previous checkpoint.
        self._after_saves(trainer, lambda: publish_link(target, filepath))
        return "linked"

    def _after_saves(
        self, trainer: Trainer, step: Callable[[], None], otherwise: Callable[[], None] | None = None
    ) -> None:
        """Run ``step`` once the saves issued so far are written (``otherwise`` where one failed): see
        ``CheckpointIO.after_saves``."""
        checkpoint_io = getattr(trainer.strategy, "checkpoint_io", None)
        if checkpoint_io is None:
            step()
        else:
            checkpoint_io.after_saves(step, otherwise=otherwise)

    def _tell_loggers_when_written(self, trainer: Trainer, filepath: str) -> None:
        """Call each logger's ``after_save_checkpoint`` once the checkpoint just saved is complete on disk (never where
        its write failed): at once with a synchronous CheckpointIO, on the writer's thread after the write with
        AsyncCheckpointIO, so that a logger uploading it never reads a partial file."""
        loggers = list(trainer.loggers or [])
        if not loggers:
            return
        issuing_thread = threading.get_ident()

        def tell() -> None:
            for logger in loggers:
                try:
                    logger.after_save_checkpoint(self)  # type: ignore[arg-type]
                except Exception as error:
                    if threading.get_ident() == issuing_thread:
                        raise
                    # On the writer's thread an error would read as a failed save and stop the steps queued after it
                    # (last.ckpt's link among them): it is reported instead.
                    rank_zero_warn(
                        f"{type(logger).__name__}.after_save_checkpoint failed once {filepath} was written:"
                        f" {type(error).__name__}: {error}"
                    )

        self._after_saves(trainer, tell)

    def _release_when_written(self, trainer: Trainer, filepath: str) -> None:
        """Give back ``filepath``'s reservation once its checkpoint is written, or its write failed."""
        held = self._claimed.pop(filepath, None)
        if held is not None:
            self._after_saves(trainer, held.release, otherwise=held.release)

    def _settle_last(self, trainer: Trainer, filepath: str, *, failure: str | None, is_link: bool) -> None:
        """After rank 0 copied or linked last.ckpt (every rank, same outcome): record it, or release its name and
        raise ``failure``."""
        if failure is not None:
            held = self._claimed.pop(filepath, None)
            if held is not None:
                held.release()
            raise CheckpointError(f"ModelCheckpoint(save_last={self.save_last!r}) {failure}")
        self._release_when_written(trainer, filepath)
        self._written.add(filepath)
        if is_link:
            self._links.add(filepath)
        else:
            self._links.discard(filepath)

    # ------------------------------------------------------------------ names, writes, removals
    def _filepath_for(
        self,
        candidates: dict[str, Any],
        trainer: Trainer,
        reusable: str | None,
        template: str | None = None,
        force_version: bool = False,
    ) -> str:
        """The path for this save: rank 0 decides (claiming a new name exclusively) and every rank gets its answer."""
        filepath = self._claim_name(candidates, reusable, template, force_version) if trainer.is_global_zero else None
        return trainer.strategy.broadcast(filepath)

    def _claim_name(
        self, candidates: dict[str, Any], reusable: str | None, template: str | None, force_version: bool = False
    ) -> str:
        """``reusable`` if that is the name, else the first of NAME, NAME-v1, NAME-v2... that is free (rank 0 only).

        ``force_version``: version even when ``enable_version_counter`` is False.
        """
        filepath = self.format_checkpoint_name(candidates, template)
        if not self.enable_version_counter and not force_version:
            return filepath
        version = self.STARTING_VERSION
        # A claim (a hidden, locked marker) reserves a new name: another run saving the same name at the
        # same moment gets the next version rather than overwriting this run's file (check-then-write would not).
        # A name this run still keeps (another top-k entry, best, last) is taken like any other, as in Lightning.
        while filepath != reusable and (held := claim(filepath)) is None:
            filepath = self.format_checkpoint_name(candidates, template, ver=version)
            version += 1
        if filepath != reusable:
            self._claimed[filepath] = held
        return filepath

    def _remove_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        """Remove ``filepath`` if it is a checkpoint inside ``dirpath``; never anything else."""
        target = checkpoint_in_folder(filepath, self.dirpath) if self.dirpath else None
        # Rank 0 decides for all (one broadcast on every rank, whatever each rank's file system says).
        decision = (
            (self._removal_refusal(trainer, filepath, target), target is not None and is_link(target))
            if trainer.is_global_zero
            else None
        )
        decided = trainer.strategy.broadcast(decision)
        # None: this process group's rank 0 is not the run's global zero (a fault-tolerant replica group other than
        # group 0, which may hold group 0's paths after a heal): it writes nothing and removes nothing.
        refusal, link = decided if decided is not None else ("", False)
        if refusal is None and link:
            if trainer.is_global_zero:
                remove_link(target)  # the link only: a strategy's removal would follow it
            self._links.discard(filepath)
        elif refusal is None:
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
        resumed = [*self._resumed_from, getattr(trainer, "ckpt_path", None)]
        if any(same_location(path, target) for path in resumed):
            return ""  # never delete the checkpoint this run resumed from (nor what its link named at resume)
        return removal_refusal(target, may_be_pending=filepath in self._written, own_link=filepath in self._links)

    def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        try:
            trainer.save_checkpoint(filepath, weights_only=self.save_weights_only)
        except BaseException:
            held = self._claimed.pop(filepath, None)
            if held is not None:
                held.release()
            raise
        self._release_when_written(trainer, filepath)
        self._last_global_step_saved = trainer.global_step
        self._written.add(filepath)
        self._links.discard(filepath)
        if filepath != self.last_model_path:
            self._last_checkpoint_saved, self._last_checkpoint_step = filepath, trainer.global_step
        self._tell_loggers_when_written(trainer, filepath)

    def file_exists(self, filepath: str, trainer: Trainer) -> bool:
        """Whether ``filepath`` exists, as seen by rank 0 (so every rank takes the same decision)."""
        found = exists(filepath) if trainer.is_global_zero else False
        return bool(trainer.strategy.broadcast(found))

    @staticmethod
    def _normalize_dir(dirpath: str | os.PathLike) -> str:
        path = os.fspath(dirpath)
        if is_url(path):
            return path.rstrip("/")
        return os.path.realpath(os.path.expanduser(path))

    def _resolve_dirpath(self, trainer: Trainer) -> str:
        if self.dirpath is not None:
            return self.dirpath
        logger = trainer.loggers[0] if trainer.loggers else None
        if logger is None:
            base = trainer.default_root_dir
        elif logger.log_dir is not None:
            base = logger.log_dir
        else:
            # A tracker that keeps no run folder here (MLflow, W&B): save_dir/name/version, as Lightning names it.
            version = logger.version
            folder = version if isinstance(version, str) else f"version_{version}"
            base = os.path.join(os.fspath(logger.save_dir or trainer.default_root_dir), str(logger.name), folder)
        return self._normalize_dir(os.path.join(os.fspath(base), "checkpoints"))

    def _warn_if_dir_not_empty(self, dirpath: str) -> None:
        if self.save_top_k == 0 or is_url(dirpath):
            return
        if os.path.isdir(dirpath) and any(name.endswith(self.FILE_EXTENSION) for name in os.listdir(dirpath)):
            rank_zero_warn(f"Checkpoint directory {dirpath} exists and is not empty.")
