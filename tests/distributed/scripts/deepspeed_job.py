"""One 2-process CPU job per strategy for the DeepSpeed tests (the same fits run under DDP as the reference).

Usage: python deepspeed_job.py STRATEGY OUT_DIR [CHECKPOINT]

STRATEGY is 'deepspeed_stage_1', 'deepspeed_stage_2', 'deepspeed_stage_3' or 'ddp'. Every rank writes
OUT_DIR/rank{R}.json; rank 0 writes the full weights of each fit to OUT_DIR/weights_{fit}.pt. The fits:

- full:     40 steps (2 epochs) of Adam + a per-step StepLR, validation each epoch, ModelCheckpoint(last) every 5 steps;
            losses per step, memory per rank, weights.
- part:     the same run stopped after 13 steps (mid-epoch), then trainer.save_checkpoint('mid.ckpt') after fit.
- resumed:  a fresh model resumed from mid.ckpt to 40 steps (must end where 'full' ended).
- validate: validate() of 'part's model, and of a fresh model with ckpt_path='mid.ckpt' (must agree).
- parity:   20 steps of SGD with momentum (compared with DDP step by step).
- accumulate: 12 optimizer updates with accumulate_grad_batches=2, gradient_clip_val=0.5 and a per-step scheduler
            (24 batches: under DeepSpeed global_step counts batches, under DDP optimizer steps).
- manual:   manual optimization, 5 steps (must follow the first 5 losses of 'full').
- extras:   stage-specific checks (DeepSpeed config optimizer/scheduler, bf16-mixed, CPU offload with
            DeepSpeedCPUAdam), and resuming from the
            checkpoint given as the third argument (DDP from a DeepSpeed directory) to 40 steps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import phalanx
from phalanx.callbacks import Callback, ModelCheckpoint

FEATURES, WIDTH = (
    256,
    512,
)  # the two big weight matrices (>100k elements) are partitioned by ZeRO-3; smaller tensors stay whole
TRAIN_SAMPLES, VAL_SAMPLES, BATCH = 320, 51, 8  # 2 ranks x batch 8: 20 steps an epoch; 51: unpadded validation


class Regression(Dataset):
    """Samples that carry their index; targets of unit scale (a random linear map of the inputs plus noise)."""

    def __init__(self, n: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, FEATURES, generator=generator)
        direction = torch.randn(FEATURES, 1, generator=torch.Generator().manual_seed(99)) / FEATURES**0.5
        self.y = self.x @ direction + 0.1 * torch.randn(n, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index], self.y[index], index


class DSNet(phalanx.TrainingModule):
    """Layers made in configure_model (so ZeRO-3 partitions them at creation); Adam and a per-step scheduler."""

    def __init__(self, lr: float = 0.01, manual: bool = False, optimizer: str = "adam") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net: nn.Module | None = None
        self.automatic_optimization = not manual
        self.created_partitioned: list[bool] = []

    def configure_model(self) -> None:
        if self.net is not None:
            return
        self.net = nn.Sequential(
            nn.Linear(FEATURES, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1)
        )
        self.created_partitioned = [hasattr(p, "ds_id") and p.data.numel() == 0 for p in self.net.parameters()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y, _ = batch
        loss = nn.functional.mse_loss(self(x), y)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        self.lr_schedulers().step()
        return loss.detach()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y, index = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)
        self.log("val_count", float(len(index)), reduce_fx="sum", sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        if self.hparams.optimizer == "sgd":
            optimizer: torch.optim.Optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        elif (
            self.hparams.optimizer == "cpu_adam"
        ):  # what ZeRO-Offload steps on the CPU (its C++ op compiles on first use)
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(self.parameters(), lr=self.hparams.lr)
        else:
            optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class Recorder(Callback):
    """Per-step losses and learning rates; the strategy's memory figures at the end of training."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.memory: dict[str, int] = {}

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs.detach()))
        self.lrs.append(float(trainer.optimizers[0].param_groups[0]["lr"]))

    def on_train_end(self, trainer: Any, module: Any) -> None:
        strategy = trainer.strategy
        if hasattr(strategy, "memory_footprint"):
            self.memory = strategy.memory_footprint()
        else:  # DDP: every rank holds everything
            optimizer = trainer.optimizers[0]
            states = sum(
                v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
            )
            self.memory = {
                "parameters": sum(p.numel() * p.element_size() for p in module.parameters()),
                "optimizer_states": states,
                "master_weights": 0,
            }


def loaders() -> tuple[DataLoader, DataLoader]:
    train = DataLoader(Regression(TRAIN_SAMPLES, seed=0), batch_size=BATCH, shuffle=True)
    val = DataLoader(Regression(VAL_SAMPLES, seed=1), batch_size=BATCH)
    return train, val


def make_trainer(strategy: Any, out: Path, **kwargs: Any) -> phalanx.Trainer:
    options = {
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        "default_root_dir": out,
    }
    options.update(kwargs)
    return phalanx.Trainer(strategy=strategy, devices=2, accelerator="cpu", **options)


def full_weights(trainer: phalanx.Trainer) -> dict[str, torch.Tensor]:
    """Every rank calls this (ZeRO-3 gathers); the values come back as float32."""
    return {name: value.detach().float().clone() for name, value in trainer.strategy.module_state_dict().items()}


def save_weights(trainer: phalanx.Trainer, out: Path, name: str) -> None:
    weights = full_weights(trainer)
    if trainer.is_global_zero:
        torch.save(weights, out / f"weights_{name}.pt")


def main() -> None:
    strategy, out = sys.argv[1], Path(sys.argv[2])
    resume_from = sys.argv[3] if len(sys.argv) > 3 else None
    deepspeed = strategy.startswith("deepspeed")
    report: dict[str, Any] = {"strategy": strategy}

    # full: the uninterrupted run
    phalanx.seed_everything(0)
    model = DSNet()
    recorder = Recorder()
    checkpointing = ModelCheckpoint(dirpath=out / "checkpoints", save_last=True, every_n_train_steps=5, save_top_k=0)
    trainer = make_trainer(strategy, out, max_steps=40, callbacks=[recorder, checkpointing], enable_checkpointing=True)
    train, val = loaders()
    trainer.fit(model, train, val)
    report["full"] = {
        "losses": recorder.losses,
        "lrs": recorder.lrs,
        "memory": recorder.memory,
        "global_step": trainer.global_step,
        "num_parameters": sum(math_numel(p) for p in model.parameters()),
        "created_partitioned": model.created_partitioned,
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "val_count": float(trainer.callback_metrics["val_count"]),
        "last_model_path": checkpointing.last_model_path,
        "handles_accumulation": trainer.strategy.traits.handles_gradient_accumulation,
    }
    if deepspeed:
        report["full"]["config"] = trainer.strategy.config
    save_weights(trainer, out, "full")

    # part + save after fit
    phalanx.seed_everything(0)
    model = DSNet()
    trainer = make_trainer(strategy, out, max_steps=13)
    train, val = loaders()
    trainer.fit(model, train, val)
    trainer.save_checkpoint(out / "mid.ckpt")
    save_weights(trainer, out, "part")
    report["validate_part"] = trainer.validate(model, val, verbose=False)

    # resumed from the directory
    phalanx.seed_everything(
        0
    )  # the DistributedSampler shuffles with this seed (the batch order within the epoch comes from the checkpoint)
    model = DSNet()
    recorder = Recorder()
    trainer = make_trainer(strategy, out, max_steps=40, callbacks=[recorder])
    train, val = loaders()
    trainer.fit(model, train, val, ckpt_path=out / "mid.ckpt")
    report["resumed"] = {"losses": recorder.losses, "lrs": recorder.lrs, "global_step": trainer.global_step}
    save_weights(trainer, out, "resumed")
    report["validate_after_fit"] = trainer.validate(model, val, verbose=False)
    predictions = trainer.predict(model, val)
    report["predictions"] = torch.cat(predictions).flatten().tolist()

    # validate a fresh model from the checkpoint directory
    phalanx.seed_everything(7)
    model = DSNet()
    trainer = make_trainer(strategy, out)
    report["validate_from_checkpoint"] = trainer.validate(model, val, ckpt_path=out / "mid.ckpt", verbose=False)

    # parity with DDP: 20 steps of SGD with momentum (linear in the gradients, so rounding differences stay small)
    phalanx.seed_everything(0)
    model = DSNet(optimizer="sgd", lr=0.002)
    recorder = Recorder()
    trainer = make_trainer(strategy, out, max_steps=20, callbacks=[recorder])
    train, val = loaders()
    trainer.fit(model, train)
    report["parity"] = {"losses": recorder.losses, "global_step": trainer.global_step}
    save_weights(trainer, out, "parity")

    # gradient accumulation and clipping: 12 optimizer updates (under DeepSpeed global_step counts batches)
    phalanx.seed_everything(0)
    model = DSNet(optimizer="sgd", lr=0.02)
    recorder = Recorder()
    batches = 24 if deepspeed else 12
    trainer = make_trainer(
        strategy, out, max_steps=batches, accumulate_grad_batches=2, gradient_clip_val=0.5, callbacks=[recorder]
    )
    train, val = loaders()
    trainer.fit(model, train)
    report["accumulate"] = {"losses": recorder.losses, "lrs": recorder.lrs, "global_step": trainer.global_step}
    if deepspeed:
        report["accumulate"]["config"] = {
            k: trainer.strategy.config[k]
            for k in ("gradient_accumulation_steps", "gradient_clipping", "train_micro_batch_size_per_gpu")
        }
    save_weights(trainer, out, "accumulate")

    # manual optimization
    phalanx.seed_everything(0)
    model = DSNet(manual=True)
    recorder = Recorder()
    trainer = make_trainer(strategy, out, max_steps=5, callbacks=[recorder])
    train, val = loaders()
    trainer.fit(model, train)
    report["manual"] = {"losses": recorder.losses, "global_step": trainer.global_step}

    if strategy in ("deepspeed_stage_2", "deepspeed_stage_3"):
        report["offload"] = offload_run(out, f"{strategy}_offload")
    if strategy == "deepspeed_stage_1":
        report["config_optimizer"] = config_optimizer_run(out)
    if strategy == "deepspeed_stage_2":
        report["bf16"] = bf16_run(out)
    if resume_from is not None:
        phalanx.seed_everything(0)
        model = DSNet()
        recorder = Recorder()
        trainer = make_trainer(strategy, out, max_steps=40, callbacks=[recorder])
        train, val = loaders()
        trainer.fit(model, train, val, ckpt_path=resume_from)
        report["resumed_from_checkpoint"] = {"losses": recorder.losses, "global_step": trainer.global_step}
        save_weights(trainer, out, "resumed_from_checkpoint")

    rank = trainer.global_rank
    (out / f"rank{rank}.json").write_text(json.dumps(report))


def math_numel(parameter: torch.Tensor) -> int:
    return int(getattr(parameter, "ds_numel", parameter.numel()))


def config_optimizer_run(out: Path) -> dict[str, Any]:
    """The optimizer and scheduler named in a DeepSpeed config (configure_optimizers is not called)."""
    from phalanx.strategies import DeepSpeedStrategy

    class NoOptimizer(DSNet):
        def configure_optimizers(self) -> Any:
            raise AssertionError("configure_optimizers must not be called when the DeepSpeed config names an optimizer")

    config = {
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear"},
        },
    }
    phalanx.seed_everything(0)
    model = NoOptimizer()
    recorder = Recorder()
    trainer = make_trainer(DeepSpeedStrategy(config=config), out, max_steps=6, callbacks=[recorder])
    train, _ = loaders()
    model.configure_model()
    initial = {name: value.detach().clone() for name, value in model.state_dict().items()}
    trainer.fit(model, train)
    final = full_weights(trainer)
    engine_optimizer = trainer.optimizers[0].optimizer
    return {
        "losses": recorder.losses,
        "lrs": recorder.lrs,
        "global_step": trainer.global_step,
        "optimizer": type(engine_optimizer).__name__,
        "base_optimizer": type(engine_optimizer.optimizer).__name__,
        "schedulers": len(trainer.lr_scheduler_configs),
        "weights_changed": all(not torch.equal(initial[k], final[k]) for k in initial),
    }


def offload_run(out: Path, strategy: str) -> dict[str, Any]:
    """ZeRO-Offload: optimizer states (and under stage 3 parameters) on the CPU, stepped by DeepSpeedCPUAdam."""
    phalanx.seed_everything(0)
    model = DSNet(optimizer="cpu_adam")
    recorder = Recorder()
    trainer = make_trainer(strategy, out, max_steps=5, callbacks=[recorder])
    train, _ = loaders()
    trainer.fit(model, train)
    zero = trainer.strategy.config["zero_optimization"]
    return {
        "losses": recorder.losses,
        "global_step": trainer.global_step,
        "offload_optimizer": zero.get("offload_optimizer", {}).get("device"),
        "offload_param": zero.get("offload_param", {}).get("device"),
    }


def bf16_run(out: Path) -> dict[str, Any]:
    """bf16-mixed: the engine holds the module in bfloat16 and float32 master weights in its optimizer."""
    phalanx.seed_everything(0)
    model = DSNet()
    recorder = Recorder()
    trainer = make_trainer("deepspeed_stage_2", out, max_steps=8, precision="bf16-mixed", callbacks=[recorder])
    train, _ = loaders()
    trainer.fit(model, train)
    return {
        "losses": recorder.losses, "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "bf16_config": trainer.strategy.config.get("bf16"), "memory": recorder.memory,
    }  # fmt: skip


if __name__ == "__main__":
    main()
