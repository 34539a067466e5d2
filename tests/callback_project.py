"""A Lightning user's small project run with one of the training callbacks of issue 38, with the same code under
Lightning 2.6 and phalanx, and what each run leaves behind (steps, losses, weights, the callback's files and calls).

Used in-process by the tests under tests/unit/callbacks/ (one device) and as a script by
tests/distributed/test_callbacks_processes.py: ``python callback_project.py FRAMEWORK STRATEGY DEVICES ROOT CASE[=CKPT]
...`` runs the cases in turn and writes ROOT/CASE/summary_RANK.json from every process.

The Timer reads a fake clock on which one training step takes one second (the steps of the process that reads it),
so that where a time limit stops training does not depend on the machine's speed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SAMPLES, BATCH, EPOCHS = 40, 4, 3
#: The hooks the "lambda" case counts (every hook a LambdaCallback takes that a fit, a validate and a predict call).
COUNTED_HOOKS = (
    "setup", "teardown", "on_fit_start", "on_fit_end", "on_sanity_check_start", "on_sanity_check_end",
    "on_train_start", "on_train_end", "on_train_epoch_start", "on_train_epoch_end", "on_train_batch_start",
    "on_train_batch_end", "on_validation_start", "on_validation_end", "on_validation_epoch_start",
    "on_validation_epoch_end", "on_validation_batch_start", "on_validation_batch_end", "on_before_backward",
    "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad", "on_save_checkpoint",
    "on_predict_start", "on_predict_end", "on_predict_epoch_start", "on_predict_epoch_end",
    "on_predict_batch_start", "on_predict_batch_end",
)  # fmt: skip
STEPS = [0]  # training steps run by this process: the fake clock's seconds


class FakeTime:
    """Stands for the ``time`` module inside the frameworks' timer modules."""

    @staticmethod
    def monotonic() -> float:
        return float(STEPS[0])


def data(n: int = SAMPLES, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=generator))


class ProjectBody:
    """The user's module, framework-free: module_class() puts it on LightningModule or TrainingModule."""

    def __init__(self, fail_at_step: int = -1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.fail_at_step = fail_at_step
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == self.fail_at_step:
            raise RuntimeError(f"failing at step {self.fail_at_step} on purpose")
        STEPS[0] += 1
        loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.log("train_loss", loss, prog_bar=True)
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]), prog_bar=True)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        return self.net(batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)


_CLASSES = {"lightning": "LightningProject", "phalanx": "PhalanxProject"}


def framework_parts(framework: str) -> tuple[type, type, Any]:
    """(module base class, Trainer, callbacks package) of ``framework``."""
    if framework == "lightning":
        import pytorch_lightning as pl

        return pl.LightningModule, pl.Trainer, pl.callbacks
    import phalanx
    import phalanx.callbacks

    return phalanx.TrainingModule, phalanx.Trainer, phalanx.callbacks


def module_class(framework: str) -> type:
    """The user's module on ``framework``'s base class, a module-level name of this file."""
    name = _CLASSES[framework]
    if name not in globals():
        globals()[name] = type(name, (ProjectBody, framework_parts(framework)[0]), {"__module__": __name__})
    return globals()[name]


def __getattr__(name: str) -> type:
    # A spawned process unpickling the module finds its class here before anything built it.
    for framework, class_name in _CLASSES.items():
        if name == class_name:
            return module_class(framework)
    raise AttributeError(name)


def use_fake_clock(framework: str) -> None:
    """Make ``framework``'s Timer read :class:`FakeTime`."""
    if framework == "lightning":
        import pytorch_lightning.callbacks.timer as timer_module
    else:
        import phalanx.callbacks.timer as timer_module  # type: ignore[no-redef]
    timer_module.time = FakeTime  # type: ignore[assignment]


class Recorder:
    """Counts the hooks a LambdaCallback receives."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def hook(self, name: str) -> Any:
        def record(*args: Any, **kwargs: Any) -> None:
            self.counts[name] = self.counts.get(name, 0) + 1

        return record


def writer_class(framework: str) -> type:
    """A prediction writer that saves each batch's and the epoch's (prediction, indices) per rank."""
    base = framework_parts(framework)[2].BasePredictionWriter

    class Writer(base):
        def __init__(self, folder: Path, interval: str) -> None:
            super().__init__(interval)
            self.folder = folder

        def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx):
            name = f"batch_{trainer.global_rank}_{dataloader_idx}_{batch_idx}.pt"
            torch.save({"prediction": prediction, "indices": list(batch_indices)}, self.folder / name)

        def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
            torch.save(
                {"predictions": predictions, "indices": batch_indices}, self.folder / f"epoch_{trainer.global_rank}.pt"
            )

    return Writer


def case_callbacks(framework: str, case: str, root: Path, recorder: Recorder) -> list[Any]:
    """The callbacks of ``case``, made from ``framework``'s package."""
    callbacks = framework_parts(framework)[2]
    if case.startswith("timer"):
        use_fake_clock(framework)
        interval = "epoch" if case == "timer_epoch" else "step"
        saving = callbacks.ModelCheckpoint(
            dirpath=root / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}"
        )
        # 2 processes share the 40 samples: 5 steps an epoch, 15 in all; "timer_short" stops inside the second epoch.
        duration = {"timer": {"seconds": 17}, "timer_short": {"seconds": 7}, "timer_epoch": "00:00:00:13"}[case]
        return [callbacks.Timer(duration=duration, interval=interval), saving]
    if case == "lambda":
        return [callbacks.LambdaCallback(**{name: recorder.hook(name) for name in COUNTED_HOOKS})]
    if case == "exception":
        return [callbacks.OnExceptionCheckpoint(root / "ckpt")]
    if case.startswith("writer"):
        (root / "predictions").mkdir(parents=True, exist_ok=True)
        return [writer_class(framework)(root / "predictions", case.removeprefix("writer_"))]
    if case.startswith("pruning"):
        saving = callbacks.ModelCheckpoint(dirpath=root / "ckpt", every_n_epochs=1, save_top_k=-1, filename="{epoch}")
        options = {"parameter_names": ["weight"]} if case == "pruning_local" else {}
        local = case == "pruning_local"
        pruning = callbacks.ModelPruning(
            "l1_unstructured", amount=0.3, use_global_unstructured=not local, use_lottery_ticket_hypothesis=not local,
            **options,
        )  # fmt: skip
        return [pruning, saving]
    raise ValueError(f"unknown case {case!r}")


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    # A DTensor (fsdp) is gathered whole: every rank calls this, in the same order.
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


def run(
    framework: str, case: str, root: Path, strategy: str = "auto", devices: int = 1, ckpt_path: str | None = None
) -> dict[str, Any]:
    """Fit ``case``'s project (predict with the writer cases), resuming from ``ckpt_path`` if given; what it left."""
    _, trainer_class, _ = framework_parts(framework)
    torch.manual_seed(0)
    STEPS[0] = 0
    model = module_class(framework)(fail_at_step=5 if case == "exception" else -1)
    recorder = Recorder()
    callbacks = case_callbacks(framework, case, root, recorder)
    checkpointing = any(isinstance(cb, framework_parts(framework)[2].Checkpoint) for cb in callbacks)
    trainer = trainer_class(
        accelerator="cpu", strategy=strategy, devices=devices, max_epochs=EPOCHS, default_root_dir=root,
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=checkpointing,
        callbacks=callbacks, num_sanity_val_steps=2 if case == "lambda" else 0,
    )  # fmt: skip
    train = DataLoader(data(), batch_size=BATCH, shuffle=devices > 1)
    val = DataLoader(data(12, seed=1), batch_size=BATCH)
    summary: dict[str, Any] = {"global_rank": trainer.global_rank}
    if case.startswith("writer"):
        trainer.predict(model, DataLoader(data(18, seed=2), batch_size=BATCH), return_predictions=False)
    else:
        try:
            trainer.fit(model, train, val, ckpt_path=ckpt_path)
        except RuntimeError as error:
            summary["error"] = str(error)
    summary.update(
        global_step=trainer.global_step,
        epoch=trainer.current_epoch,
        losses=model.losses,
        weights={name: _whole(value).tolist() for name, value in model.state_dict().items()},
        hooks=recorder.counts,
        files=sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_file()),
    )
    return summary


def main(argv: list[str]) -> None:
    """``FRAMEWORK STRATEGY DEVICES ROOT CASE[=CKPT] ...``: the cases one after the other in the same processes (one
    launch for all), each in ROOT/CASE with its summary_RANK.json; a case that fails on purpose goes last, as its
    error ends the job."""
    framework, strategy, devices, out, *cases = argv
    for item in cases:
        case, _, ckpt_path = item.partition("=")
        root = Path(out) / case
        root.mkdir(parents=True, exist_ok=True)
        result = run(framework, case, root, strategy=strategy, devices=int(devices), ckpt_path=ckpt_path or None)
        (root / f"summary_{result['global_rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
