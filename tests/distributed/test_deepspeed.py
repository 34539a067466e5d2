"""DeepSpeed ZeRO stages 1-3 on 2 CPU processes (gloo), against DDP running the same fits.

One job per strategy (tests/distributed/scripts/deepspeed_job.py) runs every fit these tests look at, so DeepSpeed
starts only four times in all (its first start compiles a small communication op, cached under
~/.cache/torch_extensions). Skipped when deepspeed is not installed (``pip install 'phalanx[deepspeed]'``).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed on the CPU (it would probe for GPUs and warn otherwise)
pytest.importorskip("deepspeed")

from phalanx_distributed import SCRIPTS, assert_ok, clean_environment, run_script  # noqa: E402

from phalanx.plugins.io.checks import check_loadable  # noqa: E402
from phalanx.plugins.io.formats.deepspeed import (
    STATE_FILE,
    is_deepspeed_checkpoint,
    load_deepspeed_checkpoint_as_full,
)  # noqa: E402
from phalanx.trainer.checkpoint import (
    COMPLETE_MARKER,
    is_complete_checkpoint,
    newest_complete_checkpoint,
)  # noqa: E402

sys.path.insert(0, str(SCRIPTS))  # the job's model serves the single-process checks here too

STAGES = ["deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3"]
# The first DeepSpeed start compiles its shared-memory communication op (about 1.5 minutes on a 2-core machine).
JOB_TIMEOUT = 600


class Jobs:
    """Runs each strategy's job once, on first use; DDP resumes from the stage-2 DeepSpeed checkpoint directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[str, tuple[Path, list[dict[str, Any]]]] = {}

    def get(self, strategy: str) -> tuple[Path, list[dict[str, Any]]]:
        if strategy not in self.done:
            out = self.root / strategy
            out.mkdir()
            extra: list[str] = []
            if strategy == "ddp":
                stage2, _ = self.get("deepspeed_stage_2")
                extra = [str(stage2 / "mid.ckpt")]  # DDP resumes from the DeepSpeed directory itself (read whole)
            job = run_script(
                "deepspeed_job.py",
                strategy,
                str(out),
                *extra,
                env=clean_environment(DS_ACCELERATOR="cpu"),
                timeout=JOB_TIMEOUT,
            )
            assert_ok(job)
            ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
            self.done[strategy] = (out, ranks)
        return self.done[strategy]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Jobs:
    return Jobs(tmp_path_factory.mktemp("deepspeed"))


def _weights(out: Path, fit: str) -> dict[str, torch.Tensor]:
    return torch.load(out / f"weights_{fit}.pt", weights_only=True)


def _assert_weights_close(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], atol: float) -> None:
    assert ours.keys() == reference.keys()
    for name in ours:
        assert torch.allclose(ours[name], reference[name], atol=atol, rtol=0), (
            f"{name}: max difference {(ours[name] - reference[name]).abs().max().item()}"
        )


# ---------------------------------------------------------------------------- fit, validate, checkpoints, resume
@pytest.mark.parametrize("strategy", STAGES)
def test_fit_validate_and_exact_resume(jobs: Jobs, strategy: str) -> None:
    out, (rank0, rank1) = jobs.get(strategy)
    full, resumed = rank0["full"], rank0["resumed"]
    assert full["global_step"] == resumed["global_step"] == 40
    assert full["handles_accumulation"] is True
    # Resumed mid-epoch (after 13 of 20 batches) from the DeepSpeed directory: the same batches, losses and weights.
    assert resumed["losses"] == pytest.approx(full["losses"][13:], rel=1e-6)
    assert resumed["lrs"] == pytest.approx(full["lrs"][13:])  # the per-step scheduler was restored
    _assert_weights_close(_weights(out, "resumed"), _weights(out, "full"), atol=1e-6)
    # ZeRO-3 pads evaluation (one sample twice) so that both ranks run as many forward passes; the others do not.
    expected_count = 52.0 if strategy == "deepspeed_stage_3" else 51.0
    assert full["val_count"] == expected_count
    assert rank0["validate_after_fit"][0]["val_loss"] == pytest.approx(full["val_loss"], rel=1e-6)
    # validate(ckpt_path=DIRECTORY) on a fresh model sees the weights of the moment of the save.
    assert rank0["validate_from_checkpoint"][0]["val_loss"] == pytest.approx(
        rank0["validate_part"][0]["val_loss"], rel=1e-6
    )
    assert rank0["validate_from_checkpoint"] == rank1["validate_from_checkpoint"]
    assert rank0["full"]["val_loss"] == rank1["full"]["val_loss"]
    # predict() returns every sample once, in dataset order (ZeRO-3's padding dropped), as the model computes them.
    from deepspeed_job import VAL_SAMPLES, DSNet, Regression

    model = DSNet()
    model.configure_model()
    model.load_state_dict(_weights(out, "resumed"))
    with torch.no_grad():
        expected = model(Regression(VAL_SAMPLES, seed=1).x).flatten().tolist()
    assert rank0["predictions"] == pytest.approx(expected, abs=1e-5) and rank1["predictions"] == rank0["predictions"]


@pytest.mark.parametrize("strategy", STAGES)
def test_checkpoint_directories_are_complete_and_safe_to_read(jobs: Jobs, strategy: str) -> None:
    out, (rank0, _) = jobs.get(strategy)
    mid = out / "mid.ckpt"
    last = Path(rank0["full"]["last_model_path"])
    for directory in (mid, last):
        assert is_deepspeed_checkpoint(directory)
        assert is_complete_checkpoint(directory) and (directory / COMPLETE_MARKER).exists()
        optimizer_partitions = sorted(p.name for p in (directory / "checkpoint").glob("*optim_states.pt"))
        assert len(optimizer_partitions) == 2  # one per rank
    # ModelCheckpoint replaced last.ckpt every 5 steps: no staging or replaced directory is left behind.
    leftovers = [p.name for p in (*out.iterdir(), *last.parent.iterdir()) if p.name.startswith(".")]
    assert leftovers == []
    assert newest_complete_checkpoint([last.parent]) == str(last.resolve())
    # The Trainer's own state: plain values only, without the weights (those are in DeepSpeed's files).
    state = torch.load(mid / STATE_FILE, weights_only=True)
    assert "state_dict" not in state
    assert state["global_step"] == 13 and state["loops"]["fit_loop"]["batches_done"] == 13
    assert len(state["rng_states"]) == 2
    assert state["deepspeed"]["zero_stage"] == int(strategy[-1]) and state["deepspeed"]["world_size"] == 2


@pytest.mark.parametrize("strategy", STAGES)
def test_consolidated_checkpoint_is_an_ordinary_one(jobs: Jobs, strategy: str, tmp_path: Path) -> None:
    out, _ = jobs.get(strategy)
    full = load_deepspeed_checkpoint_as_full(out / "mid.ckpt")
    check_loadable(full)
    assert full["global_step"] == 13 and full["epoch"] == 0
    saved = _weights(out, "part")
    assert list(full["state_dict"]) == list(saved)  # the module's own names, in state_dict order
    _assert_weights_close(full["state_dict"], saved, atol=0.0)
    assert all(tensor.dtype == torch.float32 for tensor in full["state_dict"].values())
    # The optimizer state in torch's layout: Adam's moments per parameter, as after 13 steps.
    optimizer_state = full["optimizer_states"][0]
    assert optimizer_state["param_groups"][0]["params"] == list(range(len(saved)))
    for index, (name, weight) in enumerate(saved.items()):
        entry = optimizer_state["state"][index]
        assert entry["exp_avg"].shape == weight.shape and entry["exp_avg_sq"].shape == weight.shape
        assert float(entry["step"]) == 13.0
        assert bool((entry["exp_avg_sq"] > 0).any()), name
    assert full["lr_schedulers"][0]["last_epoch"] == 13

    # One process resumes from it: the weights and Adam state arrive, training goes on to step 15.
    path = tmp_path / "consolidated.ckpt"
    torch.save(full, path)
    torch.load(path, weights_only=True)
    from deepspeed_job import DSNet, loaders

    import phalanx

    seen: dict[str, Any] = {}

    class Capture(phalanx.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            seen["weights"] = {name: value.detach().clone() for name, value in module.state_dict().items()}
            seen["steps"] = [float(state["step"]) for state in trainer.optimizers[0].state.values()]

    phalanx.seed_everything(0)
    trainer = phalanx.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=15,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[Capture()],
    )
    model = DSNet()
    train, _ = loaders()
    trainer.fit(model, train, ckpt_path=path)
    _assert_weights_close(seen["weights"], saved, atol=0.0)
    assert seen["steps"] == [13.0] * len(saved)
    assert trainer.global_step == 15


def test_phalanx_checkpoint_consolidate_and_load_from_checkpoint(
    jobs: Jobs, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from deepspeed_job import DSNet

    from phalanx.cli import main

    out, _ = jobs.get("deepspeed_stage_3")
    target = tmp_path / "model.ckpt"
    assert main(["checkpoint", "consolidate", str(out / "mid.ckpt"), str(target)]) == 0
    assert "step 13" in capsys.readouterr().out
    checkpoint = torch.load(target, weights_only=True)
    assert checkpoint["global_step"] == 13 and "optimizer_states" in checkpoint
    for source in (target, out / "mid.ckpt"):  # the file, or the directory read whole
        model = DSNet.load_from_checkpoint(source)
        _assert_weights_close(
            {name: value for name, value in model.state_dict().items()}, _weights(out, "part"), atol=0.0
        )
        assert model.hparams.lr == 0.01


# ---------------------------------------------------------------------------- agreement with DDP
@pytest.mark.parametrize("strategy", STAGES)
def test_training_agrees_with_ddp_for_20_steps(jobs: Jobs, strategy: str) -> None:
    out, (rank0, _) = jobs.get(strategy)
    ddp_out, (ddp0, _) = jobs.get("ddp")
    assert len(rank0["parity"]["losses"]) == len(ddp0["parity"]["losses"]) == 20
    assert rank0["parity"]["losses"] == pytest.approx(ddp0["parity"]["losses"], rel=1e-5)
    _assert_weights_close(_weights(out, "parity"), _weights(ddp_out, "parity"), atol=1e-6)


@pytest.mark.parametrize("strategy", STAGES)
def test_gradient_accumulation_and_clipping_agree_with_ddp(jobs: Jobs, strategy: str) -> None:
    out, (rank0, _) = jobs.get(strategy)
    ddp_out, (ddp0, _) = jobs.get("ddp")
    ours, reference = rank0["accumulate"], ddp0["accumulate"]
    assert ours["config"] == {
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.5,
        "train_micro_batch_size_per_gpu": 8,
    }
    # 12 optimizer updates over 24 batches: DeepSpeed's global_step counts batches, DDP's optimizer steps.
    assert (ours["global_step"], reference["global_step"]) == (24, 12)
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert ours["lrs"] == pytest.approx(reference["lrs"])  # the per-step scheduler steps once per update
    _assert_weights_close(_weights(out, "accumulate"), _weights(ddp_out, "accumulate"), atol=1e-5)


def test_ddp_resumes_from_a_deepspeed_checkpoint_directory(jobs: Jobs) -> None:
    stage2_out, (stage2, _) = jobs.get("deepspeed_stage_2")
    ddp_out, (ddp0, ddp1) = jobs.get("ddp")
    resumed = ddp0["resumed_from_checkpoint"]
    assert resumed["global_step"] == 40 and ddp1["resumed_from_checkpoint"]["global_step"] == 40
    # From the same state (weights, Adam moments, scheduler, loop position, generators), DDP continues as DeepSpeed did.
    assert resumed["losses"] == pytest.approx(stage2["resumed"]["losses"], rel=1e-5)
    _assert_weights_close(_weights(ddp_out, "resumed_from_checkpoint"), _weights(stage2_out, "resumed"), atol=1e-5)


# ---------------------------------------------------------------------------- memory
@pytest.mark.parametrize("strategy", STAGES)
def test_memory_per_rank_matches_zero_predictions(jobs: Jobs, strategy: str) -> None:
    _, ranks = jobs.get(strategy)
    _, (ddp0, _) = jobs.get("ddp")
    parameters = ranks[0]["full"]["num_parameters"]
    world_size = 2
    assert ddp0["full"]["memory"]["parameters"] == 4 * parameters  # DDP: every rank holds everything
    for report in ranks:
        memory = report["full"]["memory"]
        # ZeRO stage >= 1 with Adam: float32 master weights + two moments = 12 bytes per parameter, split over the
        # ranks.
        predicted_states = 12 * parameters / world_size
        assert memory["optimizer_states"] / predicted_states == pytest.approx(1.0, abs=0.10)
        if strategy == "deepspeed_stage_3":
            # Parameters partitioned too (tensors under 100k elements stay whole: here about 1% of the model).
            assert memory["parameters"] / (4 * parameters / world_size) == pytest.approx(1.0, abs=0.10)
        else:
            assert memory["parameters"] == 4 * parameters


def test_zero3_partitions_parameters_as_configure_model_creates_them(jobs: Jobs) -> None:
    _, (stage3, _) = jobs.get("deepspeed_stage_3")
    _, (stage2, _) = jobs.get("deepspeed_stage_2")
    assert stage3["full"]["created_partitioned"] == [True] * 6
    assert stage2["full"]["created_partitioned"] == [False] * 6


# ---------------------------------------------------------------------------- optimization variants
@pytest.mark.parametrize("strategy", STAGES)
def test_manual_optimization_follows_automatic(jobs: Jobs, strategy: str) -> None:
    _, (rank0, rank1) = jobs.get(strategy)
    assert rank0["manual"]["global_step"] == 5
    assert rank0["manual"]["losses"] == pytest.approx(rank0["full"]["losses"][:5], rel=1e-6)
    assert rank1["manual"]["losses"] == pytest.approx(rank1["full"]["losses"][:5], rel=1e-6)


def test_optimizer_and_scheduler_named_in_the_deepspeed_config(jobs: Jobs) -> None:
    _, (rank0, _) = jobs.get("deepspeed_stage_1")
    run = rank0["config_optimizer"]
    assert run["global_step"] == 6 and run["schedulers"] == 1
    assert (run["optimizer"], run["base_optimizer"]) == (
        "DeepSpeedZeroOptimizer",
        "AdamW",
    )  # ZeRO-1 around the config's AdamW
    # WarmupLR from the config, stepped by the engine after each update: 0 -> 0.01 in 4 steps.
    assert run["lrs"] == pytest.approx([0.0, 0.0025, 0.005, 0.0075, 0.01, 0.01])
    assert run["weights_changed"] and all(math.isfinite(loss) for loss in run["losses"])


def test_bf16_mixed_keeps_a_bfloat16_module_and_float32_master_weights(jobs: Jobs) -> None:
    _, (rank0, _) = jobs.get("deepspeed_stage_2")
    run = rank0["bf16"]
    parameters = rank0["full"]["num_parameters"]
    assert run["param_dtypes"] == ["torch.bfloat16"] and run["bf16_config"] == {"enabled": True}
    assert run["memory"]["parameters"] == 2 * parameters
    assert run["memory"]["master_weights"] / (4 * parameters / 2) == pytest.approx(1.0, abs=0.01)
    assert run["losses"] == pytest.approx(rank0["full"]["losses"][: len(run["losses"])], rel=0.05)


@pytest.mark.parametrize("strategy", ["deepspeed_stage_2", "deepspeed_stage_3"])
def test_cpu_offload_follows_the_run_without_it(jobs: Jobs, strategy: str) -> None:
    _, (rank0, _) = jobs.get(strategy)
    run = rank0["offload"]  # f"{strategy}_offload" with DeepSpeedCPUAdam, against Adam without offload
    assert run["global_step"] == 5 and run["offload_optimizer"] == "cpu"
    assert run["offload_param"] == ("cpu" if strategy == "deepspeed_stage_3" else None)
    assert run["losses"] == pytest.approx(rank0["full"]["losses"][:5], rel=1e-4)
