"""ModelCheckpoint's top-k bookkeeping: which kept checkpoint is best and which is k-th, and restoring that from the
callback state of a resumed checkpoint.

A part of :class:`~phalanx.callbacks.model_checkpoint.ModelCheckpoint`, kept in its own module for size: the mixin
uses the attributes ``ModelCheckpoint.__init__`` sets (``mode``, ``dirpath``, ``save_last``, ...).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from phalanx.callbacks._checkpoint_checks import restored_entries
from phalanx.callbacks._checkpoint_files import FILE_EXTENSION, is_link
from phalanx.utilities.exceptions import CheckpointError
from phalanx.utilities.rank_zero import rank_zero_warn


class CheckpointRanking:
    """The ranking of the checkpoints ``ModelCheckpoint`` keeps, and its state in checkpoints."""

    mode: str
    monitor: str | None
    dirpath: str | None
    save_last: bool | str | None
    _pending_state: dict[str, Any] | None
    _links: set[str]

    def _init_ranking(self) -> None:
        """No checkpoint kept yet (``mode`` must be set: the k-th value starts as its worst)."""
        self.best_model_path = ""
        self.best_model_score: Tensor | None = None
        self.best_k_models: dict[str, Tensor] = {}
        self.kth_best_model_path = ""
        self.kth_value: Tensor = self._worst_score()
        self.last_model_path = ""
        self.current_score: Tensor | None = None

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
            raise CheckpointError(
                f"The ModelCheckpoint state in this checkpoint is a {type(state_dict).__name__}, not a dict."
            )
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
        if self.save_last == "link" and self.last_model_path and is_link(self.last_model_path):
            self._links.add(self.last_model_path)  # the previous run's last.ckpt link, inside dirpath: ours to replace
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
                f"ModelCheckpoint ignored paths in the resumed checkpoint's callback state that are not "
                f"'*{FILE_EXTENSION}' entries directly inside dirpath {self.dirpath!r}: {', '.join(dropped)}. "
                f"The callback never overwrites or removes anything outside its folder."
            )

    # ------------------------------------------------------------------ ranking
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

    def _worst_score(self, dtype: torch.dtype | None = None) -> Tensor:
        return torch.tensor(math.inf if self.mode == "min" else -math.inf, dtype=dtype)

    def _finite_or_worst(self, score: Tensor) -> Tensor:
        """``score`` when finite, else the worst value for ``mode``: NaN and inf never rank above a finite score."""
        return score if torch.isfinite(score) else self._worst_score(score.dtype)

    @staticmethod
    def _score_text(score: Tensor | None) -> str:
        return "none" if score is None else f"{score.item():.5f}"


__all__ = ["CheckpointRanking"]
