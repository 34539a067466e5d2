"""TensorBoard, MLflow and W&B loggers on two processes: every rank names rank 0's version and runs (one run per
tracker, written by rank 0 only), what the runs hold matches what Lightning records for the same project on ddp (fsdp
too), and spawned workers (the Trainer's ``ddp_spawn``, a Cohort's) hand rank 0's runs back to the launching process,
whose loggers then write to those same runs. MLflow uses an sqlite store; W&B runs offline, read back with wandb's own
reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from phalanx_distributed import assert_ok, clean_environment, run_script
from tracker_parity import (
    LIGHTNING_MISSING,
    assert_same_series,
    lightning_available,
    mlflow_run,
    tensorboard_scalars,
    wandb_history,
    wandb_records,
)

pytest.importorskip("mlflow")
pytest.importorskip("wandb")
pytest.importorskip("tensorboard")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """(framework, strategy) -> the output folder of tracker_job.py, each run once on first use; and the MLflow URI."""
    root = tmp_path_factory.mktemp("trackers")
    uri = f"sqlite:///{root / 'store.db'}"
    folders = {name: str(root / "wandb-home" / name) for name in ("dir", "data", "cache", "config", "artifacts")}
    environment = clean_environment(
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        WANDB_CONSOLE="off",
        WANDB_DIR=folders["dir"],
        WANDB_DATA_DIR=folders["data"],
        WANDB_CACHE_DIR=folders["cache"],
        WANDB_CONFIG_DIR=folders["config"],
        WANDB_ARTIFACT_DIR=folders["artifacts"],
    )
    for name in ("WANDB_API_KEY", "WANDB_PROJECT", "WANDB_ENTITY", "MLFLOW_TRACKING_URI"):
        environment.pop(name, None)
    done: dict[tuple[str, str], Path] = {}

    def get(framework: str, strategy: str) -> Path:
        if (framework, strategy) not in done:
            out = root / f"{framework}-{strategy}"
            out.mkdir()
            assert_ok(run_script("tracker_job.py", framework, strategy, str(out), uri, env=environment, timeout=600))
            done[framework, strategy] = out
        return done[framework, strategy]

    return get, uri


def _read(out: Path, uri: str) -> dict:
    main = json.loads((out / "main.json").read_text())
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    _, run_id, wandb_id = main["versions"]
    records = wandb_records(out / "wandb", wandb_id)
    return {
        "main": main,
        "ranks": ranks,
        "tensorboard": tensorboard_scalars(out / "tb" / "tb" / "version_0") if (out / "tb").exists() else {},
        "mlflow": mlflow_run(uri, run_id),
        "wandb": wandb_history(records),
        "wandb_runs": [record["run"]["run_id"] for record in records if record.get("type") == "run"],
    }


# 32 samples over 2 processes, batches of 8: 2 optimizer steps per epoch; validation after steps 2 and 4.
VALIDATION_STEPS = [1, 3]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_every_rank_names_rank_zeros_runs_and_they_hold_what_lightning_records(jobs, strategy):
    get, uri = jobs
    ours = _read(get("phalanx", strategy), uri)
    assert ours["ranks"][0]["versions"] == ours["ranks"][1]["versions"] == ours["main"]["versions"]
    assert ours["ranks"][0]["checkpoints"] == ours["ranks"][1]["checkpoints"]
    assert [step for step, _ in ours["mlflow"]["metrics"]["val_loss"]] == VALIDATION_STEPS
    assert [step for step, _ in ours["wandb"]["val_loss"]] == VALIDATION_STEPS
    assert [step for step, _ in ours["tensorboard"]["val_loss"]] == VALIDATION_STEPS
    assert ours["mlflow"]["status"] == "FINISHED" and len(set(ours["wandb_runs"])) == 1
    if not lightning_available():
        pytest.skip(LIGHTNING_MISSING)
    theirs = _read(get("lightning", "ddp"), uri)  # Lightning's FSDP needs CUDA: its DDP run holds the same values
    assert_same_series(ours["tensorboard"], theirs["tensorboard"], f"TensorBoard, {strategy}")
    assert_same_series(ours["mlflow"]["metrics"], theirs["mlflow"]["metrics"], f"MLflow, {strategy}")
    assert_same_series(ours["wandb"], theirs["wandb"], f"W&B, {strategy}")
    assert ours["mlflow"]["params"] == theirs["mlflow"]["params"]
    # Lightning's other ranks name no run (its loggers share only TensorBoard's version): phalanx names rank 0's.
    assert theirs["ranks"][1]["versions"][1:] == ["None", "None"]


@pytest.mark.parametrize("strategy", ["ddp_spawn", "cohort_ddp_spawn"])
def test_spawned_workers_hand_rank_zeros_runs_back_to_the_launching_process(jobs, strategy):
    get, uri = jobs
    ours = _read(get("phalanx", strategy), uri)
    assert ours["ranks"][0]["versions"] == ours["ranks"][1]["versions"] == ours["main"]["versions"]
    metric = "loss" if strategy.startswith("cohort") else "val_loss"
    assert [step for step, _ in ours["mlflow"]["metrics"][metric]] == ([0, 1] if metric == "loss" else VALIDATION_STEPS)
    assert [step for step, _ in ours["wandb"][metric]] == [step for step, _ in ours["mlflow"]["metrics"][metric]]
    assert ours["mlflow"]["status"] == "FINISHED"  # rank 0's worker ended the run at the end of its stage
    if strategy == "ddp_spawn":  # and this process wrote to the same runs afterwards (W&B resumed the run by id)
        assert ours["main"]["after_writing"] == ours["main"]["versions"]
        assert ours["mlflow"]["metrics"]["in_main_process"] == [(100, 1.0)]
        assert ours["wandb"]["in_main_process"] == [(100, 1.0)]
        assert ours["tensorboard"]["in_main_process"] == [(100, 1.0)]
        assert len(ours["wandb_runs"]) == 2 and len(set(ours["wandb_runs"])) == 1
