"""RichProgressBar: progress bars drawn with rich (Lightning's ``RichProgressBar`` and ``RichProgressBarTheme``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from phalanx.callbacks.progress import ProgressBar, _clock, _stage_name
from phalanx.callbacks.rich_model_summary import require_rich

if TYPE_CHECKING:
    from phalanx.module import TrainingModule
    from phalanx.trainer.trainer import Trainer

# Reading the metrics waits for the device: the text after the bars is rebuilt at most this often (in seconds).
METRICS_INTERVAL = 0.1


@dataclass
class RichProgressBarTheme:
    """The rich styles of the bars' parts (see https://rich.readthedocs.io/en/stable/style.html)."""

    description: str = ""
    progress_bar: str = "#6206E0"
    progress_bar_finished: str = "#6206E0"
    progress_bar_pulse: str = "#6206E0"
    batch_progress: str = ""
    time: str = "dim"
    processing_speed: str = "dim underline"
    metrics: str = "italic"
    metrics_text_delimiter: str = " "
    metrics_format: str = ".3f"


def _metrics_text(metrics: dict[str, Any], theme: RichProgressBarTheme) -> str:
    parts = []
    for name, value in metrics.items():
        if isinstance(value, float):
            value = f"{value:{theme.metrics_format}}"
        parts.append(f"{name}: {value}")
    return theme.metrics_text_delimiter.join(parts)


def _columns(theme: RichProgressBarTheme) -> list[Any]:
    # Lazy for import time and because rich is optional: only a bar being drawn loads it.
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return [
        TextColumn("[progress.description]{task.description}", style=theme.description),
        BarColumn(
            complete_style=theme.progress_bar,
            finished_style=theme.progress_bar_finished,
            pulse_style=theme.progress_bar_pulse,
        ),
        TextColumn("{task.completed}/{task.fields[shown_total]}", style=theme.batch_progress),
        TimeElapsedColumn(),
        TextColumn("•", style=theme.time),
        TimeRemainingColumn(),
        TextColumn("{task.fields[speed]}", style=theme.processing_speed),
        TextColumn("{task.fields[metrics]}", style=theme.metrics),
    ]


class RichProgressBar(ProgressBar):
    """Progress bars drawn with rich on rank 0: one per training epoch (``Epoch N/M``), and one each for the sanity
    check, validation, test and predict runs, followed by the progress-bar metrics. Needs ``rich`` (``pip install
    'phalanx[rich]'``); with it among the callbacks the default model summary is a
    :class:`~phalanx.callbacks.RichModelSummary`.

    The metrics after the bars are read at most every ``METRICS_INTERVAL`` seconds: reading them waits for the
    device, so doing it for every batch would slow training down.

    Args:
        refresh_rate: How many times per second the display is redrawn; 0 disables the bars.
        leave: Keep each finished epoch's bar on screen (a new bar per epoch) instead of reusing one bar.
        theme: The styles of the bars' parts.
        console_kwargs: Keyword arguments of the ``rich.console.Console`` the bars draw on (e.g. ``{"file": ...}``).
    """

    def __init__(
        self,
        refresh_rate: int = 100,
        leave: bool = False,
        theme: RichProgressBarTheme | None = None,
        console_kwargs: dict[str, Any] | None = None,
    ) -> None:
        require_rich("RichProgressBar")
        super().__init__()
        if isinstance(refresh_rate, bool) or not isinstance(refresh_rate, int) or refresh_rate < 0:
            raise ValueError(f"refresh_rate={refresh_rate!r} must be an int >= 0 (redraws per second; 0: no bars).")
        self._refresh_rate = refresh_rate
        self._leave = leave
        self.theme = theme if theme is not None else RichProgressBarTheme()
        self._console_kwargs = dict(console_kwargs or {})
        self.progress: Any = None
        self._console: Any = None
        self._tasks: dict[str, Any] = {}  # role -> rich task id: "train", "sanity", "val", "test", "predict"
        self._metrics = ""
        self._last_metrics: float | None = None

    def __getstate__(self) -> dict[str, Any]:
        # The live display holds a thread and locks: drop them when the callback is pickled (e.g. sent to workers).
        state = dict(self.__dict__)
        state.update(progress=None, _console=None, _tasks={}, _trainer=None)
        return state

    @property
    def refresh_rate(self) -> int:
        return self._refresh_rate

    @property
    def is_enabled(self) -> bool:
        return self._enabled and self._refresh_rate > 0

    @property
    def train_progress_bar(self) -> Any:
        """The rich task of the training bar (None before training)."""
        return self._task("train")

    @property
    def val_progress_bar(self) -> Any:
        return self._task("val")

    @property
    def val_sanity_check_bar(self) -> Any:
        return self._task("sanity")

    @property
    def test_progress_bar(self) -> Any:
        return self._task("test")

    @property
    def predict_progress_bar(self) -> Any:
        return self._task("predict")

    def _task(self, role: str) -> Any:
        task_id = self._tasks.get(role)
        if self.progress is None or task_id is None:
            return None
        return next((task for task in self.progress.tasks if task.id == task_id), None)

    # ------------------------------------------------------------------ the display
    def _start(self) -> None:
        if not self.is_enabled or self.progress is not None:
            return
        # Lazy for import time and because rich is optional: only a bar being drawn loads it.
        from rich.console import Console
        from rich.progress import Progress

        self._console = Console(**self._console_kwargs)
        self.progress = Progress(
            *_columns(self.theme), console=self._console, auto_refresh=True, refresh_per_second=self._refresh_rate
        )
        self.progress.start()
        self._tasks = {}

    def _stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        self.progress = None
        self._tasks = {}

    def _open(self, role: str, description: str, total: Any, replace: bool = True) -> None:
        """Show a bar for ``role``: a new one (the previous one of that role hidden), or the same one reset."""
        self._start()
        if self.progress is None:
            return
        finite = total if isinstance(total, int) or (isinstance(total, float) and total != float("inf")) else None
        shown = str(int(finite)) if finite is not None else "?"
        description = f"[{self.theme.description}]{description}" if self.theme.description else description
        fields = {"shown_total": shown, "speed": "", "metrics": self._metrics if role == "train" else ""}
        previous = self._tasks.get(role)
        if previous is not None and not replace:
            self.progress.reset(previous, total=finite, description=description, visible=True, **fields)
            return
        if previous is not None:
            self.progress.update(previous, visible=False)
        self._tasks[role] = self.progress.add_task(description, total=finite, **fields)

    def _advance(self, role: str, completed: int) -> None:
        task_id = self._tasks.get(role)
        if self.progress is None or task_id is None:
            return
        task = self._task(role)
        speed = task.speed if task is not None else None
        text = f"{speed:.2f}it/s" if speed else ""
        self.progress.update(task_id, completed=completed, speed=text)

    def _refresh_metrics(self, trainer: Trainer, module: Any, force: bool = False) -> None:
        if self.progress is None or "train" not in self._tasks:
            return
        now = _clock()
        if not force and self._last_metrics is not None and now - self._last_metrics < METRICS_INTERVAL:
            return
        self._last_metrics = now
        self._metrics = _metrics_text(self.get_metrics(trainer, module), self.theme)
        self.progress.update(self._tasks["train"], metrics=self._metrics)

    def print(self, *args: Any, sep: str = " ", **kwargs: Any) -> None:
        """Print a message above the bars without breaking them."""
        if self._console is not None:
            self._console.print(*args, sep=sep, **kwargs)
        else:
            print(*args, sep=sep, **kwargs)

    # ------------------------------------------------------------------ hooks
    def _train_description(self, trainer: Trainer) -> str:
        description = f"Epoch {trainer.current_epoch}"
        if trainer.max_epochs not in (None, -1):
            description += f"/{trainer.max_epochs - 1}"
        return f"{description:{len(self.validation_description)}}"

    def on_sanity_check_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._open("sanity", self.sanity_check_description, self.total_val_batches)

    def on_sanity_check_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if self.progress is not None and "sanity" in self._tasks:
            self.progress.update(self._tasks["sanity"], visible=False)

    def on_train_epoch_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if self._leave and "train" in self._tasks:
            self._stop()  # the finished epoch's bar stays printed; the next one starts below it
        self._open("train", self._train_description(trainer), self.total_train_batches, replace=False)
        fit_loop = getattr(trainer, "fit_loop", None)
        self._advance("train", int(getattr(fit_loop, "batches_done", 0) or 0))  # resumed mid-epoch

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainingModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._advance("train", batch_idx + 1)
        self._refresh_metrics(trainer, module)

    def on_train_epoch_end(self, trainer: Trainer, module: TrainingModule) -> None:
        self._refresh_metrics(trainer, module, force=True)

    def on_validation_start(self, trainer: Trainer, module: TrainingModule) -> None:
        if not trainer.sanity_checking:
            self._open("val", self.validation_description, self.total_val_batches)

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        module: TrainingModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        role = "sanity" if trainer.sanity_checking else "val"
        task = self._task(role)
        if task is not None:
            self._advance(role, int(task.completed) + 1)

    def on_validation_end(self, trainer: Trainer, module: TrainingModule) -> None:
        if trainer.sanity_checking or self.progress is None:
            return
        if _stage_name(trainer) == "fit" and "val" in self._tasks:
            self.progress.update(self._tasks["val"], visible=False)
            self._refresh_metrics(trainer, module, force=True)

    def on_test_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._open("test", self.test_description, self.total_test_batches)

    def on_test_batch_end(
        self,
        trainer: Trainer,
        module: TrainingModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        task = self._task("test")
        if task is not None:
            self._advance("test", int(task.completed) + 1)

    def on_predict_start(self, trainer: Trainer, module: TrainingModule) -> None:
        self._open("predict", self.predict_description, self.total_predict_batches)

    def on_predict_batch_end(
        self,
        trainer: Trainer,
        module: TrainingModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        task = self._task("predict")
        if task is not None:
            self._advance("predict", int(task.completed) + 1)

    def teardown(self, trainer: Trainer, module: TrainingModule, stage: str) -> None:
        self._stop()

    def on_exception(self, trainer: Trainer, module: TrainingModule, exception: BaseException) -> None:
        self._stop()


__all__ = ["RichProgressBar", "RichProgressBarTheme"]
