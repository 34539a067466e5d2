"""The resume matrix (tests/distributed/test_resume_matrix.py): checkpoints in every layout written on 2 processes,
resumed on every strategy.

Usage: python resume_matrix_job.py OUT   (phalanx starts the second process itself)

On 2 processes this writes the source checkpoints OUT/src_{ddp,fsdp,ds1,ds2,ds3,pp,pp_v,hsdp}.ckpt (after SAVE_AT steps;
OUT/src_one.ckpt and OUT/src_ft.ckpt, of a ddp_ft replica group, were written on 1 process by
``write_one_process_sources`` before the launch), runs each target
strategy uninterrupted for STEPS steps (OUT/ref_{target}.pt) and resumes every source on every 2-process target to
STEPS (OUT/{source}__{target}.pt); OUT/src_{ds1,ds2,ds3}.pt is the DeepSpeed runs' state at the save. Each
.pt holds, by parameter name, the weights, Adam's state, the global step and the sample indices each rank saw (rank 0
writes it; every rank takes part in gathering). ``run_one`` is the single-device column (called in the test's own
process), and so is ``ddp_ft``'s (one replica group, a lighthouse in this process); a cell of these that fails writes
its error to OUT/{source}__{single,ddp_ft}.error. A failing 2-process cell fails the
whole job (its output names the cell).

hsdp_ft runs as one replica group of the job's 2 processes (a lighthouse in rank 0's process): its checkpoint ("hsdp")
resumes on fsdp and on one device, and fsdp's resumes on it (``FAULT_TOLERANT_COLUMNS``, ``FAULT_TOLERANT_SOURCES``).

The pipeline layouts (ModelParallelStrategy with pipeline_parallel_size=2: "pp" one stage per rank with 1F1B, "pp_v"
two virtual stages per rank with Interleaved1F1B) join as sources and a target on their own cells (``CELLS``): the pp
checkpoint resumes without a pipeline (single device, ddp, fsdp, model_parallel), and the ddp, fsdp, one-process and
pp_v checkpoints resume under pp, and so does the pp checkpoint found by ``ckpt_path="auto"`` ("pp_auto").
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from strategy_cases import build_one_sharded_group, names
from torch import nn
from torch.utils.data import DataLoader, Dataset

import phalanx
from phalanx.strategies.pipeline_split import keep_stages

STEPS, SAVE_AT = 12, 5  # 8 steps an epoch: the save is mid-epoch and the resumed run crosses an epoch boundary
SAMPLES, GLOBAL_BATCH, FEATURES, WIDTH, BLOCKS = 64, 8, 16, 32, 4
SOURCES = {
    "ddp": "ddp",
    "fsdp": "fsdp_sharded",
    "ds1": "deepspeed_stage_1",
    "ds2": "deepspeed_stage_2",
    "ds3": "deepspeed_stage_3",
}
#: Written on 1 process (by the test, before the 2-process launch): checkpoints also change world size upwards.
ONE_PROCESS_SOURCES = {"one": "auto", "ft": "ddp_ft"}
ALL_SOURCES = [*SOURCES, *ONE_PROCESS_SOURCES]
#: Run in the test's own process: single_device, and ddp_ft as one replica group of one process (each group is its own
#: job, with its own launch: one group keeps the matrix to one launch).
ONE_PROCESS_TARGETS = {"single_device": "single", "ddp_ft": "ddp_ft"}
#: Every 2-process strategy that promises to resume any checkpoint (tests/strategy_cases.py).
TARGETS = [name for name in names("resume") if name not in ONE_PROCESS_TARGETS]
#: Fault-tolerant columns resume the sources of their family only (each of their steps costs a quorum): ddp_ft's
#: (one group of one process, in the test's process) ddp, fsdp, one process and itself; hsdp_ft's (one group of 2
#: processes, FSDP over both, in the job) fsdp. Its own checkpoint ("hsdp") resumes on fsdp and on one device.
FAULT_TOLERANT_COLUMNS = {"ddp_ft": ["ddp", "fsdp", "one", "ft"], "hsdp_ft": ["fsdp"]}
FAULT_TOLERANT_SOURCES = {"hsdp": ("hsdp_ft", ["single", "fsdp"])}
#: Pipeline layouts on 2 processes (pipeline_parallel_size=2, no data parallelism): name -> schedule.
PIPELINES = {"pp": "1F1B", "pp_v": "Interleaved1F1B"}
#: Every (source, target) cell: each source on every strategy but the fault-tolerant ones, whose cells are
#: FAULT_TOLERANT_COLUMNS' and FAULT_TOLERANT_SOURCES'; the pipeline's cells: its checkpoint without a pipeline, other
#: layouts' checkpoints under it, and two virtual stages per rank to one.
CELLS = [
    *(
        (source, target)
        for source in ALL_SOURCES
        for target in ["single", *TARGETS]
        if target not in FAULT_TOLERANT_COLUMNS
    ),
    *((source, target) for target, sources in FAULT_TOLERANT_COLUMNS.items() for source in sources),
    *((source, target) for source, (_, targets) in FAULT_TOLERANT_SOURCES.items() for target in targets),
    *(("pp", target) for target in ["single", "ddp", "fsdp", "model_parallel"]),
    *((source, "pp") for source in ["ddp", "fsdp", "one", "pp_v", "pp_auto"]),
]
#: Not a file: the pp checkpoint found by ``ckpt_path="auto"`` in the run's checkpoint folder.
AUTO = "pp_auto"


class Indexed(Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(5)
        self.x = torch.randn(SAMPLES, FEATURES, generator=generator)
        self.y = torch.sin(self.x[:, :1]) + self.x[:, 1:2] * self.x[:, 2:3]

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index], self.y[index], index


class MatrixMLP(phalanx.TrainingModule):
    """A small MLP of repeated blocks without dropout, Adam; records the sample indices of each training batch and the
    loss. Under a pipeline each rank keeps its stages' blocks (the head on the last stage)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            *(nn.Sequential(nn.Linear(FEATURES if i == 0 else WIDTH, WIDTH), nn.Tanh()) for i in range(BLOCKS))
        )
        self.head: nn.Module | None = nn.Linear(WIDTH, 1)
        self.seen: list[list[int]] = []
        self.losses: list[float] = []

    def configure_model(self) -> None:
        strategy = self.trainer.strategy
        if getattr(strategy, "pipeline_parallel_size", 1) > 1:
            keep_stages(self, "net", strategy.pipeline_stages, strategy.num_pipeline_stages, last=["head"])
            return
        mesh = self.device_mesh
        if mesh is None or mesh.mesh_dim_names != ("data_parallel", "tensor_parallel"):
            return  # only ModelParallel leaves the parallelisation to the module
        from torch.distributed.fsdp import fully_shard

        for block in (*self.net, self.head):
            fully_shard(block, mesh=mesh["data_parallel"])
        fully_shard(self, mesh=mesh["data_parallel"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.net(x)
        return self.head(x) if self.head is not None else x

    def pipeline_loss(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        return nn.functional.mse_loss(output, batch[1])

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.seen.append([int(i) for i in batch[2]])  # here, not in training_step: a pipeline does not call that

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        return self.pipeline_loss(self(x), batch)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach()))

    def on_train_end(self) -> None:
        engine = self.trainer.strategy.model  # DeepSpeed's engine, released after fit
        self.engine_steps = (engine.global_steps, engine.global_samples) if hasattr(engine, "global_steps") else None

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


@contextlib.contextmanager
def replica_group() -> Any:
    """A lighthouse and the store address of one replica group (group 0 of 1) for ``strategy_for("ddp_ft")``."""
    from phalanx.strategies.fault_tolerant import start_lighthouse

    saved = {key: os.environ.get(key) for key in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    try:
        # Each fit is a new replica of one group: a short join timeout lets its quorum form at once.
        with start_lighthouse(
            min_replicas=1, join_timeout=timedelta(milliseconds=20), quorum_tick=timedelta(milliseconds=10)
        ) as lighthouse:
            os.environ["TORCHFT_LIGHTHOUSE"] = lighthouse.address
            yield
    finally:
        os.environ.pop("TORCHFT_LIGHTHOUSE", None)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def strategy_for(name: str) -> Any:
    if name == "ddp_ft":
        import socket

        from phalanx.strategies import DDPFaultTolerantStrategy, FaultTolerance

        # A fresh store port for each fit: the last fit's torchft Manager may still hold the previous one.
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
        options = FaultTolerance(0, 1, lighthouse=os.environ["TORCHFT_LIGHTHOUSE"])
        return DDPFaultTolerantStrategy(fault_tolerance=options)
    if name == "hsdp_ft":
        # Replica group 0 of 1 over the job's 2 processes, a fresh lighthouse in rank 0's process for each fit.
        return build_one_sharded_group()
    if name == "fsdp_sharded":
        from phalanx.strategies import FSDPStrategy

        return FSDPStrategy(state_dict_type="sharded")
    if name == "model_parallel":  # 2 processes: data parallel over both, the module shards itself with fully_shard
        from phalanx.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    if name in PIPELINES:
        from phalanx.strategies import ModelParallelStrategy

        return ModelParallelStrategy(pipeline_parallel_size=2, pipeline_schedule=PIPELINES[name])
    return name


def make_trainer(strategy: str, devices: int, steps: int, root: Path) -> phalanx.Trainer:
    return phalanx.Trainer(
        strategy=strategy_for(strategy),
        devices=devices,
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
    )


def fit(strategy: str, devices: int, steps: int, root: Path, ckpt_path: Any = None) -> tuple[Any, Any]:
    phalanx.seed_everything(11)
    model = MatrixMLP()
    trainer = make_trainer(strategy, devices, steps, root)
    # Not shuffled: a DistributedSampler deals sample i to rank i % 2, so every world size trains on the same global
    # batches (a shuffled single-device order would come from the saving run's RNG state, another world size's).
    # A pipeline's two stages read the same batches: the whole global batch.
    data_parallel = 1 if strategy in PIPELINES else devices
    loader = DataLoader(Indexed(), batch_size=GLOBAL_BATCH // data_parallel, shuffle=False)
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    return model, trainer


def release() -> None:
    """End a one-process ddp_ft run's process group (its own process would end), so that the next fit starts one."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def full_state(model: MatrixMLP, trainer: phalanx.Trainer) -> dict[str, Any] | None:
    """Weights, Adam's state (by parameter name), step and seen samples; every rank calls, rank 0 gets it."""
    strategy = trainer.strategy
    names = [name for name, _ in model.named_parameters()]
    optimizer = trainer.optimizers[0]
    if hasattr(strategy, "zero_stage"):
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        params = dict(model.named_parameters())
        weights = {name: safe_get_full_fp32_param(params[name]).detach().clone() for name in names}
        moments = {
            name: {key: safe_get_full_optimizer_state(params[name], key).clone() for key in ("exp_avg", "exp_avg_sq")}
            for name in names
        }
        base = optimizer.optimizer
        steps = {float(entry["step"]) for entry in base.state.values()}
        engine_steps = model.engine_steps
    elif getattr(strategy, "pipeline_parallel_size", 1) > 1:
        weights, moments, steps = _pipeline_state(model, trainer)
        engine_steps = None
    else:
        from phalanx.utilities.dtensor import full_module_state, full_optimizer_state

        # Whole tensors whatever the strategy's checkpoint layout (ModelParallel's default is sharded).
        whole = full_module_state(model, keep=trainer.is_global_zero)
        weights = {name: value.float() for name, value in whole.items() if name in names}
        saved = full_optimizer_state(optimizer, keep=trainer.is_global_zero)
        if not trainer.is_global_zero:
            weights, saved = {}, {"state": {}}
        order = [index for group in saved.get("param_groups", []) for index in group["params"]]
        moments = {
            name: {key: saved["state"][index][key] for key in ("exp_avg", "exp_avg_sq")}
            for name, index in zip(names, order)
        }
        steps = {float(entry["step"]) for entry in saved["state"].values()}
        engine_steps = None
    seen = strategy.all_gather_object(model.seen)
    if not trainer.is_global_zero:
        return None
    from phalanx.utilities.dtensor import is_dtensor

    return {
        "strategy": type(strategy).__name__,
        "dtensor_parameters": sorted(name for name, value in model.named_parameters() if is_dtensor(value)),
        "weights": weights,
        "moments": moments,
        "adam_steps": sorted(steps),
        "global_step": trainer.global_step,
        "engine_steps": engine_steps,  # DeepSpeed's own count of steps and samples (its schedules and logs read it)
        "seen": seen,
        "losses": model.losses,  # rank 0's loss at each step after the resume
    }


def _pipeline_state(model: MatrixMLP, trainer: phalanx.Trainer) -> tuple[dict, dict, set]:
    """A pipeline's weights and Adam's state: each rank holds its stages' parameters (plain tensors), gathered here."""
    from phalanx.utilities.optimizer_names import state_by_name

    local = state_by_name(trainer.optimizers[0], model)["state"]
    weights: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for part, state in trainer.strategy.all_gather_object(
        ({name: value.detach().float() for name, value in model.named_parameters()}, local)
    ):
        weights.update(part)
        moments.update(
            {name: {key: entries[key] for key in ("exp_avg", "exp_avg_sq")} for name, entries in state.items()}
        )
    steps = {float(entries["step"]) for entries in local.values()}
    return weights, moments, steps


def record(path: Path, model: MatrixMLP, trainer: phalanx.Trainer) -> None:
    state = full_state(model, trainer)
    if state is not None:
        torch.save(state, path)


def write_one_process_sources(out: Path) -> None:
    """The sources written on 1 process (run before the launch, whose cells resume them on 2)."""
    with replica_group():
        for source, strategy in ONE_PROCESS_SOURCES.items():
            _, trainer = fit(strategy, 1, SAVE_AT, out / "one")
            trainer.save_checkpoint(out / f"src_{source}.ckpt")
            release()


def run_one(out: Path) -> None:
    """The one-process columns (single device, one ddp_ft replica group): the uninterrupted run and a resume from every
    source of its cells."""
    with replica_group():
        for strategy, column in (("auto", "single"), ("ddp_ft", "ddp_ft")):
            model, trainer = fit(strategy, 1, STEPS, out / "one")
            record(out / f"ref_{column}.pt", model, trainer)
            release()
            for source in [source for source, target in CELLS if target == column]:
                try:
                    model, trainer = fit(strategy, 1, STEPS, out / "one", ckpt_path=out / f"src_{source}.ckpt")
                    record(out / f"{source}__{column}.pt", model, trainer)
                except Exception as error:  # the test reports which cell failed and why
                    (out / f"{source}__{column}.error").write_text(f"{type(error).__name__}: {error}")
                finally:
                    release()


def main() -> None:
    out = Path(sys.argv[1])
    # torchft's cells last: its threads (each lighthouse's, each Manager's runtime) outlive their fits, and nothing
    # after them starts processes (DeepSpeed's start-up included).
    fault_tolerant_sources = {source: strategy for source, (strategy, _) in FAULT_TOLERANT_SOURCES.items()}
    later = [target for target in TARGETS if target in FAULT_TOLERANT_COLUMNS]
    write_sources(out, {**SOURCES, **{name: name for name in PIPELINES}})
    for target in [*(target for target in TARGETS if target not in later), "pp"]:
        run_column(
            out, target, [source for source, cell in CELLS if cell == target and source not in FAULT_TOLERANT_SOURCES]
        )
    write_sources(out, fault_tolerant_sources)
    for target in later:
        run_column(out, target, [source for source, cell in CELLS if cell == target])
    for source, (_, targets) in FAULT_TOLERANT_SOURCES.items():
        for target in targets:
            if target != "single":  # the test's process resumes it on one device
                resume(out, source, target)


def write_sources(out: Path, sources: dict[str, str]) -> None:
    """Fit each source strategy for SAVE_AT steps on 2 processes and save OUT/src_{source}.ckpt."""
    for source, strategy in sources.items():
        model, trainer = fit(strategy, 2, SAVE_AT, out / "two")
        trainer.save_checkpoint(out / f"src_{source}.ckpt")
        if source.startswith("ds"):  # what `phalanx checkpoint consolidate` must reproduce
            record(out / f"src_{source}.pt", model, trainer)


def run_column(out: Path, target: str, sources: list[str]) -> None:
    """The uninterrupted run of ``target`` (OUT/ref_{target}.pt), then each of ``sources`` resumed on it."""
    model, trainer = fit(target, 2, STEPS, out / "two")
    record(out / f"ref_{target}.pt", model, trainer)
    for source in sources:
        resume(out, source, target)


def resume(out: Path, source: str, target: str) -> None:
    # A failing cell fails the job: an error caught on one rank only would leave the other in a collective.
    print(f"resume matrix: {source} -> {target}", flush=True)
    if source == AUTO:
        model, trainer = resume_auto(out)
    else:
        model, trainer = fit(target, 2, STEPS, out / "two", ckpt_path=out / f"src_{source}.ckpt")
    record(out / f"{source}__{target}.pt", model, trainer)


def resume_auto(out: Path) -> tuple[Any, Any]:
    """Resume pp with ``ckpt_path="auto"``: the pp checkpoint (a sharded directory) in the run's checkpoint folder."""
    root = out / AUTO
    if torch.distributed.get_rank() == 0:  # rank 0 alone looks for it, and tells the others what it found
        shutil.copytree(out / "src_pp.ckpt", root / "checkpoints" / "saved.ckpt")
    return fit("pp", 2, STEPS, root, ckpt_path="auto")


if __name__ == "__main__":
    main()
