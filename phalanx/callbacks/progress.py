"""Progress bars: the ``ProgressBar`` base callback and the default ``TQDMProgressBar``."""

from __future__ import annotations

import math
import sys
import time
from typing import TYPE_CHECKING, Any

from tqdm import tqdm as _tqdm

from phalanx.callbacks.callback import Callback
from phalanx.utilities.checks import is_int_at_least
from phalanx.utilities.host_copies import HostCopies

if TYPE_CHECKING:
    from phalanx.module import TrainingModule
    from phalanx.trainer.trainer import Trainer

# The bar's text is rebuilt at most this often (in seconds), however fast the batches are: a redraw costs the host
# tqdm's formatting and a copy of the metrics to host memory (never a wait for the device: see get_metrics).
REFRESH_INTERVAL = 0.1


def _clock() -> float:
    return time.monotonic()


def _stage_name(trainer: Any) -> str:
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    return str(getattr(fn, "value", fn))


def _finite_total(total: Any) -> int | None:
    """A bar total: None when unknown or infinite."""
    if total is None:
        return None
    if isinstance(total, float) and (math.isinf(total) or math.isnan(total)):
        return None
    return int(total)


def _sum_batches(counts: Any) -> float | int | None:
    if counts is None:
        return None
    if isinstance(counts, (int, float)):
        return counts
    return sum(counts)


class ProgressBar(Callback):
    """Base class of progress bars: knows the batch totals and turns the progress-bar metrics into numbers.

    Subclasses draw the bars in the hooks. ``enable()``/``disable()`` switch them on and off (the Trainer disables
    the bars on every process except global rank 0).
    """

    sanity_check_description = "Sanity Checking"
    train_description = "Training"
    validation_description = "Validation"
    test_description = "Testing"
    predict_description = "Predicting"

    def __init__(self) -> None:
        self._trainer: Trainer | None = None
        self._enabled = True
        self._host_copies = HostCopies()

    @property
    def trainer(self) -> Trainer:
        if self._trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a Trainer yet.")
        return self._trainer

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    @property
    def is_disabled(self) -> bool:
        return not self.is_enabled

    def enable(self) -> None:
        """Show the bars."""
        self._enabled = True

    def disable(self) -> None:
        """Hide the bars (on processes other than rank 0, or at the user's request)."""
        self._enabled = False

    # ------------------------------------------------------------------ totals
    @property
    def total_train_batches(self) -> int | float:
        """Training batches per epoch (``inf`` when the dataloader has no length)."""
        return self.trainer.num_training_batches

    @property
    def total_val_batches(self) -> int | float:
        """Batches of this validation run, all dataloaders together (sanity-check batches while sanity checking)."""
        if self.trainer.sanity_checking:
            return _sum_batches(self.trainer.num_sanity_val_batches) or 0
        return _sum_batches(self.trainer.num_val_batches) or 0

    @property
    def total_test_batches(self) -> int | float:
        return _sum_batches(self.trainer.num_test_batches) or 0

    @property
    def total_predict_batches(self) -> int | float:
        return _sum_batches(self.trainer.num_predict_batches) or 0

    # ------------------------------------------------------------------ hooks and helpers
    def setup(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        self._trainer = trainer
        if not trainer.is_global_zero:
            self.disable()

    def print(self, *args: Any, sep: str = " ", **kwargs: Any) -> None:
        """Print a message without breaking the bars."""
        print(*args, sep=sep, **kwargs)

    def get_metrics(self, trainer: Trainer, module: TrainingModule | None) -> dict[str, int | float | str]:
        """The values to show: ``v_num`` (the logger's version) and ``trainer.progress_bar_metrics`` as numbers.

        The numbers are those that reached host memory by a copy started at this or an earlier call, never a read that
        waits for the device: on a GPU a value may be shown one redraw late (and a metric's first value one redraw
        after it was logged) so that the training step never stalls for the bar.
        """
        shown: dict[str, Any] = {}
        version = _logger_version(trainer)
        if version is not None:
            shown["v_num"] = version
        copies = self.__dict__.get("_host_copies")
        if copies is None:  # a subclass that did not call ProgressBar.__init__
            copies = self.__dict__["_host_copies"] = HostCopies()
        wait = self.__dict__.get("_final_display", False)
        shown.update(copies.read(dict(trainer.progress_bar_metrics), wait=wait))
        return shown

    def _final_metrics(self, trainer: Trainer, module: TrainingModule | None) -> dict[str, int | float | str]:
        """:meth:`get_metrics` (a subclass's too) with the newest values, waited for: at an epoch's or a validation's
        end, where the loggers read them anyway, never per step."""
        self.__dict__["_final_display"] = True
        try:
            return self.get_metrics(trainer, module)
        finally:
            self.__dict__["_final_display"] = False


def _logger_version(trainer: Any) -> int | str | None:
    loggers = getattr(trainer, "loggers", None) or []
    versions = []
    for logger in loggers:
        version = getattr(logger, "version", None)
        if version is not None:
            versions.append(version)
    if not versions:
        return None
    if len(versions) == 1:
        version = versions[0]
        return version[-4:] if isinstance(version, str) else version
    return "_".join(str(v) for v in dict.fromkeys(versions))


class TQDMProgressBar(ProgressBar):
    """Progress bars drawn with tqdm on stderr (rank 0 only).

    Args:
        refresh_rate: Move the bars every this many batches; 0 disables the bars.
        leave: Keep each finished epoch's training bar on screen (a new bar per epoch) instead of reusing one bar.
        process_position: Offset of the bars, for running several trainings side by side.

    The metrics shown after the bar are rebuilt at most every ``REFRESH_INTERVAL`` seconds, from values copied to the
    host without waiting for the device (see :meth:`ProgressBar.get_metrics`).
    """

    BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"

    def __init__(self, refresh_rate: int = 1, leave: bool = False, *, process_position: int = 0) -> None:
        super().__init__()
        if not is_int_at_least(refresh_rate, 0):
            raise ValueError(f"`refresh_rate` must be an int >= 0 (0 disables the bar), got {refresh_rate!r}.")
        if not is_int_at_least(process_position, 0):
            raise ValueError(f"`process_position` must be an int >= 0, got {process_position!r}.")
        self._refresh_rate = refresh_rate
        self._leave = leave
        self._process_position = process_position
        self._train_bar: _tqdm | None = None
        self._val_bar: _tqdm | None = None
        self._test_bar: _tqdm | None = None
        self._predict_bar: _tqdm | None = None
        self._counts = {"val": 0, "test": 0, "predict": 0}
        self._last_refresh: dict[str, float | None] = {}

    def __getstate__(self) -> dict[str, Any]:
        # tqdm bars hold locks and file handles: drop them when the callback is pickled (e.g. sent to workers).
        state = dict(self.__dict__)
        for key in ("_train_bar", "_val_bar", "_test_bar", "_predict_bar", "_trainer"):
            state[key] = None
        return state

    @property
    def refresh_rate(self) -> int:
        return self._refresh_rate

    @property
    def process_position(self) -> int:
        return self._process_position

    @property
    def is_enabled(self) -> bool:
        return self._enabled and self._refresh_rate > 0

    @property
    def train_progress_bar(self) -> _tqdm | None:
        return self._train_bar

    @train_progress_bar.setter
    def train_progress_bar(self, bar: _tqdm | None) -> None:
        self._train_bar = bar

    @property
    def val_progress_bar(self) -> _tqdm | None:
        return self._val_bar

    @val_progress_bar.setter
    def val_progress_bar(self, bar: _tqdm | None) -> None:
        self._val_bar = bar

    @property
    def test_progress_bar(self) -> _tqdm | None:
        return self._test_bar

    @test_progress_bar.setter
    def test_progress_bar(self, bar: _tqdm | None) -> None:
        self._test_bar = bar

    @property
    def predict_progress_bar(self) -> _tqdm | None:
        return self._predict_bar

    @predict_progress_bar.setter
    def predict_progress_bar(self, bar: _tqdm | None) -> None:
        self._predict_bar = bar

    # ------------------------------------------------------------------ bar factories
    def _new_bar(self, desc: str, position: int, leave: bool, total: Any = None, initial: int = 0) -> _tqdm:
        return _tqdm(
            desc=desc,
            total=_finite_total(total),
            initial=initial,
            position=2 * self._process_position + position,
            disable=self.is_disabled,
            leave=leave,
            dynamic_ncols=True,
            file=sys.stderr,
            smoothing=0,
            bar_format=self.BAR_FORMAT,
        )

    def init_sanity_tqdm(self, total: Any = None) -> _tqdm:
        return self._new_bar(self.sanity_check_description, 0, leave=False, total=total)

    def init_train_tqdm(self, total: Any = None, initial: int = 0, desc: str | None = None) -> _tqdm:
        return self._new_bar(desc or self.train_description, 0, leave=True, total=total, initial=initial)

    def init_validation_tqdm(self, total: Any = None) -> _tqdm:
        has_main_bar = self._trainer is not None and _stage_name(self._trainer) == "fit"
        return self._new_bar(self.validation_description, int(has_main_bar), leave=not has_main_bar, total=total)

    def init_test_tqdm(self, total: Any = None) -> _tqdm:
        return self._new_bar(self.test_description, 0, leave=True, total=total)

    def init_predict_tqdm(self, total: Any = None) -> _tqdm:
        return self._new_bar(self.predict_description, 0, leave=True, total=total)

    # ------------------------------------------------------------------ updating
    def _should_update(self, current: int, total: Any) -> bool:
        return self.is_enabled and (current % self._refresh_rate == 0 or current == total)

    def _update(
        self, role: str, bar: _tqdm | None, n: int, module: Any = None, postfix: bool = False, force: bool = False
    ) -> None:
        """Move ``bar`` to ``n``; redraw (and re-read the metrics) only every ``REFRESH_INTERVAL`` s or when forced."""
        if bar is None or bar.disable:
            return
        bar.n = n
        now = _clock()
        last = self._last_refresh.get(role)
        if force or last is None or now - last >= REFRESH_INTERVAL:
            if postfix and self._trainer is not None:
                bar.set_postfix(self.get_metrics(self._trainer, module), refresh=False)
            bar.refresh()
            self._last_refresh[role] = now

    @staticmethod
    def _reset(bar: _tqdm, total: Any, initial: int = 0) -> None:
        total = _finite_total(total)
        if bar.disable:
            bar.n, bar.total = initial, total
            return
        bar.reset()
        bar.total = total
        bar.initial = initial
        bar.n = initial
        bar.last_print_n = initial
        bar.refresh()

    @staticmethod
    def _close(bar: _tqdm | None) -> None:
        if bar is not None:
            bar.close()

    # ------------------------------------------------------------------ hooks: sanity check
    def on_sanity_check_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._trainer = trainer

    def on_sanity_check_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._close(self._val_bar)
        self._val_bar = None

    # ------------------------------------------------------------------ hooks: training
    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._trainer = trainer
        fit_loop = getattr(trainer, "fit_loop", None)
        # A run resumed from a mid-epoch checkpoint starts its first epoch after the batches already done.
        initial = int(getattr(fit_loop, "batches_done", 0) or 0)
        desc = f"Epoch {trainer.current_epoch}"
        if self._train_bar is None or self._leave:
            self._close(self._train_bar)
            self._train_bar = self.init_train_tqdm(self.total_train_batches, initial, desc)
        else:
            if not self._train_bar.disable:
                self._train_bar.set_description(desc, refresh=False)
            self._reset(self._train_bar, self.total_train_batches, initial)
        self._last_refresh["train"] = None

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        bar = self._train_bar
        if bar is None:
            return
        n = batch_idx + 1
        if self._should_update(n, bar.total):
            self._update("train", bar, n, module, postfix=True, force=n == bar.total)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        bar = self._train_bar
        if bar is None:
            return
        if not bar.disable:
            bar.set_postfix(self._final_metrics(trainer, module), refresh=False)
            bar.refresh()
            self._last_refresh["train"] = _clock()
        if self._leave:
            bar.close()

    def on_train_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._close(self._train_bar)
        self._train_bar = None

    # ------------------------------------------------------------------ hooks: validation
    def on_validation_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._trainer = trainer
        self._close(self._val_bar)
        total = self.total_val_batches
        self._val_bar = self.init_sanity_tqdm(total) if trainer.sanity_checking else self.init_validation_tqdm(total)
        self._counts["val"] = 0
        self._last_refresh["val"] = None

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        module: TrainingModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._counts["val"] += 1
        bar = self._val_bar
        if bar is not None and self._should_update(self._counts["val"], bar.total):
            self._update("val", bar, self._counts["val"], force=self._counts["val"] == bar.total)

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._close(self._val_bar)
        self._val_bar = None
        train_bar = self._train_bar
        if (
            train_bar is not None
            and not train_bar.disable
            and _stage_name(trainer) == "fit"
            and not trainer.sanity_checking
        ):
            train_bar.set_postfix(self._final_metrics(trainer, module), refresh=False)
            train_bar.refresh()
            self._last_refresh["train"] = _clock()

    # ------------------------------------------------------------------ hooks: test and predict
    def on_test_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._trainer = trainer
        self._close(self._test_bar)
        self._test_bar = self.init_test_tqdm(self.total_test_batches)
        self._counts["test"] = 0
        self._last_refresh["test"] = None

    def on_test_batch_end(
        self,
        trainer: Trainer,
        module: TrainingModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._counts["test"] += 1
        bar = self._test_bar
        if bar is not None and self._should_update(self._counts["test"], bar.total):
            self._update("test", bar, self._counts["test"], force=self._counts["test"] == bar.total)

    def on_test_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._close(self._test_bar)
        self._test_bar = None

    def on_predict_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._trainer = trainer
        self._close(self._predict_bar)
        self._predict_bar = self.init_predict_tqdm(self.total_predict_batches)
        self._counts["predict"] = 0
        self._last_refresh["predict"] = None

    def on_predict_batch_end(
        self,
        trainer: Trainer,
        module: TrainingModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._counts["predict"] += 1
        bar = self._predict_bar
        if bar is not None and self._should_update(self._counts["predict"], bar.total):
            self._update("predict", bar, self._counts["predict"], force=self._counts["predict"] == bar.total)

    def on_predict_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._close(self._predict_bar)
        self._predict_bar = None

    # ------------------------------------------------------------------ cleanup
    def on_exception(self, trainer: Trainer, module: TrainingModule, exception: BaseException) -> None:
        self._close_all()

    def teardown(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        self._close_all()

    def _close_all(self) -> None:
        for attr in ("_val_bar", "_test_bar", "_predict_bar", "_train_bar"):
            self._close(getattr(self, attr))
            setattr(self, attr, None)

    def print(self, *args: Any, sep: str = " ", end: str = "\n", file: Any = None, nolock: bool = False) -> None:
        """Print a message above the bars without breaking them."""
        _tqdm.write(sep.join(map(str, args)), end=end, file=file, nolock=nolock)
