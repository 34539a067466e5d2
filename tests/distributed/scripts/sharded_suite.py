"""FSDP and ModelParallel on 2 CPU processes (gloo): one job, many fits, results in OUT for
tests/distributed/test_sharded.py.

Usage: python sharded_suite.py OUT SINGLE_CKPT   (phalanx starts the second process itself)
SINGLE_CKPT is a checkpoint written by one process after 10 steps (the test writes it), resumed here on two.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch
from sharded_common import MLP, STEPS, TransformerBlock, loader, quiet, sequences
from torch import nn
from torch.utils.data import DataLoader

import phalanx
from phalanx.callbacks import ModelCheckpoint
from phalanx.strategies import FSDPStrategy, ModelParallelStrategy
from phalanx.utilities.dtensor import full_module_state, is_dtensor

OUT = Path(sys.argv[1])
SINGLE_CKPT = sys.argv[2]
results: dict[str, Any] = {}


def whole_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return full_module_state(module, keep=True)


def fit(
    name: str,
    strategy: Any,
    module: phalanx.TrainingModule | None = None,
    *,
    steps: int = STEPS,
    ckpt_path: str | None = None,
    callbacks: list | None = None,
    **trainer_kwargs: Any,
) -> tuple[phalanx.TrainingModule, phalanx.Trainer]:
    phalanx.seed_everything(7)
    module = module if module is not None else MLP()
    trainer = quiet(strategy=strategy, devices=2, max_steps=steps, callbacks=callbacks, **trainer_kwargs)
    trainer.fit(module, loader(2), ckpt_path=ckpt_path)
    weights = whole_weights(module)
    results[name] = {"losses": trainer.strategy.all_gather_object(module.losses), "global_step": trainer.global_step}
    if trainer.is_global_zero:
        torch.save(weights, OUT / f"{name}.pt")
    return module, trainer


class MemoryProbe(phalanx.Callback):
    """Bytes this rank holds for parameters (between forward and backward), gradients and Adam state (before a step)."""

    def __init__(self) -> None:
        self.figures: dict[str, float] = {}

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.figures["total"] = float(sum(p.numel() * p.element_size() for p in module.parameters()))
        self.figures["shards"] = float(sum(p.to_local().nbytes for p in module.parameters() if is_dtensor(p)))

    def on_before_backward(self, trainer: Any, module: Any, loss: torch.Tensor) -> None:
        # While a layer is gathered, module.parameters() yields its whole (plain) tensors; the shards stay held too.
        gathered = sum(p.nbytes for p in module.parameters() if not is_dtensor(p))
        self.figures["params_in_step"] = max(self.figures.get("params_in_step", 0.0), self.figures["shards"] + gathered)

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        self.figures["grads"] = float(sum(p.grad.to_local().nbytes for p in module.parameters() if p.grad is not None))
        state = [value for entries in optimizer.state.values() for value in entries.values() if is_dtensor(value)]
        self.figures["optimizer"] = float(sum(value.to_local().nbytes for value in state))


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    # ------------------------------------------------------------- loss parity across sharding strategies and DDP
    ddp_checkpoints = ModelCheckpoint(
        dirpath=OUT / "ddp_ckpt", every_n_train_steps=10, save_top_k=-1, filename="{step}"
    )
    fit("ddp", "ddp", callbacks=[ddp_checkpoints], enable_checkpointing=True)
    full_checkpoints = ModelCheckpoint(
        dirpath=OUT / "fsdp_full_ckpt", every_n_train_steps=10, save_top_k=-1, filename="{step}"
    )
    fit("fsdp", FSDPStrategy(state_dict_type="full"), callbacks=[full_checkpoints], enable_checkpointing=True)
    sharded_checkpoints = ModelCheckpoint(
        dirpath=OUT / "fsdp_sharded_ckpt", every_n_train_steps=10, save_top_k=-1, filename="{step}"
    )
    fit(
        "fsdp_sharded_save",
        FSDPStrategy(state_dict_type="sharded"),
        callbacks=[sharded_checkpoints],
        enable_checkpointing=True,
    )
    for sharding in ("SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"):
        fit(f"fsdp_{sharding}", FSDPStrategy(sharding_strategy=sharding))
    fit("fsdp_wrap_blocks", FSDPStrategy(auto_wrap_policy={nn.Linear}))
    fit("fsdp_cpu_offload", "fsdp_cpu_offload")
    fit("fsdp_accumulate", "fsdp", accumulate_grad_batches=2, steps=STEPS // 2)
    fit("ddp_accumulate", "ddp", accumulate_grad_batches=2, steps=STEPS // 2)
    fit("fsdp_clip", "fsdp", gradient_clip_val=0.05)
    fit("ddp_clip", "ddp", gradient_clip_val=0.05)

    # ------------------------------------------------------------- the seed's (Lightning's) FSDP1 arguments
    from torch.distributed.fsdp import CPUOffload, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy

    Block = type(MLP().blocks[0])
    everyone = torch.distributed.new_group([0, 1])  # every rank creates every group, in the same order
    alone = [torch.distributed.new_group([0]), torch.distributed.new_group([1])]
    seed_strategy = FSDPStrategy(
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        process_group=everyone,
        cpu_offload=CPUOffload(offload_params=False),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        activation_checkpointing_policy=partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        use_orig_params=True,
        limit_all_gathers=True,
        sync_module_states=True,
    )
    module, _ = fit("fsdp_seed_arguments", seed_strategy)
    results["fsdp_seed_arguments"]["block_calls"] = [block.calls for block in module.blocks]
    hybrid = FSDPStrategy(
        sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=(everyone, alone[torch.distributed.get_rank()])
    )
    _, trainer = fit("fsdp_hybrid_process_groups", hybrid)
    results["fsdp_hybrid_process_groups"]["mesh"] = list(trainer.strategy.device_mesh.shape)
    _, trainer = fit("fsdp_hybrid_zero2", FSDPStrategy(sharding_strategy="_HYBRID_SHARD_ZERO2", device_mesh=(2, 1)))
    results["fsdp_hybrid_zero2"]["mesh"] = list(trainer.strategy.device_mesh.shape)

    # ------------------------------------------------------------- a module that shards itself in configure_model is
    # kept as it is
    class SelfSharded(MLP):
        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.trainer.strategy.device_mesh
            for block in self.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self, mesh=mesh)

    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        phalanx.seed_everything(7)
        fit("fsdp_self_sharded", FSDPStrategy(auto_wrap_policy={nn.Linear}), SelfSharded())
    results["fsdp_self_sharded"]["warnings"] = [str(w.message) for w in caught if "already sharded" in str(w.message)]

    # ------------------------------------------------------------- activation checkpointing: same losses, blocks run
    # twice
    module, _ = fit(
        "fsdp_activation_checkpointing",
        FSDPStrategy(auto_wrap_policy={nn.Linear}, activation_checkpointing_policy={type(MLP().blocks[0])}),
    )
    results["fsdp_activation_checkpointing"]["block_calls"] = [block.calls for block in module.blocks]
    module, _ = fit("fsdp_plain_calls", "fsdp", steps=STEPS)
    results["fsdp_plain_calls"]["block_calls"] = [block.calls for block in module.blocks]

    # ------------------------------------------------------------- mixed precision (bf16 on the CPU)
    module, _ = fit("fsdp_bf16", "fsdp", precision="bf16-mixed")
    results["fsdp_bf16"]["param_dtype"] = str(next(module.parameters()).dtype)
    fit("ddp_bf16", "ddp", precision="bf16-mixed")

    # ------------------------------------------------------------- meta-device creation in configure_model
    phalanx.seed_everything(11)
    meta_module = MLP(build_in_configure_model=True)
    probe: dict[str, Any] = {}

    class Initial(phalanx.Callback):
        def on_fit_start(self, trainer: Any, module: Any) -> None:
            probe["meta_left"] = any(t.is_meta for t in module.parameters())
            probe["weights"] = whole_weights(module)

    trainer = quiet(strategy="fsdp", devices=2, max_steps=3, callbacks=[Initial()])
    trainer.fit(meta_module, loader(2))
    results["meta_init"] = {
        "meta_left": probe["meta_left"],
        "losses": trainer.strategy.all_gather_object(meta_module.losses),
    }
    if trainer.is_global_zero:
        torch.save(probe["weights"], OUT / "meta_init_weights.pt")

    # ------------------------------------------------------------- memory: ZeRO-3 (FULL_SHARD) and ZeRO-2
    # (SHARD_GRAD_OP)
    for sharding in ("FULL_SHARD", "SHARD_GRAD_OP"):
        memory = MemoryProbe()
        fit(
            f"memory_{sharding}",
            FSDPStrategy(sharding_strategy=sharding, auto_wrap_policy={nn.Linear}),
            MLP(width=256, depth=3),
            steps=3,
            callbacks=[memory],
        )
        results[f"memory_{sharding}"]["figures"] = memory.figures

    # ------------------------------------------------------------- resumes, across strategies and sizes
    fit("fsdp_from_fsdp_full", "fsdp", ckpt_path=str(OUT / "fsdp_full_ckpt" / "step=10.ckpt"))
    fit(
        "fsdp_from_fsdp_sharded",
        FSDPStrategy(state_dict_type="sharded"),
        ckpt_path=str(OUT / "fsdp_sharded_ckpt" / "step=10.ckpt"),
    )
    fit("ddp_from_fsdp_sharded", "ddp", ckpt_path=str(OUT / "fsdp_sharded_ckpt" / "step=10.ckpt"))
    fit("fsdp_from_ddp", "fsdp", ckpt_path=str(OUT / "ddp_ckpt" / "step=10.ckpt"))
    fit("fsdp_from_single", "fsdp", ckpt_path=SINGLE_CKPT)

    # ------------------------------------------------------------- evaluation and prediction on sharded models
    module, trainer = fit("fsdp_eval", "fsdp", steps=4)
    odd = DataLoader(
        torch.utils.data.TensorDataset(*loader(1).dataset[:45]), batch_size=8
    )  # 45 samples: ranks get 23 and 22
    results["fsdp_eval"]["validated"] = trainer.validate(module, odd, verbose=False)
    predictions = trainer.predict(module, odd)
    results["fsdp_eval"]["predictions"] = torch.cat(predictions).flatten().tolist()
    results["fsdp_eval"]["prediction_batches"] = [len(batch) for batch in predictions]
    eval_weights = whole_weights(module)  # a collective: every rank gathers, rank 0 saves
    if trainer.is_global_zero:
        torch.save(eval_weights, OUT / "fsdp_eval_weights.pt")

    # ------------------------------------------------------------- tensor parallelism on a transformer block
    phalanx.seed_everything(13)
    block = TransformerBlock()
    tp_checkpoints = ModelCheckpoint(dirpath=OUT / "tp_ckpt", every_n_train_steps=5, save_top_k=-1, filename="{step}")
    trainer = quiet(
        strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
        devices=2,
        max_steps=10,
        callbacks=[tp_checkpoints],
        enable_checkpointing=True,
    )
    trainer.fit(block, DataLoader(sequences(), batch_size=8))
    results["tp"] = {
        "losses": trainer.strategy.all_gather_object(block.losses),
        "sharded": sorted(name for name, p in block.named_parameters() if is_dtensor(p)),
    }
    tp_weights = whole_weights(block)
    if trainer.is_global_zero:
        torch.save(tp_weights, OUT / "tp.pt")

    if trainer.is_global_zero:
        (OUT / "results.json").write_text(json.dumps(results))
