"""Scenarios run on torch_xla's PJRT CPU runtime, one fresh process each (the runtime starts once per process).

``python xla_scenarios.py NAME`` runs in the current directory (a pytest tmp_path: every file it writes goes there)
and prints one line ``RESULT <json>`` that the tests in this directory check. Each scenario compares phalanx on XLA
with the same run of phalanx on the CPU with plain PyTorch, and saves what the test process (no torch_xla) must load.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the shared test models

import torch  # noqa: E402
from phalanx_testing import Regressor, loaders  # noqa: E402
from torch import nn  # noqa: E402

import phalanx  # noqa: E402
from phalanx.callbacks import ModelCheckpoint  # noqa: E402


def trainer(**options: Any) -> phalanx.Trainer:
    checkpoints = any(isinstance(callback, ModelCheckpoint) for callback in options.get("callbacks", []))
    settings = dict(
        logger=False, enable_checkpointing=checkpoints, enable_progress_bar=False, enable_model_summary=False
    )
    settings.update(options)
    return phalanx.Trainer(**settings)


def fresh_model(**options: Any) -> Regressor:
    torch.manual_seed(1234)
    return Regressor(**options)


def cpu_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().cpu().float().clone() for name, tensor in module.state_dict().items()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    return max((a[name] - b[name]).abs().max().item() for name in a)


def fit_both(xla_options: dict[str, Any], cpu_options: dict[str, Any], batch: int, cpu_batch: int, **common: Any):
    """Fit the same model on XLA and on the CPU; return both modules and the XLA trainer."""
    torch.manual_seed(7)
    train, val = loaders(n=64, batch_size=batch, shuffle=False)
    xla_model, cpu_model = fresh_model(), fresh_model()
    xla_trainer = trainer(accelerator="xla", **xla_options, **common)
    xla_trainer.fit(xla_model, train, val)
    train, val = loaders(n=64, batch_size=cpu_batch, shuffle=False)
    trainer(accelerator="cpu", **cpu_options, **common).fit(cpu_model, train, val)
    return xla_model, cpu_model, xla_trainer


# ------------------------------------------------------------------ one device
def single() -> dict[str, Any]:
    result: dict[str, Any] = {}
    started = time.perf_counter()
    xla_model, cpu_model, xla_trainer = fit_both(
        {"devices": 1, "callbacks": [ModelCheckpoint(dirpath="single_ckpt", save_last=True)]},
        {},
        batch=8,
        cpu_batch=8,
        max_epochs=2,
    )
    result["fit_seconds"] = time.perf_counter() - started
    result["strategy"] = type(xla_trainer.strategy).__name__
    result["root_device"] = str(xla_trainer.strategy.root_device)
    result["param_diff_32"] = max_difference(cpu_weights(xla_model), cpu_weights(cpu_model))
    torch.save(cpu_weights(xla_model), "single_final.pt")
    result["checkpoint"] = str(Path("single_ckpt/last.ckpt").resolve())

    _, val = loaders(n=64, batch_size=16, shuffle=False)
    cpu_trainer = trainer(accelerator="cpu")
    for stage in ("validate", "test"):
        on_xla = getattr(xla_trainer, stage)(xla_model, val, verbose=False)[0]
        on_cpu = getattr(cpu_trainer, stage)(cpu_model, val, verbose=False)[0]
        result[f"{stage}_diff"] = max(abs(on_xla[key] - on_cpu[key]) for key in on_cpu)
    predicted = torch.cat([p.cpu() for p in xla_trainer.predict(xla_model, val)])
    expected = torch.cat(cpu_trainer.predict(cpu_model, val))
    result["predict_diff"] = (predicted - expected).abs().max().item()
    result["predict_shape"] = list(predicted.shape)

    # Accumulation and clipping: the same update rule as on the CPU.
    xla_model, cpu_model, _ = fit_both(
        {"devices": 1}, {}, batch=8, cpu_batch=8, max_epochs=1, accumulate_grad_batches=2, gradient_clip_val=0.05
    )
    result["param_diff_accumulate_clip"] = max_difference(cpu_weights(xla_model), cpu_weights(cpu_model))
    _, plain_model, _ = fit_both({"devices": 1}, {}, batch=8, cpu_batch=8, max_epochs=1)
    result["accumulate_clip_vs_plain"] = max_difference(cpu_weights(xla_model), cpu_weights(plain_model))

    # Exact resume: 1 epoch, then resume to 2, against 2 epochs in one go (the run above).
    train, val = loaders(n=64, batch_size=8, shuffle=False)
    first = trainer(
        accelerator="xla", devices=1, max_epochs=1, callbacks=[ModelCheckpoint(dirpath="resume_ckpt", save_last=True)]
    )
    first_model = fresh_model()
    first.fit(first_model, train, val)
    second_model = fresh_model()
    trainer(accelerator="xla", devices=1, max_epochs=2).fit(second_model, train, val, ckpt_path="resume_ckpt/last.ckpt")
    result["resume_diff"] = max_difference(cpu_weights(second_model), torch.load("single_final.pt"))

    # strategy="xla" on one device runs its one replica in this process, through torch_xla's launcher.
    xla_model, cpu_model, xla_trainer = fit_both(
        {"devices": 1, "strategy": "xla"}, {}, batch=8, cpu_batch=8, max_epochs=2
    )
    result["xla_one_device_strategy"] = type(xla_trainer.strategy).__name__
    result["param_diff_xla_one_device"] = max_difference(cpu_weights(xla_model), cpu_weights(cpu_model))
    stats = xla_trainer.strategy.accelerator.get_device_stats(torch.device("xla", 0))
    result["device_stats"] = {key: int(value) for key, value in stats.items()}

    for precision in ("bf16-true", "bf16-mixed"):
        xla_model, cpu_model, _ = fit_both(
            {"devices": 1, "precision": precision}, {"precision": precision}, batch=8, cpu_batch=8, max_epochs=2
        )
        result[f"dtype_{precision}"] = str(next(xla_model.parameters()).dtype)
        result[f"param_diff_{precision}"] = max_difference(cpu_weights(xla_model), cpu_weights(cpu_model))
    return result


# ------------------------------------------------------------------ two devices (threads of one process)
class CollectivesProbe(phalanx.Callback):
    """Runs every collective once per replica at the start of training; each replica writes what it got."""

    def on_train_start(self, trainer: phalanx.Trainer, module: phalanx.TrainingModule) -> None:
        strategy = trainer.strategy
        rank = trainer.global_rank
        device = strategy.root_device
        value = torch.tensor([float(rank + 1)], device=device)
        got: dict[str, Any] = {"rank": rank, "world_size": trainer.world_size, "device": str(device)}
        for op in ("mean", "sum", "max", "min"):
            got[op] = strategy.reduce(value, reduce_op=op).cpu().tolist()
        got["reduce_cpu_tensor_stays_on_cpu"] = strategy.reduce(torch.tensor([2.0 * rank]), reduce_op="sum").device.type
        got["all_gather"] = strategy.all_gather(torch.tensor([rank, 10 + rank], device=device)).cpu().tolist()
        got["broadcast_from_1"] = strategy.broadcast({"from": rank, "text": "x" * (300 * rank)}, src=1)["from"]
        got["broadcast_tensor"] = strategy.broadcast(torch.full((2,), float(rank), device=device)).cpu().tolist()
        got["all_gather_object"] = strategy.all_gather_object(("rank", rank))
        strategy.barrier("probe")
        got["all_true"] = strategy.reduce_boolean_decision(True)
        got["all_rank0"] = strategy.reduce_boolean_decision(rank == 0)
        got["any_rank0"] = strategy.reduce_boolean_decision(rank == 0, all=False)
        got["rank_zero_only_rank"] = __import__("phalanx.utilities.rank_zero", fromlist=["x"]).rank_zero_only.rank
        Path(f"collectives_rank{rank}.json").write_text(json.dumps(got))


class LaggingRankZero(phalanx.Callback):
    """Rank 0 falls 20 s behind once: XLA:CPU warns after 5 s at a collective, aborts 10 s later without the barrier."""

    def on_train_batch_end(self, trainer: phalanx.Trainer, *args: Any) -> None:
        if trainer.global_rank == 0 and trainer.global_step == 1:
            time.sleep(20)


class FailingRankOne(Regressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_rank == 1 and batch_idx == 2:
            raise ValueError("replica one fails on purpose")
        return super().training_step(batch, batch_idx)


class SyncValidated(Regressor):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)


class SyncLogged(Regressor):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        self.log("rank_sum", float(self.trainer.global_rank + 1), sync_dist=True, reduce_fx="sum")


def xla_fit(model: phalanx.TrainingModule, batch: int, ckpt_path: str | None = None, **options: Any) -> phalanx.Trainer:
    """Fit ``model`` on two XLA CPU devices (unshuffled data: rank r reads samples r, r + 2, ...)."""
    start_method = os.environ.get("XLA_START_METHOD", "fork")
    fitted = trainer(
        accelerator="xla", devices=2, strategy=phalanx.strategies.XLAStrategy(start_method=start_method), **options
    )
    torch.manual_seed(7)
    train, val = loaders(n=64, batch_size=batch, shuffle=False)
    fitted.fit(model, train, val, ckpt_path=ckpt_path)
    return fitted


def cpu_fit(model: phalanx.TrainingModule, batch: int, **options: Any) -> None:
    torch.manual_seed(7)
    train, val = loaders(n=64, batch_size=batch, shuffle=False)
    trainer(accelerator="cpu", **options).fit(model, train, val)


def replicas() -> dict[str, Any]:
    # Every XLA fit comes before any CPU backward pass here: a forked launch after autograd ran in the launching
    # process fails (torch's autograd engine does not survive the fork); the default start method, spawn, has no
    # such limit.
    result: dict[str, Any] = {}
    started = time.perf_counter()
    model = fresh_model()
    fitted = xla_fit(model, 8, callbacks=[ModelCheckpoint(dirpath="ckpt", save_last=True)], max_epochs=2)
    result["fit_seconds"] = time.perf_counter() - started
    result["global_step"] = fitted.global_step
    result["checkpoint_files"] = sorted(path.name for path in Path("ckpt").iterdir())
    result["checkpoint"] = str(Path("ckpt/last.ckpt").resolve())
    torch.save(cpu_weights(model), "replicas_final.pt")
    if os.environ.get("XLA_START_METHOD") == "spawn":
        reference = fresh_model()
        cpu_fit(reference, 16, max_epochs=2)
        result["param_diff_32"] = max_difference(cpu_weights(model), cpu_weights(reference))
        return result

    # Collectives, sync_dist logging, accumulation and clipping (gradients are averaged before clipping).
    torch.manual_seed(1234)
    probe_model = SyncLogged()
    probe = xla_fit(
        probe_model,
        8,
        callbacks=[CollectivesProbe(), LaggingRankZero()],
        max_epochs=1,
        accumulate_grad_batches=2,
        gradient_clip_val=0.05,
    )
    result["rank_sum"] = float(probe.callback_metrics["rank_sum"])
    result["collectives"] = [json.loads(Path(f"collectives_rank{r}.json").read_text()) for r in (0, 1)]

    # Exact resume: 1 epoch and a checkpoint, then resume to 2 epochs; against the 2-epoch run above.
    xla_fit(fresh_model(), 8, callbacks=[ModelCheckpoint(dirpath="resume_ckpt", save_last=True)], max_epochs=1)
    resumed = fresh_model()
    xla_fit(resumed, 8, ckpt_path="resume_ckpt/last.ckpt", max_epochs=2)
    result["resume_diff"] = max_difference(cpu_weights(resumed), cpu_weights(model))

    # Evaluation on two replicas (each reads half of the data; predictions come back gathered from both).
    start_method = os.environ.get("XLA_START_METHOD", "fork")
    evaluator = trainer(
        accelerator="xla", devices=2, strategy=phalanx.strategies.XLAStrategy(start_method=start_method)
    )
    _, val = loaders(n=64, batch_size=16, shuffle=False)
    validated = SyncValidated()
    validated.load_state_dict(model.state_dict())
    xla_validated = evaluator.validate(validated, val, verbose=False)[0]
    xla_predicted = evaluator.predict(model, val)

    # Your own loop on two replicas: examples/custom_loop.py through phalanx.Cohort.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from custom_loop import train as custom_train

    result["cohort_losses"] = []
    for epochs in (1, 3):
        strategy = phalanx.strategies.XLAStrategy(start_method=start_method)
        cohort = phalanx.Cohort(accelerator="xla", devices=2, strategy=strategy)
        result["cohort_losses"].append(cohort.launch(custom_train, epochs, None, 1, 1.0))

    # The CPU references: one process, the global batch of 16.
    reference = fresh_model()
    cpu_fit(reference, 16, max_epochs=2)
    result["param_diff_32"] = max_difference(cpu_weights(model), cpu_weights(reference))
    cpu_evaluator = trainer(accelerator="cpu")
    result["validate_keys"] = sorted(xla_validated)
    result["validate_diff"] = abs(
        xla_validated["val_loss"] - cpu_evaluator.validate(reference, val, verbose=False)[0]["val_loss"]
    )
    expected = torch.cat(cpu_evaluator.predict(reference, val))
    result["predict_batches"] = len(xla_predicted)
    result["predict_rows"] = sorted(int(t.shape[0]) for t in xla_predicted)
    # Each replica predicted its half; the Trainer puts the rows back in dataset order, batched as on one process.
    result["predict_diff"] = (torch.cat([t.cpu() for t in xla_predicted]) - expected).abs().max().item()
    torch.manual_seed(1234)
    cpu_probe = SyncLogged()
    cpu_fit(cpu_probe, 16, max_epochs=1, accumulate_grad_batches=2, gradient_clip_val=0.05)
    result["param_diff_accumulate_clip"] = max_difference(cpu_weights(probe_model), cpu_weights(cpu_probe))
    plain = fresh_model()
    cpu_fit(plain, 16, max_epochs=1)
    result["accumulate_clip_vs_plain"] = max_difference(cpu_weights(probe_model), cpu_weights(plain))
    return result


def failure() -> dict[str, Any]:
    """Replica 1 raises in its third step: the run must end with that error, not wait forever."""
    started = time.perf_counter()
    try:
        xla_fit(FailingRankOne(), 8, max_epochs=1)
    except Exception as error:  # noqa: BLE001 - the test checks what arrived
        return {"error": f"{type(error).__name__}: {error}", "seconds": time.perf_counter() - started}
    return {"error": None, "seconds": time.perf_counter() - started}


# ------------------------------------------------------------------ SPMD: one process drives both devices
def spmd() -> dict[str, Any]:
    import torch_xla

    result: dict[str, Any] = {}
    for name in ("xla_spmd", "xla_spmd_dp"):
        model, reference = fresh_model(), fresh_model()
        callbacks = [ModelCheckpoint(dirpath=f"{name}_ckpt", save_last=True)]
        fitted = trainer(accelerator="xla", devices=2, strategy=name, max_epochs=2, callbacks=callbacks)
        torch.manual_seed(7)
        train, val = loaders(n=64, batch_size=16, shuffle=False)
        fitted.fit(model, train, val)
        result[f"{name}_strategy"] = type(fitted.strategy).__name__
        result[f"{name}_world_size"] = fitted.world_size
        weight = model.net[0].weight
        result[f"{name}_weight_sharding"] = torch_xla._XLAC._get_xla_sharding_spec(weight)
        result[f"{name}_shard_shapes"] = [
            list(torch_xla._XLAC._get_local_shards([weight])[0][i][0].shape) for i in range(2)
        ]
        result[f"{name}_validate"] = fitted.validate(model, val, verbose=False)[0]["val_loss"]
        torch.save(cpu_weights(model), f"{name}_final.pt")
        result[f"{name}_checkpoint"] = str(Path(f"{name}_ckpt/last.ckpt").resolve())
        cpu_fit(reference, 16, max_epochs=2)
        result[f"{name}_param_diff"] = max_difference(cpu_weights(model), cpu_weights(reference))
        result[f"{name}_cpu_validate"] = trainer(accelerator="cpu").validate(reference, val, verbose=False)[0][
            "val_loss"
        ]
    # Exact resume under SPMD: 1 epoch, a checkpoint, then on to 2.
    torch.manual_seed(7)
    train, val = loaders(n=64, batch_size=16, shuffle=False)
    first = trainer(
        accelerator="xla",
        devices=2,
        strategy="xla_spmd",
        max_epochs=1,
        callbacks=[ModelCheckpoint(dirpath="spmd_resume", save_last=True)],
    )
    first.fit(fresh_model(), train, val)
    resumed = fresh_model()
    trainer(accelerator="xla", devices=2, strategy="xla_spmd", max_epochs=2).fit(
        resumed, train, val, ckpt_path="spmd_resume/last.ckpt"
    )
    result["resume_diff"] = max_difference(cpu_weights(resumed), torch.load("xla_spmd_final.pt"))
    result["resumed_weight_sharding"] = torch_xla._XLAC._get_xla_sharding_spec(resumed.net[0].weight)
    return result


# ------------------------------------------------------------------ a device index, and dropout resumed exactly
class DeviceProbe(phalanx.Callback):
    """Where the parameters and the batches of each training batch are."""

    def __init__(self) -> None:
        self.devices: set[str] = set()

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self.devices.update({str(next(module.parameters()).device), str(batch[0].device)})


def dropout_resume(strategy: str, devices: int, batch: int) -> dict[str, float]:
    """A model with dropout: 2 epochs at once against 1 epoch, a checkpoint and a resume to 2 (as in a new process:
    the XLA generator moved on), with the checkpoint as written and without its XLA generator states."""

    def fit(epochs: int, name: str, ckpt_path: str | None = None) -> Regressor:
        phalanx.seed_everything(3)
        model = fresh_model(dropout=0.3)
        train, _ = loaders(n=64, batch_size=batch, shuffle=True)
        callbacks = [ModelCheckpoint(dirpath=name, save_last=True)]
        options = dict(accelerator="xla", devices=devices, strategy=strategy, max_epochs=epochs, callbacks=callbacks)
        trainer(**options).fit(model, train, ckpt_path=ckpt_path)
        return model

    whole = cpu_weights(fit(2, f"{strategy}_whole"))
    fit(1, f"{strategy}_first")
    checkpoint = torch.load(f"{strategy}_first/last.ckpt", weights_only=True)
    seeds = [states.get("xla") for states in checkpoint["rng_states"]]
    for states in checkpoint["rng_states"]:
        states.pop("xla", None)
    torch.save(checkpoint, f"{strategy}_first/without_xla.ckpt")
    result: dict[str, Any] = {"xla_seeds": seeds}
    for key, path in (("resume_diff", "last.ckpt"), ("resume_diff_without_xla_state", "without_xla.ckpt")):
        if strategy == "single_xla":  # in this process: a new process would start from another state ("xla" starts one)
            import torch_xla.core.xla_model as xm

            xm.set_rng_state(987654321)
        resumed = fit(2, f"{strategy}_{key}", ckpt_path=f"{strategy}_first/{path}")
        result[key] = max_difference(cpu_weights(resumed), whole)
    return result


def extras() -> dict[str, Any]:
    result: dict[str, Any] = {}
    probe = DeviceProbe()
    xla_model, cpu_model, xla_trainer = fit_both(
        {"devices": [1], "callbacks": [probe]}, {}, batch=8, cpu_batch=8, max_epochs=1
    )
    result["index_strategy"] = type(xla_trainer.strategy).__name__
    result["index_devices"] = sorted(probe.devices)
    result["index_param_diff"] = max_difference(cpu_weights(xla_model), cpu_weights(cpu_model))
    result["single_xla"] = dropout_resume("single_xla", 1, batch=8)
    return result


def replica_dropout() -> dict[str, Any]:
    # torch_xla's launcher starts a process of its own for every fit, and only before this one ran anything on XLA.
    return dropout_resume("xla", 2, batch=4)


# ------------------------------------------------------------------ fully sharded (xla_fsdp), two devices
class AdamRegressor(Regressor):
    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


class ShardProbe(phalanx.Callback):
    """What each replica holds at the start of training: its shards (shape, and how much of it is weight)."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: Any, module: Any) -> None:
        shards = trainer.strategy._shards.entries
        self.seen = {
            "registered": len(list(module.parameters())),  # the module itself holds no parameter any more
            "shards": {entry.name: [list(entry.shard.shape), list(entry.size)] for entry in shards},
            "nonzero": {entry.name: int((entry.shard.detach().cpu() != 0).sum()) for entry in shards},
        }
        Path(f"shards_rank{trainer.global_rank}.json").write_text(json.dumps(self.seen))


def fsdp_fit(model: Regressor, batch: int, epochs: int, ckpt_path: str | None = None, **options: Any) -> Any:
    strategy = phalanx.strategies.XLAFSDPStrategy(start_method=os.environ.get("XLA_START_METHOD", "fork"))
    fitted = trainer(accelerator="xla", devices=2, strategy=strategy, max_epochs=epochs, **options)
    torch.manual_seed(7)
    train, val = loaders(n=64, batch_size=batch, shuffle=False)
    fitted.fit(model, train, val, ckpt_path=ckpt_path)
    return fitted


def fully_sharded() -> dict[str, Any]:
    # Every XLA fit first (a fork after a CPU backward pass fails), then the CPU references.
    result: dict[str, Any] = {}
    torch.manual_seed(1234)
    model = AdamRegressor(hidden=64)
    callbacks = [ModelCheckpoint(dirpath="fsdp_ckpt", save_last=True), ShardProbe()]
    fitted = fsdp_fit(model, 8, 2, callbacks=callbacks)
    result["strategy"] = type(fitted.strategy).__name__
    result["shards"] = [json.loads(Path(f"shards_rank{rank}.json").read_text()) for rank in (0, 1)]
    torch.save(cpu_weights(model), "fsdp_final.pt")
    result["checkpoint"] = str(Path("fsdp_ckpt/last.ckpt").resolve())
    torch.manual_seed(1234)
    clipped = AdamRegressor(hidden=64)
    fsdp_fit(clipped, 8, 1, accumulate_grad_batches=2, gradient_clip_val=0.05)
    # Exact resume: 1 epoch with a checkpoint, then on to 2 from it, against the 2 epochs above.
    torch.manual_seed(1234)
    fsdp_fit(AdamRegressor(hidden=64), 8, 1, callbacks=[ModelCheckpoint(dirpath="fsdp_resume", save_last=True)])
    torch.manual_seed(1234)
    resumed = AdamRegressor(hidden=64)
    fsdp_fit(resumed, 8, 2, ckpt_path="fsdp_resume/last.ckpt")
    result["resume_diff"] = max_difference(cpu_weights(resumed), cpu_weights(model))
    # Each Linear its own shard unit (nested wrappers), as Lightning users pass auto_wrap_policy.
    torch.manual_seed(1234)
    wrapped = AdamRegressor(hidden=64)
    strategy = phalanx.strategies.XLAFSDPStrategy(
        start_method=os.environ.get("XLA_START_METHOD", "fork"), auto_wrap_policy={nn.Linear}
    )
    torch.manual_seed(7)
    train, val = loaders(n=64, batch_size=8, shuffle=False)
    trainer(accelerator="xla", devices=2, strategy=strategy, max_epochs=2).fit(wrapped, train, val)

    torch.manual_seed(1234)
    reference = AdamRegressor(hidden=64)
    cpu_fit(reference, 16, max_epochs=2)
    result["param_diff"] = max_difference(cpu_weights(model), cpu_weights(reference))
    result["param_diff_auto_wrap"] = max_difference(cpu_weights(wrapped), cpu_weights(reference))
    torch.manual_seed(1234)
    reference = AdamRegressor(hidden=64)
    cpu_fit(reference, 16, max_epochs=1, accumulate_grad_batches=2, gradient_clip_val=0.05)
    result["param_diff_accumulate_clip"] = max_difference(cpu_weights(clipped), cpu_weights(reference))
    torch.manual_seed(1234)
    plain = AdamRegressor(hidden=64)
    cpu_fit(plain, 16, max_epochs=1)
    result["accumulate_clip_vs_plain"] = max_difference(cpu_weights(clipped), cpu_weights(plain))
    return result


SCENARIOS = {
    "single": single,
    "replicas": replicas,
    "failure": failure,
    "spmd": spmd,
    "extras": extras,
    "replica_dropout": replica_dropout,
    "fully_sharded": fully_sharded,
}


if __name__ == "__main__":
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    outcome = SCENARIOS[sys.argv[1]]()
    print("RESULT " + json.dumps(outcome), flush=True)
